"""A released diffusers pipeline folder (SD 1.x/2.x, SDXL, SD3/3.5, Flux.1, PixArt-Sigma) read as data: which
family it is, what each component is, how its scheduler trained it, and every file pinned by digest, before
anything is built from it (issue 48, "a pipeline folder in").

A pipeline folder is what `DiffusionPipeline.save_pretrained` writes: `model_index.json` naming each component
as `[library, class]`, and one subfolder per component. `inspect_pipeline` reads it the way gentrain reads
everything from a store: JSON and safetensors only, nothing imported by a name the folder gives.

- **The family** is told by the pipeline class `model_index.json` names (`StableDiffusionPipeline`,
  `StableDiffusionXLPipeline`, `StableDiffusion3Pipeline`, `FluxPipeline`, `PixArtSigmaPipeline`, and the
  img2img/inpaint variants of the same weights), and checked against what it must hold: the denoiser's class
  (`UNet2DConditionModel`, `SD3Transformer2DModel`, `FluxTransformer2DModel`, `PixArtTransformer2DModel`), an
  `AutoencoderKL`, the text encoders and tokenizers of the family, a scheduler. A folder that is none of these,
  or lacks a part, is a ConfigError (exit 2) listing everything missing at once.
- **No code runs**: each component's library must be `diffusers` or `transformers` and its class one this
  module knows for that slot (a folder naming a module of its own, as community pipelines do, is refused);
  weights must be safetensors (`.bin` pickles are refused with the command that converts them); sharded
  weights (`*.safetensors.index.json`, as SDXL's and Flux's large files are saved) are read through their
  index, whose shards must stay inside the component's folder.
- **Pinned**: every file the run will read (configs, weights, tokenizer files) is hashed with blake3 as it is
  streamed (no whole-file reads: a Flux transformer is 24 GB); the record (`url`, `family`, per-file digests
  and sizes, one digest over them) goes into the run's checkpoints like every frozen source's, so a resume
  against a changed folder is refused naming the file.
- **The training objective** comes from the scheduler: epsilon or v-prediction with the DDPM betas for the
  UNet families (`prediction_type`, `num_train_timesteps`, `beta_schedule`, `beta_start`, `beta_end`),
  rectified flow with its `shift` (and Flux.1 dev's resolution-dependent `use_dynamic_shifting`) for
  SD3 and Flux. Flux.1 dev and schnell are one family told apart by the transformer's `guidance_embeds`.
"""

from __future__ import annotations

import copy
import json
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer.checkpoint.format import new_digest
from trainer.checkpoint.validity import InputRecord, PinnedFile
from trainer.errors import ConfigError

MODEL_INDEX = "model_index.json"
_MAX_JSON_BYTES = 4 << 20  # model_index.json, configs and weight indexes are a few KB; a larger one is not one
_CHUNK = 16 << 20

# The classes each kind of slot may hold (library, classes). A tokenizer slot takes any transformers tokenizer
# class (they are data: vocabularies and merges, read by `tokenizers`/sentencepiece, never code).
_VAE = ("diffusers", ("AutoencoderKL",))
_CLIP = ("transformers", ("CLIPTextModel",))
_CLIP_PROJ = ("transformers", ("CLIPTextModelWithProjection",))
_T5 = ("transformers", ("T5EncoderModel",))
_TOKENIZER = "tokenizer"  # a transformers tokenizer class (see `_accepts`)
_SCHEDULER = "scheduler"  # any diffusers class whose name ends in "Scheduler"


@dataclass(frozen=True)
class Family:
    """One family of released pipelines: what its folder holds and how its denoiser trains."""

    name: str  # "sd", "sdxl", "sd3", "flux", "pixart-sigma"
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s
    denoiser: str  # the denoiser's slot ("unet" or "transformer")
    denoiser_class: str
    required: Mapping[str, Any]  # slot -> (library, classes) | _TOKENIZER | _SCHEDULER
    optional: Mapping[str, Any] = field(default_factory=dict)  # slots a folder may hold or set to null
    ignored: tuple[str, ...] = ()  # slots gentrain never reads (a safety checker, an image processor)
    text_kind: str = ""  # model.text.kind its text encoders fill in (the expand_* functions below)


_SD_IGNORED = ("safety_checker", "feature_extractor", "image_encoder")

