"""Fine-tuning a diffusion UNet: start from a diffusers-format folder, fully or with LoRA (peft), and export.

A *diffusers-format folder* is what `ModelMixin.save_pretrained` writes:
`config.json` + `diffusion_pytorch_model.safetensors`, at a local path or any
fsspec URL (read with `checkpoint.storage_options`). gentrain keeps building
the UNet from its own `model.*` keys (so a checkpoint always describes its
architecture, and sampling or resuming a full fine-tune never needs the folder
again; a LoRA run's does, see below), compares
that build with the folder's `config.json`, and refuses a mismatch naming the
key to change (exit 2).

With `lora`, peft's `inject_adapter_in_model` wraps the UNet's attention and
convolution layers (`lora.targets`); the pretrained weights are frozen and only
the adapters train, so only they reach the optimizer (the engine optimizes a
part's `requires_grad` parameters). Checkpoints hold the adapters only (`saved_keys`:
their weights, optimizer state and EMA); the frozen base is pinned by the folder's
digest and rebuilt from it by every resume, sample and export. `gentrain checkpoints export`
writes the merged model (W + scale * B @ A, merged by peft) as a diffusers
folder and the adapters alone as `pytorch_lora_weights.safetensors` in the
layout `PeftAdapterMixin.save_lora_adapter` writes (peft key names, the
LoraConfig in the safetensors metadata), which `UNet2DConditionModel.load_lora_adapter`
reads back.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import posixpath
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from trainer.checkpoint.format import new_digest
from trainer.checkpoint.validity import InputRecord
from trainer.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
# gentrain's own conditioning layers around a cascade stage's UNet (class, augmentation level, text and
# image-embedding projections): not part of any diffusers model, so they travel in a file of their own.
EXTRAS_NAME = "gentrain_conditioning.safetensors"
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
LORA_METADATA_KEY = "lora_adapter_metadata"  # diffusers' LORA_ADAPTER_METADATA_KEY

# Config entries that do not change which weights exist or what the network computes with them.
_IGNORED_CONFIG = {
    "_class_name",
    "_diffusers_version",
    "_name_or_path",
    "sample_size",
    "dropout",
    "_use_default_values",
}


class LoraSettings(BaseModel):
    """`lora.*`: the adapters peft puts on the UNet (Hu et al. 2021, arXiv:2106.09685)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(4, ge=1, description="r: the adapters' inner width")
    alpha: float | None = Field(
        None, gt=0, description="lora_alpha; the update is scaled by alpha / rank (default rank)"
    )
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[str] | None = Field(
        default=None,
        min_length=1,
        description="module names (suffixes) to adapt; default: the backbone's (a UNet's attention projections "
        "and ResNet convolutions, a transformer's attention projections)",
    )
    text_encoder: bool = Field(
        False,
        description="also train LoRA (same rank, alpha, dropout) on the pipeline's CLIP text encoder(s), on "
        "q_proj, k_proj, v_proj, out_proj as diffusers' LoRA scripts' --train_text_encoder; captions are then "
        "encoded in every step (no embedding cache). ddpm runs from an SD 1.x/2.x or SDXL pipeline folder only",
    )

    def peft_config(self, default_targets: Sequence[str]):
        from peft import LoraConfig

        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha if self.alpha is not None else self.rank,
            lora_dropout=self.dropout,
            target_modules=list(self.targets or default_targets),
            init_lora_weights=True,  # B = 0: the adapted model starts exactly at the pretrained one
        )


class FinetuneFields(BaseModel):
    """`pretrained` and `lora`, shared by the DDPM UNet (`model.*`) and each cascade stage (`model.stages[i].*`)."""

    pretrained: str | None = Field(
        None,
        description="diffusers-format folder (config.json + diffusion_pytorch_model.safetensors), path or URL; "
        "ddpm: or a released pipeline's folder (model_index.json: Stable Diffusion 1.x/2.x), whose unet, vae, "
        "text encoder, tokenizer and scheduler then set the run's keys (docs/tasks/pipelines.md)",
    )
    lora: LoraSettings | None = Field(None, description="train LoRA adapters on the frozen pretrained UNet")

    @model_validator(mode="after")
    def _lora_needs_pretrained(self) -> FinetuneFields:
        if self.lora is not None and self.pretrained is None:
            raise ValueError(
                "lora adapts pretrained weights: set pretrained (a diffusers-format folder) too, or remove lora"
            )
        return self


