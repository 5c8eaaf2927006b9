"""Backbones: the denoising networks an objective drives, diffusers' model classes behind one call.

Every backbone is `forward(x, t, cond) -> Tensor` of x's shape, where `t` is what the objective tells
the network of the noise level (a scalar or one value per sample) and `cond` maps condition names to
tensors:

- `labels` (N,) int64, class labels; the null class for guidance is `num_classes`;
- `captions` (N, L, D) caption token embeddings, `caption_mask` (N, L) 1 = keep;
- `pooled` (N, P) a pooled caption embedding;
- `resolution` (N, 2) and `aspect_ratio` (N, 1): PixArt's micro-conditions (default: the input's size);
- `time_ids` (N, 6): SDXL's micro-conditions (original size, crop top-left, target size, in pixels).

A backbone takes only the conditions in its `accepts` and needs those in `requires`; anything else is
a ConfigError, so a flag or data field the model cannot use is refused rather than silently ignored.

A backbone class is the one place that says what its kind takes and offers, so tasks ask it instead of
testing kind strings: its config schema (`Config`, one kind of `model.backbone.*`), whether it takes class
labels, its caption and pooled widths, how a cascade stage conditions it (`stage_conditioning`), the
diffusers pipeline that samples an export of it (`pipeline`), the ddpm part it is saved as (`part`), the
config keys behind its diffusers config fields (`config_hints`), its FSDP units, which of its linears float8
may convert (`float8_per_sample`) and where LoRA goes by default (`lora_targets`). Each kind is one module
of this package that sets `BACKBONE`, listed in the registry (`trainer.diffusion.backbones`).

The diffusers module is `backbone.model`; `call(model, x, t, cond)` runs one without the wrapper (a part
saved as the bare diffusers module keeps its state-dict keys): the backbone's own module, or a wrapper of it
(DDP), whose architecture `call` reads from `backbone.model`. `fsdp_unit_classes` names the blocks that
become FSDP units (every transformer block; a UNet's down and up blocks); a unit the model calls again after
its own forward is named in the model's `fsdp_gathered_units` and stays gathered until its backward (DiT's
first block).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from trainer.errors import ConfigError

Tensor = torch.Tensor

# diffusers' class is imported in `build`, from its own module: the registry imports every backbone module,
# and the caption models' modules import diffusers' loaders (peft, scipy), which a run of another kind must
# not pay for (trainer/lazy_packages.py, tests/test_startup.py).


class TransformerConfig(BaseModel):
    """The shape keys every transformer backbone shares."""

    model_config = ConfigDict(extra="forbid")

    patch_size: int = Field(2, ge=1)
    num_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    attention_head_dim: int = Field(32, ge=1)

    @property
    def width(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch(self) -> int:
        """The patch side: a released transformer's own config's (`transformer_config`, where a kind has one)."""
        t = getattr(self, "transformer_config", None)
        return int(t.get("patch_size", 2)) if t else self.patch_size


def check_transformer_config(c: BaseModel, class_name: str, widths: tuple[tuple[str, str], ...]) -> None:
    """A transformer kind's `transformer_config` (a released pipeline's transformer/config.json, filled from
    model.pretrained) describes `class_name`, and each (key, field) of `widths` agrees: `model.backbone.<key>` is
    the config's `<field>`. ValueError naming the fix (pydantic makes it the config error)."""
    t = getattr(c, "transformer_config", None)
    if t is None:
        return
    if t.get("_class_name", class_name) != class_name:
        raise ValueError(f"model.backbone.transformer_config describes a {t['_class_name']}; it must be a {class_name}")
    for key, field in widths:
        if getattr(c, key) != t.get(field):
            raise ValueError(
                f"model.backbone.{key}={getattr(c, key)} but model.backbone.transformer_config's {field} is "
                f"{t.get(field)!r}: set {key}={t.get(field)}"
            )


def per_sample(t: Tensor | float, x: Tensor) -> Tensor:
    """`t` with one entry per sample (samplers hand a scalar; the transformers' embeddings want (N,))."""
    t = torch.as_tensor(t, device=x.device)
    return t.expand(x.shape[0]) if t.ndim == 0 else t


def check_patches(kind: str, sample_size: int, patch_size: int) -> None:
    if sample_size % patch_size:
        raise ConfigError(
            f"model.backbone.patch_size={patch_size} does not divide the {kind} backbone's input size {sample_size}"
        )