FAMILIES: tuple[Family, ...] = (
    Family(
        "sd",
        ("StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline", "StableDiffusionInpaintPipeline"),
        "unet",
        "UNet2DConditionModel",
        {"vae": _VAE, "text_encoder": _CLIP, "tokenizer": _TOKENIZER, "scheduler": _SCHEDULER},
        ignored=_SD_IGNORED,
        text_kind="sd",
    ),
    Family(
        "sdxl",
        ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline", "StableDiffusionXLInpaintPipeline"),
        "unet",
        "UNet2DConditionModel",
        {
            "vae": _VAE,
            "text_encoder": _CLIP,
            "text_encoder_2": _CLIP_PROJ,
            "tokenizer": _TOKENIZER,
            "tokenizer_2": _TOKENIZER,
            "scheduler": _SCHEDULER,
        },
        ignored=_SD_IGNORED,
        text_kind="sdxl",
    ),
    Family(
        "sd3",
        ("StableDiffusion3Pipeline", "StableDiffusion3Img2ImgPipeline", "StableDiffusion3InpaintPipeline"),
        "transformer",
        "SD3Transformer2DModel",
        {
            "vae": _VAE,
            "text_encoder": _CLIP_PROJ,
            "text_encoder_2": _CLIP_PROJ,
            "tokenizer": _TOKENIZER,
            "tokenizer_2": _TOKENIZER,
            "scheduler": _SCHEDULER,
        },
        # SD3 runs without T5 (its slot null): diffusers' encode_prompt then pads with zeros.
        optional={"text_encoder_3": _T5, "tokenizer_3": _TOKENIZER},
        ignored=("image_encoder", "feature_extractor"),
        text_kind="sd3",
    ),
    Family(
        "flux",
        ("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"),
        "transformer",
        "FluxTransformer2DModel",
        {
            "vae": _VAE,
            "text_encoder": _CLIP,
            "text_encoder_2": _T5,
            "tokenizer": _TOKENIZER,
            "tokenizer_2": _TOKENIZER,
            "scheduler": _SCHEDULER,
        },
        ignored=("image_encoder", "feature_extractor"),
        text_kind="flux",
    ),
    Family(
        "pixart-sigma",
        ("PixArtSigmaPipeline",),
        "transformer",
        "PixArtTransformer2DModel",
        {"vae": _VAE, "text_encoder": _T5, "tokenizer": _TOKENIZER, "scheduler": _SCHEDULER},
        text_kind="t5",
    ),
)

_WEIGHTS = {"diffusers": "diffusion_pytorch_model.safetensors", "transformers": "model.safetensors"}
_PICKLES = {"diffusers": "diffusion_pytorch_model.bin", "transformers": "pytorch_model.bin"}
_CONFIGS = {"diffusers": "config.json", "transformers": "config.json", _SCHEDULER: "scheduler_config.json"}
# What a tokenizer folder may hold: everything `AutoTokenizer` reads for the CLIP and T5 tokenizers.
_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "spiece.model",
)


@dataclass
class Component:
    slot: str
    library: str
    cls: str
    files: list[str]  # paths relative to the pipeline folder that the run reads
    config: dict[str, Any] | None = None


@dataclass
class Objective:
    """How the pipeline's denoiser was trained, read from its scheduler (`model.objective.*` values)."""

    prediction_type: str  # "epsilon", "v" or "flow"
    num_train_timesteps: int
    beta_schedule: str | None = None
    beta_start: float | None = None
    beta_end: float | None = None
    shift: float | None = None  # flow: the timestep shift (SD3: 3.0; Flux.1 schnell 1.0)
    dynamic_shift: bool = False  # flow: Flux.1 dev's resolution-dependent shift (base_shift .. max_shift)
    base_shift: float | None = None
    max_shift: float | None = None


@dataclass
class PipelineFolder:
    url: str
    family: Family
    components: dict[str, Component]
    objective: Objective
    record: InputRecord  # url, family, files {path: PinnedFile}, digest: pinned in the run's checkpoints

    @property
    def denoiser(self) -> Component:
        return self.components[self.family.denoiser]

    @property
    def variant(self) -> str:
        """The family's variant where the denoiser's config tells it (Flux.1 dev: guidance_embeds)."""
        if self.family.name == "flux":
            return "dev" if (self.denoiser.config or {}).get("guidance_embeds") else "schnell"
        return self.family.name


def family_of(pipeline_class: str) -> Family | None:
    return next((f for f in FAMILIES if pipeline_class in f.pipelines), None)