@dataclass
class PretrainedFolder:
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    extras: dict[str, torch.Tensor] | None
    record: InputRecord  # url, digest, files: recorded in the run's checkpoints (`inputs`)


def read_folder(url: str, key: str, storage_options: Mapping[str, Any] | None = None) -> PretrainedFolder:
    """config.json and the weights of a diffusers-format folder (plus gentrain's conditioning file when present)."""
    import fsspec
    from safetensors.torch import load as load_safetensors

    try:
        fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        names = {posixpath.basename(p.rstrip("/")) for p in fs.ls(root.rstrip("/"), detail=False)}
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{key}={url!r}: cannot list that folder ({e}). Check the path and checkpoint.storage_options."
        ) from None
    missing = [n for n in (CONFIG_NAME, WEIGHTS_NAME) if n not in names]
    if missing:
        hint = (
            " (sharded diffusers weights are not supported: save with max_shard_size large enough)"
            if any(n.endswith(".index.json") for n in names)
            else ""
        )
        raise ConfigError(
            f"{key}={url!r} has no {' and no '.join(missing)}{hint}. A diffusers-format folder holds {CONFIG_NAME} and "
            f"{WEIGHTS_NAME}, as written by save_pretrained or `gentrain checkpoints export`."
        )
    h = new_digest("blake3")
    blobs = {}
    for name in (CONFIG_NAME, WEIGHTS_NAME, EXTRAS_NAME):
        if name in names:
            blobs[name] = fs.cat_file(posixpath.join(root.rstrip("/"), name))
            h.update(f"{name}\0{len(blobs[name])}\0".encode())
            h.update(blobs[name])
    try:
        config = json.loads(blobs[CONFIG_NAME])
        tensors = load_safetensors(blobs[WEIGHTS_NAME])
        extras = load_safetensors(blobs[EXTRAS_NAME]) if EXTRAS_NAME in blobs else None
    except (ValueError, RuntimeError) as e:  # safetensors raises SafetensorError (a RuntimeError subclass)
        raise ConfigError(f"{key}={url!r}: unreadable {CONFIG_NAME} or safetensors file ({e})") from None
    record = InputRecord(url=url, digest=f"blake3:{h.hexdigest()}", files=sorted(blobs))
    return PretrainedFolder(config, tensors, extras, record)


def check_architecture(unet: nn.Module, folder_config: Mapping[str, Any], key: str, hints: Mapping[str, str]) -> None:
    """Refuse a folder whose UNet differs from the one `model.*` builds; `hints` maps config fields to keys."""
    built = dict(unet.config)
    if folder_config.get("_class_name") not in (None, type(unet).__name__):
        raise ConfigError(
            f"{key}: the folder holds a {folder_config['_class_name']}, but this model trains a {type(unet).__name__}"
        )
    diffs = []
    for field, want in built.items():
        if field in _IGNORED_CONFIG or field.startswith("_") or field not in folder_config:
            continue
        have = folder_config[field]
        if _normalize(have) != _normalize(want):
            where = hints.get(field)
            fix = f" (set {where})" if where else " (not a gentrain key: this UNet cannot be described by model.*)"
            diffs.append(f"{field}: folder {have!r}, gentrain builds {_normalize(want)!r}{fix}")
    if diffs:
        raise ConfigError(
            f"{key}: the pretrained UNet's architecture differs from the configured one:\n  " + "\n  ".join(diffs)
        )


def _normalize(value: Any) -> Any:
    return list(value) if isinstance(value, tuple | list) else value