class Backbone(nn.Module):
    """A denoising network: `forward(x, t, cond) -> Tensor` (see the module doc), and what its kind declares."""

    kind: ClassVar[str]
    Config: ClassVar[type[BaseModel]]  # its `model.backbone.*` schema, `kind` a Literal of its name
    order: ClassVar[int] = 100  # where it is listed (kinds in messages, the config union): the order they came
    part: ClassVar[str] = "transformer"  # the ddpm part it is saved as (a checkpoint's and optim.<part>'s name)
    takes_labels: ClassVar[bool] = False  # class labels (`model.num_classes`); False: unset it (exit 2)
    # How a cascade stage (trainer.diffusion.stages) conditions it: "labels" (the class label only, so stage 1
    # only and no text or image embeddings), "tokens" (every condition as caption tokens); None: no stage takes
    # this kind (a stage's UNet is its StageNet, shaped by the stage's own keys).
    stage_conditioning: ClassVar[Literal["labels", "tokens"] | None] = None
    # The diffusers pipeline that samples an export of it as `gentrain sample` does, when the model's other
    # choices allow (trainer.tasks.ddpm decides); None: no diffusers pipeline runs it.
    pipeline: ClassVar[str | None] = None
    _unit_lists: ClassVar[tuple[str, ...]] = ()  # the model's ModuleLists whose elements are FSDP units
    # Units (submodule names of the model) the model uses again after their own forward: FSDP keeps them
    # gathered until their backward (trainer.engine.shard.gathered_units reads the model's attribute).
    _gathered_units: ClassVar[tuple[str, ...]] = ()
    # float8 (`train.float8`, trainer.engine.float8 reads the model's attribute of this name): None, the kind is
    # no transformer and float8 is refused; else name fragments of the model's per-sample linears (timestep and
    # label embeddings, adaLN modulation, the output projection), which multiply a batch-sized M for a
    # negligible share of the FLOPs and stay in bf16. Every other linear whose dims the float8 GEMM accepts (the
    # attention projections and MLPs of every token stream) converts.
    float8_per_sample: ClassVar[tuple[str, ...] | None] = None
    # peft's `target_modules` when `lora.targets` is unset: the layers diffusers' LoRA scripts adapt for it.
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, model: nn.Module, accepts: set[str], requires: set[str] | None = None):
        super().__init__()
        self.model = model
        if self._gathered_units:  # on the module the engine shards: the part is the bare diffusers module
            model.fsdp_gathered_units = self._gathered_units
        if self.float8_per_sample is not None:  # likewise for float8, which converts the bare module's layers
            model.float8_per_sample = self.float8_per_sample
        self.accepts = frozenset(accepts)
        self.requires = frozenset(requires or ())

    # ---- what the kind declares, read from its config
    @classmethod
    def caption_width(cls, c: BaseModel) -> int | None:
        """Width of the caption token embeddings it reads (None: no captions)."""
        return getattr(c, "caption_channels", None)

    @classmethod
    def pooled_width(cls, c: BaseModel) -> int | None:
        """Width of the pooled caption embedding it reads (None: none)."""
        return getattr(c, "pooled_channels", None)

    @classmethod
    def captions(cls) -> Literal["always", "optional", "never"]:
        """Whether it reads captions: always (its nature), optional (a choice of its config: a UNet with
        caption_channels) or never; read from its schema's `caption_channels` key."""
        field = cls.Config.model_fields.get("caption_channels")
        return "never" if field is None else "always" if field.is_required() else "optional"

    @classmethod
    def config_hints(cls, prefix: str) -> dict[str, str]:
        """Its diffusers config fields -> the gentrain keys that set them (for pretrained-folder mismatches);
        `prefix` is where its keys are (`model.backbone`)."""
        hints = {name: f"{prefix}.{name}" for name in cls.Config.model_fields if name != "kind"}
        hints.update(
            in_channels="data.channels",
            out_channels="data.channels",
            sample_size="data.image_size",
            num_embeds_ada_norm="model.num_classes",
        )
        return hints

    @classmethod
    def check_build(cls, c: BaseModel, sample_size: int, num_classes: int | None) -> None:
        """What every kind refuses before building (exit 2): class labels it cannot take, patches that do not
        tile the input."""
        if num_classes and not cls.takes_labels:
            raise ConfigError(
                f"the {cls.kind} backbone is conditioned on captions, not class labels: unset model.num_classes"
            )
        check_patches(cls.kind, sample_size, getattr(c, "patch_size", 1))

    @classmethod
    def check_input_side(cls, c: BaseModel, side: int, what: str) -> None:
        """Refuse (exit 2) inputs of `side` it cannot take, `what` naming them (e.g. an autoencoder's latents)."""
        check_patches(cls.kind, side, getattr(c, "patch_size", 1))

    @classmethod
    def build(
        cls,
        c: BaseModel,
        sample_size: int,
        channels: int,
        num_classes: int | None = None,
        in_channels: int | None = None,
    ) -> Backbone:
        raise NotImplementedError

    # ---- the call
    def check(self, cond: Mapping[str, Tensor]) -> None:
        extra = sorted(set(cond) - self.accepts)
        if extra:
            takes = ", ".join(sorted(self.accepts)) or "no conditioning"
            raise ConfigError(f"the {self.kind} backbone takes {takes}; it cannot use {', '.join(extra)}")
        missing = sorted(self.requires - set(cond))
        if missing:
            raise ConfigError(f"the {self.kind} backbone needs {', '.join(missing)} on every call")

    def forward(self, x: Tensor, t: Tensor, cond: Mapping[str, Tensor] | None = None) -> Tensor:
        cond = cond if cond is not None else {}
        self.check(cond)
        return self.call(self.model, x, t, cond)

    def call(self, model: nn.Module, x: Tensor, t: Tensor, cond: Mapping[str, Tensor]) -> Tensor:
        """Run the diffusers `model` (this backbone's, or a bare one of the same architecture)."""
        raise NotImplementedError

    @property
    def fsdp_units(self) -> list[nn.Module]:
        return [b for name in self._unit_lists for b in getattr(self.model, name)]

    @property
    def fsdp_unit_classes(self) -> tuple[str, ...]:
        """Class names of the blocks that become FSDP units (transformer blocks; a UNet's down/up blocks)."""
        return tuple(sorted({type(b).__name__ for b in self.fsdp_units}))