def pipeline_for_text(text_kind: str) -> str | None:
    """The diffusers pipeline class a fine-tune whose captions are encoded as `text_kind` loads back into."""
    return next((f.pipelines[0] for f in FAMILIES if f.text_kind == text_kind), None)


def _known() -> str:
    return ", ".join(f"{f.pipelines[0]} ({f.name})" for f in FAMILIES)


class _Folder:
    """The pipeline folder on its filesystem: listings and bounded JSON reads, as data."""

    def __init__(self, url: str, key: str, storage_options: Mapping[str, Any] | None):
        import fsspec

        self.url, self.key = url, key
        try:
            self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        except (ValueError, ImportError, TypeError) as e:
            raise ConfigError(f"{key}={url!r}: cannot open that location ({e})") from None
        self.root = root.rstrip("/")

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel)

    def names(self, rel: str = "") -> dict[str, str]:
        """name -> type ('file', 'directory', other) of a folder's entries; {} when it does not exist."""
        try:
            entries = self.fs.ls(self.path(rel) if rel else self.root, detail=True)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise ConfigError(f"{self.key}={self.url!r}: cannot list {rel or 'the folder'} ({e})") from None
        return {posixpath.basename(e["name"].rstrip("/")): e.get("type", "file") for e in entries}

    def size(self, rel: str) -> int:
        # Links are followed: a Hugging Face cache snapshot (`snapshots/<revision>/`) is a folder of links into
        # its blobs. What is read through one is parsed as JSON or safetensors, never run.
        info = self.fs.info(self.path(rel))
        if info.get("type") != "file":
            raise ConfigError(f"{self.key}={self.url!r}: {rel} is not a regular file")
        return int(info.get("size") or 0)

    def json(self, rel: str) -> dict[str, Any]:
        try:
            if self.size(rel) > _MAX_JSON_BYTES:
                raise ConfigError(f"{self.key}={self.url!r}: {rel} is over {_MAX_JSON_BYTES >> 20} MiB: not a config")
            value = json.loads(self.fs.cat_file(self.path(rel)))
        except FileNotFoundError:
            raise ConfigError(f"{self.key}={self.url!r}: {rel} is missing") from None
        except (ValueError, RecursionError) as e:
            raise ConfigError(f"{self.key}={self.url!r}: {rel} is not valid JSON ({e})") from None
        except OSError as e:
            raise ConfigError(f"{self.key}={self.url!r}: cannot read {rel} ({e})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{self.key}={self.url!r}: {rel} holds {type(value).__name__}, not a JSON object")
        return value

    def digest(self, rel: str) -> PinnedFile:
        """blake3 and size of one file, streamed."""
        h = new_digest("blake3")
        n = 0
        try:
            self.size(rel)
            with self.fs.open(self.path(rel), "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
                    n += len(chunk)
        except OSError as e:
            raise ConfigError(f"{self.key}={self.url!r}: cannot read {rel} ({e})") from None
        return PinnedFile(blake3=h.hexdigest(), bytes=n)


def _slot_entry(index: dict[str, Any], slot: str) -> tuple[str, str] | None:
    """(library, class) of `slot` in model_index.json; None when absent or null."""
    entry = index.get(slot)
    if entry is None or entry == [None, None]:
        return None
    if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
        raise ValueError(f"{slot}: {entry!r} is not [library, class]")
    return entry[0], entry[1]


def _accepts(spec: Any, library: str, cls: str) -> bool:
    if spec == _TOKENIZER:
        # CLIPTokenizer, T5TokenizerFast, ... and the generic fast tokenizer (transformers 5 names it
        # TokenizersBackend): `AutoTokenizer` reads each from its files.
        generic = ("PreTrainedTokenizerFast", "TokenizersBackend")
        return library == "transformers" and (cls.endswith(("Tokenizer", "TokenizerFast")) or cls in generic)
    if spec == _SCHEDULER:
        return library == "diffusers" and cls.endswith("Scheduler")
    want_library, classes = spec
    return library == want_library and cls in classes


def _describe(spec: Any) -> str:
    if spec == _TOKENIZER:
        return "a transformers tokenizer"
    if spec == _SCHEDULER:
        return "a diffusers scheduler"
    return " or ".join(f"{spec[0]}.{c}" for c in spec[1])


def _weight_files(folder: _Folder, slot: str, library: str, names: Mapping[str, str], problems: list[str]) -> list[str]:
    """The safetensors files of a model component: the single file, or the shards its index names."""
    single = _WEIGHTS[library]
    if names.get(single) == "file":
        return [f"{slot}/{single}"]
    index_name = f"{single}.index.json"
    if names.get(index_name) == "file":
        try:
            index = folder.json(f"{slot}/{index_name}")
        except ConfigError as e:
            problems.append(str(e).split(": ", 1)[-1])
            return []
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            problems.append(f"{slot}/{index_name} has no weight_map")
            return []
        shards = sorted({v for v in weight_map.values() if isinstance(v, str)})
        bad = [s for s in shards if "/" in s or "\\" in s or s in ("", ".", "..") or not s.endswith(".safetensors")]
        if bad or len(shards) != len(set(weight_map.values())):
            problems.append(f"{slot}/{index_name} names shards outside its folder or not safetensors: {bad[:3]}")
            return []
        missing = [s for s in shards if names.get(s) != "file"]
        if missing:
            problems.append(f"{slot}: the shards {missing[:3]} its index names are missing")
            return []
        return [f"{slot}/{index_name}"] + [f"{slot}/{s}" for s in shards]
    if names.get(_PICKLES[library]) == "file" or any(n.endswith(".bin") for n in names):
        problems.append(
            f"{slot} holds only pickled weights (.bin), which gentrain never loads: save it again with "
            "save_pretrained(..., safe_serialization=True)"
        )
    else:
        problems.append(f"{slot} has no {single} (nor a sharded {index_name})")
    return []


def _component(folder: _Folder, slot: str, library: str, cls: str, spec: Any, problems: list[str]) -> Component | None:
    names = folder.names(slot)
    if not names:
        problems.append(f"{slot}/ is missing (model_index.json names {library}.{cls})")
        return None
    if spec == _TOKENIZER:
        files = [f"{slot}/{n}" for n in _TOKENIZER_FILES if names.get(n) == "file"]
        if not any(n in names for n in ("tokenizer.json", "vocab.json", "spiece.model")):
            problems.append(f"{slot}/ holds no vocabulary (tokenizer.json, vocab.json + merges.txt, or spiece.model)")
            return None
        return Component(slot, library, cls, files)
    config_name = _CONFIGS[_SCHEDULER if spec == _SCHEDULER else library]
    if names.get(config_name) != "file":
        problems.append(f"{slot}/{config_name} is missing")
        return None
    try:
        config = folder.json(f"{slot}/{config_name}")
    except ConfigError as e:
        problems.append(str(e).split(": ", 1)[-1])
        return None
    files = [f"{slot}/{config_name}"]
    if spec != _SCHEDULER:
        weights = _weight_files(folder, slot, library, names, problems)
        if not weights:
            return None
        files += weights
    return Component(slot, library, cls, files, config)


def _objective(scheduler: Component, key: str) -> Objective:
    c = scheduler.config or {}
    steps = c.get("num_train_timesteps", 1000)
    if not isinstance(steps, int) or isinstance(steps, bool) or not 1 <= steps <= 100_000:
        raise ConfigError(f"{key}: scheduler/scheduler_config.json num_train_timesteps={steps!r} is not a count")
    if scheduler.cls.startswith("FlowMatch"):
        shift = c.get("shift", 1.0)
        if not isinstance(shift, int | float) or isinstance(shift, bool) or not 0 < shift <= 100:
            raise ConfigError(f"{key}: scheduler/scheduler_config.json shift={shift!r} is not a positive number")
        dynamic = bool(c.get("use_dynamic_shifting", False))
        return Objective(
            "flow",
            steps,
            shift=float(shift),
            dynamic_shift=dynamic,
            base_shift=c.get("base_shift") if dynamic else None,
            max_shift=c.get("max_shift") if dynamic else None,
        )
    prediction = c.get("prediction_type", "epsilon")
    mapped = {"epsilon": "epsilon", "v_prediction": "v"}.get(prediction)
    if mapped is None:
        raise ConfigError(
            f"{key}: scheduler/scheduler_config.json prediction_type={prediction!r}: gentrain fine-tunes epsilon or "
            "v_prediction denoisers (and flow matching with a FlowMatch scheduler)"
        )
    return Objective(
        mapped,
        steps,
        beta_schedule=c.get("beta_schedule", "linear"),
        beta_start=c.get("beta_start", 0.0001),
        beta_end=c.get("beta_end", 0.02),
    )


def inspect_pipeline(
    url: str, key: str = "model.pretrained", storage_options: Mapping[str, Any] | None = None, digests: bool = True
):
    """The pipeline folder at `url` recognized, checked and pinned (see the module doc); ConfigError (exit 2)
    naming everything wrong with it. `digests=False` skips hashing the files (the record then has none): what
    reading the config needs, before the run pins them."""
    folder = _Folder(url, key, storage_options)
    top = folder.names()
    if not top:
        raise ConfigError(f"{key}={url!r}: no such folder (or it is empty)")
    if top.get(MODEL_INDEX) != "file":
        what = "a single model's folder (config.json)" if "config.json" in top else "no diffusers pipeline folder"
        raise ConfigError(
            f"{key}={url!r} has no {MODEL_INDEX}: it is {what}. A released pipeline's folder (as "
            f"DiffusionPipeline.save_pretrained writes it) holds {MODEL_INDEX} and one subfolder per component"
        )
    index = folder.json(MODEL_INDEX)
    pipeline_class = index.get("_class_name")
    family = family_of(pipeline_class) if isinstance(pipeline_class, str) else None
    if family is None:
        raise ConfigError(
            f"{key}={url!r}: {MODEL_INDEX} names the pipeline {pipeline_class!r}, which gentrain does not fine-tune; "
            f"it reads {_known()}"
        )
    problems: list[str] = []
    slots = {family.denoiser: ("diffusers", (family.denoiser_class,)), **family.required}
    components: dict[str, Component] = {}
    for slot, spec in {**slots, **family.optional}.items():
        try:
            entry = _slot_entry(index, slot)
        except ValueError as e:
            problems.append(f"{MODEL_INDEX}: {e}")
            continue
        if entry is None:
            if slot in slots:
                problems.append(f"{MODEL_INDEX} has no {slot} ({_describe(spec)})")
            continue
        library, cls = entry
        if not _accepts(spec, library, cls):
            problems.append(
                f"{slot} is {library}.{cls}; a {family.pipelines[0]} holds {_describe(spec)} there "
                "(gentrain imports no class a folder names: only these)"
            )
            continue
        found = _component(folder, slot, library, cls, spec, problems)
        if found is not None:
            components[slot] = found
    if problems:
        raise ConfigError(
            f"{key}={url!r} is a {family.pipelines[0]} folder ({family.name}) that gentrain cannot use:\n  "
            + "\n  ".join(problems)
        )
    objective = _objective(components["scheduler"], key)
    if not digests:
        return PipelineFolder(url, family, components, objective, InputRecord(url=url, family=family.name))
    files = {MODEL_INDEX: folder.digest(MODEL_INDEX)}
    for component in components.values():
        for rel in component.files:
            files[rel] = folder.digest(rel)
    h = new_digest("blake3")
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel].bytes}\0{files[rel].blake3}\n".encode())
    record = InputRecord(url=url, family=family.name, files=files, digest=f"blake3:{h.hexdigest()}")
    return PipelineFolder(url, family, components, objective, record)