def load_weights(module: nn.Module, tensors: Mapping[str, torch.Tensor], key: str, what: str, skip: str = "") -> None:
    """Strict load: every weight present and of the right shape, else a ConfigError naming `key`.
    State-dict entries starting with `skip` (a submodule loaded on its own) are left out."""
    own = {k: v for k, v in module.state_dict().items() if not (skip and k.startswith(skip))}
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    shapes = [
        f"{k} {tuple(tensors[k].shape)} vs {tuple(own[k].shape)}"
        for k in own
        if k in tensors and tensors[k].shape != own[k].shape
    ]
    if missing or unexpected or shapes:
        raise ConfigError(
            f"{key}: {what} do not fit the model gentrain builds (missing {missing[:4]}, unexpected {unexpected[:4]}, "
            f"shape mismatches {shapes[:4]})"
        )
    if any(p.is_meta for p in module.parameters()):
        return  # built on the meta device (FSDP, ranks but 0): its slices come from rank 0's values
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()}, strict=not skip)


def apply_lora(unet: nn.Module, settings: LoraSettings, key: str, default_targets: Sequence[str]) -> int:
    """Wrap the target layers (`settings.targets`, else the backbone's `default_targets`) with LoRA adapters
    (everything else frozen); returns the adapter parameter count."""
    if importlib.util.find_spec("peft") is None:  # the `lora` extra: a run without LoRA never needs it
        raise ConfigError(f"{key} needs peft: pip install 'gentrain[lora]'")
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(settings.peft_config(default_targets), unet)
    except ValueError as e:
        layers = sorted({n.rsplit(".", 1)[-1] for n, m in unet.named_modules() if isinstance(m, nn.Linear | nn.Conv2d)})
        targets = settings.targets or list(default_targets)
        raise ConfigError(f"{key}.targets={targets}: {e}. Layer names in this model: {layers}") from None
    return sum(p.numel() for p in unet.parameters() if p.requires_grad)


# diffusers' train_dreambooth_lora.py / train_dreambooth_lora_sdxl.py --train_text_encoder: every CLIP
# attention projection. A LoRA-trained text encoder is a child of the denoiser's module under its pipeline slot
# (so its adapters train, checkpoint and export with the denoiser's): its keys are then `text_encoder.*`, the
# prefix diffusers' `load_lora_weights` reads them under.
TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "out_proj")
TEXT_SLOTS = ("text_encoder", "text_encoder_2")


def attach_text_lora(net: nn.Module, encoders: Sequence[nn.Module], settings: LoraSettings, key: str) -> dict:
    """Copies of the frozen CLIP `encoders` (a pipeline's text_encoder, text_encoder_2) with LoRA adapters on
    `TEXT_LORA_TARGETS` (the rank, alpha and dropout of `settings`), made children of `net` under their slot
    names; returns {slot: the adapted copy}. The originals stay frozen and unadapted (they embed nothing for
    such a run: its captions are encoded by the copies, in each step)."""
    if importlib.util.find_spec("peft") is None:
        raise ConfigError(f"{key} needs peft: pip install 'gentrain[lora]'")
    from peft import inject_adapter_in_model  # the `lora` extra: only a run that adapts its text encoder

    text = settings.model_copy(update={"targets": list(TEXT_LORA_TARGETS)})
    out = {}
    for slot, encoder in zip(TEXT_SLOTS, encoders, strict=False):
        adapted = copy.deepcopy(encoder).requires_grad_(False)
        inject_adapter_in_model(text.peft_config(TEXT_LORA_TARGETS), adapted)
        net.add_module(slot, adapted)
        out[slot] = adapted
        n = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
        log.info(
            "%s.text_encoder: LoRA rank %d on %s's %s: %d adapter parameters", key, text.rank, slot, text.targets, n
        )
    return out


def text_children(module: nn.Module) -> dict[str, nn.Module]:
    """{slot: text encoder} of the LoRA-trained text encoders `attach_text_lora` put on `module`."""
    return {slot: child for slot, child in module.named_children() if slot in TEXT_SLOTS}


def _denoiser_only(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.split(".", 1)[0] not in TEXT_SLOTS}


def has_lora(module: nn.Module) -> bool:
    """True if peft put adapters on `module`. Never imports peft (the `lora` extra): only `apply_lora` puts
    adapters on a module and it imports peft first, so while peft is not imported no module has any."""
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return tuners is not None and any(isinstance(m, tuners.BaseTunerLayer) for m in module.modules())


def saved_keys(module: nn.Module) -> set[str] | None:
    """The state-dict keys a checkpoint of `module` holds: for a LoRA-adapted module, its trainable parameters
    (the adapters, and any layer the task left trainable) and its buffers, never the frozen base, which every
    start rebuilds from the pinned `pretrained` folder (the run's `inputs`); None (everything) otherwise.
    Called on a freshly built module, before the engine toggles `requires_grad` (a part not learning now)."""
    if not has_lora(module):
        return None
    persistent = set(module.state_dict())  # non-persistent buffers are never saved
    keys = {n for n, p in module.named_parameters() if p.requires_grad}
    return keys | {n for n, _ in module.named_buffers() if n in persistent}


def cast_frozen_base(module: nn.Module, precision: str) -> None:
    """Under fp16/bf16, keep a LoRA-adapted module's frozen base in the half dtype and its adapters in fp32,
    as diffusers' LoRA scripts do (`unet.to(weight_dtype)` then `cast_training_params`): half the memory
    for the base, full-precision optimizer updates for what trains."""
    if precision == "no" or not has_lora(module):
        return
    from diffusers.training_utils import cast_training_params  # imports peft: only with LoRA adapters on

    module.to(torch.float16 if precision == "fp16" else torch.bfloat16)
    cast_training_params(module, dtype=torch.float32)


def half_weights_autocast(modules: Mapping[str, nn.Module], device: torch.device):
    """Autocast in the half dtype some module stores weights in (a LoRA base under fp16/bf16), else nothing.

    Training runs under autocast anyway; previews and evaluation do not, and fp32 activations cannot meet
    bf16 weights outside it (diffusers' LoRA scripts validate under autocast for the same reason)."""
    from contextlib import nullcontext

    half = {p.dtype for m in modules.values() for p in m.parameters()} & {torch.float16, torch.bfloat16}
    if not half:
        return nullcontext()
    return torch.autocast(device.type, dtype=half.pop())