def changed_files(pinned: InputRecord, now: InputRecord) -> list[str]:
    """The files of a pinned pipeline record (`PipelineFolder.record`) that differ in, or are gone from, the
    folder as it is `now` (another record): what a resume against a changed base names."""
    before = pinned.files if isinstance(pinned.files, dict) else {}
    after = now.files if isinstance(now.files, dict) else {}
    return sorted(rel for rel in before if after.get(rel) != before[rel]) + sorted(set(after) - set(before))


def is_pipeline_folder(url: str, storage_options: Mapping[str, Any] | None = None) -> bool:
    """Whether `url` holds a model_index.json (a pipeline folder, not a single model's); False when unreadable
    (whoever reads it next says why)."""
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        return fs.isfile(posixpath.join(root.rstrip("/"), MODEL_INDEX))
    except (OSError, ValueError, ImportError, TypeError):
        return False


def subfolder(url: str, slot: str) -> str:
    """The URL of one component's folder in the pipeline folder `url` (local path or fsspec URL)."""
    return f"{url.rstrip('/')}/{slot}"


# ---------------------------------------------------------------- a pipeline folder as the ddpm task's keys
# The families the ddpm task trains from a pipeline folder today; the others are read (inspect_pipeline) but
# their denoisers, encoders and conditions are not wired yet (issue 48).
DDPM_FAMILIES = ("sd", "sdxl", "sd3", "pixart-sigma", "flux")
# A denoiser's whole diffusers config, one value: compared and filled as a unit, never key by key.
_OPAQUE = ("unet_config", "transformer_config")
# The backbone keys a pipeline folder's config sets beside its denoiser's config (the rest are shape keys).
_FOLDER_BACKBONE_KEYS = (
    "kind",
    "caption_channels",
    "pooled_channels",
    "pixel_scale",
    "guidance_embeds",
    "guidance_scale",
    *_OPAQUE,
)