def lora_state_dict(unet: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters alone, named as peft names them (adapter name removed), fp32 contiguous copies."""
    from peft.utils import get_peft_model_state_dict

    state = _denoiser_only(get_peft_model_state_dict(unet))
    return {k: v.detach().float().contiguous().clone() for k, v in state.items()}


def merged_state_dict(unet: nn.Module) -> dict[str, torch.Tensor]:
    """The plain UNet's weights with the adapters merged in by peft (W + scale * B @ A, in fp32); a text
    encoder trained with it (`text_children`) is not the UNet's (`merged_text_encoder`)."""
    if not has_lora(unet):  # before peft's import: exporting a UNet without adapters must not need the extra
        return {k: v.detach().contiguous().clone() for k, v in _denoiser_only(unet.state_dict()).items()}
    from peft.tuners.tuners_utils import BaseTunerLayer

    work = copy.deepcopy(unet).float()
    for m in work.modules():
        if isinstance(m, BaseTunerLayer):
            m.merge(safe_merge=True)
    return {
        k.replace(".base_layer.", "."): v.detach().contiguous().clone()
        for k, v in _denoiser_only(work.state_dict()).items()
        if ".lora_" not in k
    }


def merged_text_encoder(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """A LoRA-trained text encoder's weights with its adapters merged (transformers' key names)."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # the `lora` extra: it trained adapters

    work = copy.deepcopy(encoder).float()
    for m in work.modules():
        if isinstance(m, BaseTunerLayer):
            m.merge(safe_merge=True)
    return {
        k.replace(".base_layer.", "."): v.detach().contiguous().clone()
        for k, v in work.state_dict().items()
        if ".lora_" not in k
    }


def lora_metadata(unet: nn.Module, prefix: str | None = None) -> dict[str, str]:
    """The safetensors metadata diffusers writes beside adapters: the LoraConfig as JSON (with `prefix`, each
    field under `<prefix>.`, as a pipeline's `save_lora_weights` packs it)."""
    cfg = _peft_fields(unet, prefix)
    for slot, encoder in text_children(unet).items():  # as save_lora_weights packs each component's
        cfg.update(_peft_fields(encoder, slot))
    return {"format": "pt", LORA_METADATA_KEY: json.dumps(cfg, indent=2, sort_keys=True, default=str)}


def _peft_fields(module: nn.Module, prefix: str | None) -> dict[str, Any]:
    cfg = module.peft_config["default"].to_dict()
    cfg = {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}
    return {f"{prefix}.{k}": v for k, v in cfg.items()} if prefix else cfg


def write_folder(
    unet: nn.Module,
    out_url: str,
    extras: Mapping[str, torch.Tensor] | None = None,
    storage_options: Mapping[str, Any] | None = None,
    lora_prefix: str | None = None,
    adapters: bool = True,
) -> list[str]:
    """A diffusers-format folder of the merged UNet (plus gentrain's conditioning layers), and for a LoRA
    model (unless not `adapters`: a merged pipeline) `<out_url>-lora/pytorch_lora_weights.safetensors`;
    returns the URLs written. `lora_prefix` (a released pipeline's denoiser slot, `unet`): the adapters' keys
    and metadata under `<prefix>.`, the layout a pipeline's `load_lora_weights(folder)` reads (unprefixed, it
    silently loads nothing)."""
    import fsspec
    from safetensors.torch import save as save_safetensors

    fs, root = fsspec.core.url_to_fs(out_url.rstrip("/"), **dict(storage_options or {}))
    written = []

    def put(folder: str, name: str, data: bytes) -> None:
        fs.makedirs(folder, exist_ok=True)
        fs.pipe_file(posixpath.join(folder, name), data)
        written.append(posixpath.join(folder, name))

    put(root, CONFIG_NAME, unet.to_json_string().encode())
    put(root, WEIGHTS_NAME, save_safetensors(merged_state_dict(unet), metadata={"format": "pt"}))
    if extras:
        put(root, EXTRAS_NAME, save_safetensors({k: v.detach().contiguous() for k, v in extras.items()}))
    if adapters and has_lora(unet):
        tensors = lora_state_dict(unet)
        if lora_prefix:
            tensors = {f"{lora_prefix}.{k}": v for k, v in tensors.items()}
        for slot, encoder in text_children(unet).items():  # `text_encoder.*`: diffusers' text encoder prefix
            tensors.update({f"{slot}.{k}": v for k, v in lora_state_dict(encoder).items()})
        metadata = lora_metadata(unet, lora_prefix)
        put(f"{root}-lora", LORA_WEIGHTS_NAME, save_safetensors(tensors, metadata=metadata))
    return written


def prepare_unet(
    unet: nn.Module,
    c: FinetuneFields,
    key: str,
    hints: Mapping[str, str],
    storage_options: Mapping[str, Any] | None,
    load: bool,
    lora_targets: Sequence[str],
    within: str | None = None,
    text_lora: bool = False,
) -> PretrainedFolder | None:
    """Load `c.pretrained` into `unet` (when `load`: a training start; inference and resumes overwrite the
    weights anyway) and put LoRA adapters on it (`c.lora.targets`, else the backbone's `lora_targets`). Returns
    the folder read (its `extras` are the caller's). `within`: the subfolder of a pipeline folder holding the
    denoiser (`unet`). `text_lora`: the caller trains `lora.text_encoder` (`attach_text_lora`); others refuse it."""
    if c.lora is not None and c.lora.text_encoder and not text_lora:
        raise ConfigError(
            f"{key}.lora.text_encoder=true: only a ddpm run from a Stable Diffusion 1.x/2.x or SDXL pipeline folder "
            "trains LoRA on its text encoder; set it to false"
        )
    folder = None
    if c.pretrained is not None and load:
        url = f"{c.pretrained.rstrip('/')}/{within}" if within else c.pretrained
        folder = read_folder(url, f"{key}.pretrained", storage_options)
        where = f"{key}.pretrained={url!r}"
        check_architecture(unet, folder.config, where, hints)
        load_weights(unet, folder.tensors, where, f"the weights of {WEIGHTS_NAME}")
        log.info("%s: weights from %s (%s)", key, c.pretrained, folder.record.digest)
    if c.lora is not None:
        n = apply_lora(unet, c.lora, f"{key}.lora", lora_targets)
        targets = c.lora.targets or list(lora_targets)
        log.info("%s: LoRA rank %d on %s: %d trainable adapter parameters", key, c.lora.rank, targets, n)
    return folder