def _flat(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, Mapping) and k not in _OPAQUE:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool | str):
        return float(a) == float(b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _merge(into: dict[str, Any], implied: Mapping[str, Any]) -> None:
    for k, v in implied.items():
        if isinstance(v, Mapping) and k not in _OPAQUE and isinstance(into.get(k), Mapping):
            into[k] = dict(into[k])
            _merge(into[k], v)
        elif k not in into or into[k] is None:
            into[k] = copy.deepcopy(v)


def ddpm_keys(p: PipelineFolder, storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ddpm task's `model.*` keys a pipeline folder implies: the denoiser (its own config), the frozen VAE,
    the frozen text encoder and tokenizer, and the objective from the scheduler."""
    if p.family.name not in DDPM_FAMILIES:
        raise ConfigError(
            f"model.pretrained={p.url!r} is a {p.family.pipelines[0]} folder ({p.family.name}): gentrain reads it, "
            f"but trains only {', '.join(DDPM_FAMILIES)} pipeline folders so far (SD 1.x/2.x, SDXL, SD3/3.5, PixArt-Sigma, Flux.1); the {p.family.name} "
            "denoiser, encoders and conditions are not wired yet (issue 48)"
        )
    if p.family.name == "sd3":
        return _sd3_keys(p, storage_options)
    if p.family.name == "pixart-sigma":
        return _pixart_keys(p)
    if p.family.name == "flux":
        return _flux_keys(p, storage_options)
    unet = dict(p.components["unet"].config or {})
    text_cfg = _text_config(p, "text_encoder")
    tokens = _clip_tokens(p, "tokenizer", text_cfg, storage_options)
    text = {
        "kind": "sd",
        "encoder": subfolder(p.url, "text_encoder"),
        "tokenizer": subfolder(p.url, "tokenizer"),
        "width": text_cfg.get("hidden_size"),
        "max_tokens": tokens,
    }
    if p.family.name == "sdxl":
        # CLIP-L's and CLIP-G's penultimate states side by side; pooled: CLIP-G's projection.
        g = _text_config(p, "text_encoder_2")
        text.update(
            kind="sdxl",
            encoder_2=subfolder(p.url, "text_encoder_2"),
            tokenizer_2=subfolder(p.url, "tokenizer_2"),
            width=(text_cfg.get("hidden_size") or 0) + (g.get("hidden_size") or 0),
            pooled_width=g.get("projection_dim"),
            max_tokens=min(tokens, int(g.get("max_position_embeddings", 77))),
        )
    o = p.objective
    objective = {
        "prediction_type": {"epsilon": "epsilon", "v": "v_prediction"}[o.prediction_type],
        "num_train_timesteps": o.num_train_timesteps,
        "beta_schedule": o.beta_schedule,
        "beta_start": o.beta_start,
        "beta_end": o.beta_end,
    }
    return {
        "backbone": {"kind": "unet", "caption_channels": unet.get("cross_attention_dim"), "unet_config": unet},
        "autoencoder": {"url": subfolder(p.url, "vae")},
        "text": text,
        **objective,
    }


def _text_config(p: PipelineFolder, slot: str) -> dict[str, Any]:
    c = p.components[slot].config or {}
    return c.get("text_config", c)  # a full CLIPConfig holds the text model's under text_config


def _clip_tokens(p: PipelineFolder, tokenizer: str, text_cfg: Mapping[str, Any], storage_options) -> int:
    """The tokens a pipeline's encode_prompt gives a CLIP: its tokenizer's model_max_length, at most the model's
    positions and 77."""
    positions = int(text_cfg.get("max_position_embeddings", 77))
    return min(_model_max_length(p, storage_options, tokenizer), positions, 77)


# T5's tokens for SD3: diffusers' train_dreambooth_lora_sd3.py's --max_sequence_length default (the pipeline's
# encode_prompt pads to 256 unless told otherwise); model.text.max_tokens changes it.
SD3_T5_TOKENS = 77


def _sd3_keys(p: PipelineFolder, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """An SD3/3.5 folder's keys: the SD3Transformer2DModel from its own config (kind mmdit), CLIP-L + CLIP-G +
    T5 as StableDiffusion3Pipeline.encode_prompt combines them (kind sd3), rectified flow with the scheduler's
    shift."""
    if "text_encoder_3" not in p.components:
        raise ConfigError(
            f"model.pretrained={p.url!r} is an SD3 folder without T5 (text_encoder_3 null): gentrain trains SD3 "
            "with its three text encoders only; use a folder that holds text_encoder_3 and tokenizer_3"
        )
    transformer = dict(p.denoiser.config or {})
    clip_l, clip_g = _text_config(p, "text_encoder"), _text_config(p, "text_encoder_2")
    t5 = p.components["text_encoder_3"].config or {}
    clip_tokens = min(
        _clip_tokens(p, "tokenizer", clip_l, storage_options), _clip_tokens(p, "tokenizer_2", clip_g, storage_options)
    )
    text = {
        "kind": "sd3",
        **{
            f"{role}{n}": subfolder(p.url, f"{slot}{n}")
            for n in ("", "_2", "_3")
            for role, slot in (("encoder", "text_encoder"), ("tokenizer", "tokenizer"))
        },
        "width": t5.get("d_model"),
        "pooled_width": (clip_l.get("projection_dim") or 0) + (clip_g.get("projection_dim") or 0),
        "clip_max_tokens": clip_tokens,
        "max_tokens": SD3_T5_TOKENS,
    }
    o = p.objective
    if o.prediction_type != "flow" or o.dynamic_shift:
        raise ConfigError(
            f"model.pretrained={p.url!r}: an SD3 folder's scheduler must be FlowMatchEulerDiscreteScheduler with a "
            f"fixed shift (this one: {p.components['scheduler'].cls}, dynamic shifting {o.dynamic_shift})"
        )
    backbone = {
        "kind": "mmdit",
        "caption_channels": transformer.get("joint_attention_dim"),
        "pooled_channels": transformer.get("pooled_projection_dim"),
        "transformer_config": transformer,
    }
    return {
        "backbone": backbone,
        "autoencoder": {"url": subfolder(p.url, "vae")},
        "text": text,
        "prediction_type": "flow",
        "num_train_timesteps": o.num_train_timesteps,
        "flow_shift": o.shift,
    }


# T5's tokens for PixArt-Sigma: PixArtSigmaPipeline.encode_prompt's max_sequence_length (PixArt-alpha: 120).
PIXART_SIGMA_T5_TOKENS = 300


def _pixart_keys(p: PipelineFolder) -> dict[str, Any]:
    """A PixArt-Sigma folder's keys: the PixArtTransformer2DModel from its own config (kind pixart; a learned
    variance's half of the output is left out, as the pipeline does), T5 with its mask as PixArtSigmaPipeline
    runs it (kind t5, 300 tokens), epsilon or v with the scheduler's betas."""
    transformer = dict(p.denoiser.config or {})
    t5 = p.components["text_encoder"].config or {}
    vae = p.components["vae"].config or {}
    o = p.objective
    if o.prediction_type == "flow":
        raise ConfigError(
            f"model.pretrained={p.url!r}: a PixArt-Sigma folder with a flow-matching scheduler is not wired"
        )
    text = {
        "kind": "t5",
        "encoder": subfolder(p.url, "text_encoder"),
        "tokenizer": subfolder(p.url, "tokenizer"),
        "width": t5.get("d_model"),
        "max_tokens": PIXART_SIGMA_T5_TOKENS,
    }
    backbone = {
        "kind": "pixart",
        "caption_channels": transformer.get("caption_channels"),
        # the VAE's downsampling: PixArt's resolution micro-conditions are in pixels
        "pixel_scale": 2 ** (len(vae.get("block_out_channels") or (0,)) - 1),
        "transformer_config": transformer,
    }
    return {
        "backbone": backbone,
        "autoencoder": {"url": subfolder(p.url, "vae")},
        "text": text,
        "prediction_type": {"epsilon": "epsilon", "v": "v_prediction"}[o.prediction_type],
        "num_train_timesteps": o.num_train_timesteps,
        "beta_schedule": o.beta_schedule,
        "beta_start": o.beta_start,
        "beta_end": o.beta_end,
    }


# T5's tokens for Flux.1 (FluxPipeline's max_sequence_length: dev 512; schnell reads at most 256).
FLUX_T5_TOKENS = {"dev": 512, "schnell": 256}


def _flux_keys(p: PipelineFolder, storage_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """A Flux.1 folder's keys: the FluxTransformer2DModel from its own config (kind flux; dev's guidance
    embedding told `model.backbone.guidance_scale`), CLIP-L's pooled output + T5's tokens as FluxPipeline's
    encode_prompt (kind flux), rectified flow on the training sigmas diffusers' train_dreambooth_lora_flux.py
    draws from: the scheduler's, shifted by `shift` unless it shifts dynamically (dev: unshifted)."""
    transformer = dict(p.denoiser.config or {})
    clip_l, t5 = _text_config(p, "text_encoder"), p.components["text_encoder_2"].config or {}
    o = p.objective
    if o.prediction_type != "flow":
        raise ConfigError(
            f"model.pretrained={p.url!r}: a Flux.1 folder's scheduler must be FlowMatchEulerDiscreteScheduler "
            f"(this one: {p.components['scheduler'].cls})"
        )
    text = {
        "kind": "flux",
        "encoder": subfolder(p.url, "text_encoder"),
        "tokenizer": subfolder(p.url, "tokenizer"),
        "encoder_2": subfolder(p.url, "text_encoder_2"),
        "tokenizer_2": subfolder(p.url, "tokenizer_2"),
        "width": t5.get("d_model"),
        "pooled_width": clip_l.get("hidden_size"),
        "clip_max_tokens": _clip_tokens(p, "tokenizer", clip_l, storage_options),
        "max_tokens": FLUX_T5_TOKENS[p.variant],
    }
    backbone = {
        "kind": "flux",
        "caption_channels": transformer.get("joint_attention_dim"),
        "pooled_channels": transformer.get("pooled_projection_dim"),
        "guidance_embeds": bool(transformer.get("guidance_embeds", False)),
        "transformer_config": transformer,
    }
    return {
        "backbone": backbone,
        "autoencoder": {"url": subfolder(p.url, "vae")},
        "text": text,
        "prediction_type": "flow",
        "num_train_timesteps": o.num_train_timesteps,
        "flow_shift": 1.0 if o.dynamic_shift else o.shift,
    }


def _model_max_length(p: PipelineFolder, storage_options: Mapping[str, Any] | None, slot: str = "tokenizer") -> int:
    """The tokenizer's model_max_length (what encode_prompt pads to), 77 when it names none or a huge one."""
    folder = _Folder(p.url, "model.pretrained", storage_options)
    try:
        value = folder.json(f"{slot}/tokenizer_config.json").get("model_max_length")
    except ConfigError:
        return 77
    return int(value) if isinstance(value, int) and 0 < value <= 77 else 77


def expand_ddpm_model(model: Mapping[str, Any], storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`model.*` with what a pipeline folder at `model.pretrained` implies filled in (`ddpm_keys`), so the run's
    saved config says explicitly what it trains; a key the user set to another value than the folder's is a
    ConfigError naming both. Any other `model.pretrained` (a single UNet's folder, or none) is left alone."""
    url = model.get("pretrained")
    if not isinstance(url, str) or not is_pipeline_folder(url, storage_options):
        return dict(model)
    p = inspect_pipeline(url, "model.pretrained", storage_options, digests=False)
    implied = ddpm_keys(p, storage_options)
    given = _flat(model)
    clashes = [
        f"model.{k}={given[k]!r} (the folder's: {v!r})"
        for k, v in _flat(implied).items()
        if given.get(k) is not None and not _same(given[k], v) and k != "text.max_tokens"
    ]
    backbone = model.get("backbone")
    if isinstance(backbone, Mapping):
        shape = sorted(k for k in backbone if k not in _FOLDER_BACKBONE_KEYS)
        where = f"{p.family.denoiser}/config.json shapes the {p.family.denoiser}"
        clashes += [f"model.backbone.{k} (the folder's {where})" for k in shape]
    if clashes:
        raise ConfigError(
            f"model.pretrained={url!r} is a {p.family.pipelines[0]} folder, which sets these keys itself; remove "
            "them (or point them at the same values): " + "; ".join(clashes)
        )
    out = dict(model)
    _merge(out, implied)
    return out
