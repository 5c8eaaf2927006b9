"""Backbones: the denoising networks an objective drives, diffusers' model classes behind one call.

Every backbone is `forward(x, t, cond) -> Tensor` of x's shape, where `t` is what the objective tells
the network of the noise level (a scalar or one value per sample) and `cond` maps condition names to
tensors:

- `labels` (N,) int64, class labels; the null class for guidance is `num_classes`;
- `captions` (N, L, D) caption token embeddings, `caption_mask` (N, L) 1 = keep;
- `pooled` (N, P) a pooled caption embedding;
- `resolution` (N, 2) and `aspect_ratio` (N, 1): PixArt's micro-conditions (default: the input's size).

A backbone takes only the conditions in its `accepts` and needs those in `requires`; anything else is
a ConfigError, so a flag or data field the model cannot use is refused rather than silently ignored.
Built from `model.backbone.*` (`BackboneConfig`, discriminated by `kind`):

- `unet`: UNet2DModel (class labels by `num_class_embeds`, one extra row for the null class, as the ddpm
  task builds it) or, with `caption_channels`, UNet2DConditionModel (captions by cross-attention);
- `dit`: DiTTransformer2DModel, class-conditional adaLN-zero (Peebles & Xie 2023);
- `pixart`: PixArtTransformer2DModel, adaLN-single, captions by cross-attention (Chen et al. 2023);
- `mmdit`: SD3Transformer2DModel, caption tokens in joint attention plus a pooled embedding (Esser et al. 2024).

The diffusers module is `backbone.model`; `call(model, x, t, cond)` runs one without the wrapper (a part
saved as the bare diffusers module keeps its state-dict keys): the backbone's own module, or a wrapper of it
(DDP), whose architecture `call` reads from `backbone.model`. `fsdp_unit_classes` names the blocks that
become FSDP units (every transformer block; a UNet's down and up blocks); a unit the model calls again after
its own forward is named in the model's `fsdp_gathered_units` and stays gathered until its backward (DiT's
first block).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator
from torch import nn

from trainer.errors import ConfigError

Tensor = torch.Tensor

# Each builder imports its diffusers class from that class's own module, when it builds one: the caption
# models' modules import diffusers' loaders (single-file conversion, LoRA), which import scipy and peft
# whenever installed, so a plain UNet run never imports them (trainer/lazy_packages.py, tests/test_startup.py).


# ---------------------------------------------------------------- configs


class UNetBackboneConfig(BaseModel):
    """`kind: unet`; the shape keys and defaults of the ddpm task's UNet."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["unet"] = "unet"
    block_out_channels: list[int] = Field(default=[32, 64, 64], min_length=1)
    layers_per_block: int = Field(1, ge=1)
    attention: bool = Field(True, description="self-attention in the lowest-resolution blocks")
    norm_num_groups: int = Field(8, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)
    caption_channels: int | None = Field(
        None, ge=1, description="width of caption token embeddings: UNet2DConditionModel with cross-attention"
    )
    attention_head_dim: int = Field(8, ge=1, description="cross-attention head width (with caption_channels)")

    @model_validator(mode="after")
    def _groups_divide_channels(self) -> UNetBackboneConfig:
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(
                f"model.backbone.block_out_channels {self.block_out_channels}: every entry must be divisible "
                f"by model.backbone.norm_num_groups={self.norm_num_groups} (GroupNorm)"
            )
        return self


class _TransformerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    patch_size: int = Field(2, ge=1)
    num_layers: int = Field(4, ge=1)
    num_attention_heads: int = Field(4, ge=1)
    attention_head_dim: int = Field(32, ge=1)

    @property
    def width(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


class DiTBackboneConfig(_TransformerConfig):
    """`kind: dit`: class-conditional adaLN-zero transformer (unconditional models use one class)."""

    kind: Literal["dit"] = "dit"
    dropout: float = Field(0.0, ge=0, lt=1)


class PixArtBackboneConfig(_TransformerConfig):
    """`kind: pixart`: captions by cross-attention, projected from `caption_channels` to the model width."""

    kind: Literal["pixart"] = "pixart"
    caption_channels: int = Field(..., ge=1, description="width of the caption token embeddings")
    dropout: float = Field(0.0, ge=0, lt=1)
    use_additional_conditions: bool | None = Field(
        None, description="resolution/aspect-ratio micro-conditions; null = diffusers' rule (sample_size 128)"
    )
    pixel_scale: int = Field(
        1, ge=1, description="pixels per input pixel (a latent space's downsampling factor), for the default resolution"
    )


class MMDiTBackboneConfig(_TransformerConfig):
    """`kind: mmdit`: caption tokens joined to the image tokens in every block, plus a pooled embedding."""

    kind: Literal["mmdit"] = "mmdit"
    caption_channels: int = Field(..., ge=1, description="width of the caption token embeddings (joint_attention_dim)")
    pooled_channels: int = Field(..., ge=1, description="width of the pooled caption embedding (pooled_projection_dim)")
    pos_embed_max_size: int | None = Field(None, ge=1, description="position grid side in patches; null = the input's")
    qk_norm: Literal["rms_norm", "layer_norm"] | None = None


BackboneConfig = Annotated[
    UNetBackboneConfig | DiTBackboneConfig | PixArtBackboneConfig | MMDiTBackboneConfig, Field(discriminator="kind")
]
_BACKBONE_CONFIG: TypeAdapter = TypeAdapter(BackboneConfig)


def parse_backbone(value: Mapping | BaseModel) -> BaseModel:
    """A `model.backbone` mapping (or config) as its kind's config."""
    return _BACKBONE_CONFIG.validate_python(value)


# ---------------------------------------------------------------- backbones


def _per_sample(t: Tensor | float, x: Tensor) -> Tensor:
    """`t` with one entry per sample (samplers hand a scalar; the transformers' embeddings want (N,))."""
    t = torch.as_tensor(t, device=x.device)
    return t.expand(x.shape[0]) if t.ndim == 0 else t


class Backbone(nn.Module):
    """A denoising network: `forward(x, t, cond) -> Tensor` (see the module doc)."""

    kind: ClassVar[str]
    _unit_lists: ClassVar[tuple[str, ...]] = ()  # the model's ModuleLists whose elements are FSDP units
    # Units (submodule names of the model) the model uses again after their own forward: FSDP keeps them
    # gathered until their backward (trainer.engine.shard.gathered_units reads the model's attribute).
    _gathered_units: ClassVar[tuple[str, ...]] = ()

    def __init__(self, model: nn.Module, accepts: set[str], requires: set[str] | None = None):
        super().__init__()
        self.model = model
        if self._gathered_units:  # on the module the engine shards: the part is the bare diffusers module
            model.fsdp_gathered_units = self._gathered_units
        self.accepts = frozenset(accepts)
        self.requires = frozenset(requires or ())

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


def unet_block_types(c: UNetBackboneConfig, attn_down: str = "AttnDownBlock2D", attn_up: str = "AttnUpBlock2D"):
    """(down, up) block types: plain blocks, attention in the lowest resolution when `attention`."""
    n = len(c.block_out_channels)
    down = ["DownBlock2D"] * n
    up = ["UpBlock2D"] * n
    if c.attention and n > 1:
        down[-1] = attn_down
        up[0] = attn_up
    return tuple(down), tuple(up)


class UNetBackbone(Backbone):
    kind = "unet"
    _unit_lists = ("down_blocks", "up_blocks")

    @classmethod
    def build(
        cls,
        c: UNetBackboneConfig,
        sample_size: int,
        channels: int,
        num_classes: int | None,
        in_channels: int | None = None,
    ) -> UNetBackbone:
        # One extra embedding row is the "no label" class used for guidance.
        class_rows = (num_classes + 1) if num_classes else None
        shape = dict(
            sample_size=sample_size,
            in_channels=in_channels or channels,
            out_channels=channels,
            block_out_channels=tuple(c.block_out_channels),
            layers_per_block=c.layers_per_block,
            norm_num_groups=c.norm_num_groups,
            dropout=c.dropout,
            num_class_embeds=class_rows,
        )
        accepts = {"labels"} if num_classes else set()
        if c.caption_channels is None:
            from diffusers.models.unets.unet_2d import UNet2DModel

            down, up = unet_block_types(c)
            return cls(UNet2DModel(down_block_types=down, up_block_types=up, **shape), accepts, accepts)
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

        down, up = unet_block_types(c, "CrossAttnDownBlock2D", "CrossAttnUpBlock2D")
        model = UNet2DConditionModel(
            down_block_types=down,
            up_block_types=up,
            mid_block_type="UNetMidBlock2DCrossAttn",
            cross_attention_dim=c.caption_channels,
            attention_head_dim=c.attention_head_dim,
            **shape,
        )
        return cls(model, accepts | {"captions", "caption_mask"}, accepts | {"captions"})

    def call(self, model, x, t, cond):
        labels = cond.get("labels")
        # The built module decides (`model` may be a DDP wrapper around it): captions = UNet2DConditionModel.
        if "captions" in self.accepts:
            mask = cond.get("caption_mask")
            return model(x, t, cond["captions"], class_labels=labels, encoder_attention_mask=mask).sample
        return model(x, t, class_labels=labels).sample


def _check_patches(kind: str, sample_size: int, patch_size: int) -> None:
    if sample_size % patch_size:
        raise ConfigError(
            f"model.backbone.patch_size={patch_size} does not divide the {kind} backbone's input size {sample_size}"
        )


class DiTBackbone(Backbone):
    kind = "dit"
    _unit_lists = ("transformer_blocks",)
    # diffusers' DiT conditions its output layer with `transformer_blocks[0].norm1.emb`, called after the last
    # block has run: with every block an FSDP unit, block 0 would have resharded by then (a mixed Tensor/DTensor
    # addmm, seen under torchrun). Block 0 stays a unit (sharded between steps, its gradient reduced in its own
    # backward) but keeps its weights gathered from its forward to its backward (FSDP2's
    # reshard_after_forward=False), so the second call uses them and its gradient joins block 0's. Chosen over
    # leaving block 0 to the root unit (same memory: one block whole from its forward to the end of backward,
    # but not a unit) and over an extra FSDP forward method (the call is to a submodule inside forward, not a
    # method of the part).
    _gathered_units = ("transformer_blocks.0",)

    @classmethod
    def build(
        cls,
        c: DiTBackboneConfig,
        sample_size: int,
        channels: int,
        num_classes: int | None,
        in_channels: int | None = None,
    ) -> DiTBackbone:
        from diffusers.models.embeddings import LabelEmbedding
        from diffusers.models.transformers.dit_transformer_2d import DiTTransformer2DModel

        _check_patches(cls.kind, sample_size, c.patch_size)
        model = DiTTransformer2DModel(
            num_attention_heads=c.num_attention_heads,
            attention_head_dim=c.attention_head_dim,
            in_channels=in_channels or channels,
            out_channels=channels,
            num_layers=c.num_layers,
            dropout=c.dropout,
            sample_size=sample_size,
            patch_size=c.patch_size,
            # diffusers' DiT is always class-conditional; an unconditional one is a single class.
            num_embeds_ada_norm=num_classes or 1,
        )
        # diffusers drops labels itself in train mode, drawing from the global RNG in every block; gentrain
        # draws dropout per sample (trainer.randomness) and passes the null row, `num_classes`, which the
        # tables keep (they were built with dropout, hence num_classes + 1 rows).
        for m in model.modules():
            if isinstance(m, LabelEmbedding):
                m.dropout_prob = 0.0
        accepts = {"labels"} if num_classes else set()
        return cls(model, accepts, accepts)

    def call(self, model, x, t, cond):
        labels = cond.get("labels")
        if labels is None:
            labels = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
        return model(x, _per_sample(t, x), class_labels=labels).sample


class PixArtBackbone(Backbone):
    kind = "pixart"
    _unit_lists = ("transformer_blocks",)

    def __init__(self, model, accepts, requires, pixel_scale: int = 1):
        super().__init__(model, accepts, requires)
        self.pixel_scale = pixel_scale

    @classmethod
    def build(
        cls,
        c: PixArtBackboneConfig,
        sample_size: int,
        channels: int,
        num_classes: int | None = None,
        in_channels: int | None = None,
    ):
        if num_classes:
            raise ConfigError(
                "the pixart backbone is conditioned on captions, not class labels: unset model.num_classes"
            )
        from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel

        _check_patches(cls.kind, sample_size, c.patch_size)
        model = PixArtTransformer2DModel(
            num_attention_heads=c.num_attention_heads,
            attention_head_dim=c.attention_head_dim,
            in_channels=in_channels or channels,
            out_channels=channels,
            num_layers=c.num_layers,
            dropout=c.dropout,
            # the captions are projected to the model width before cross-attention
            cross_attention_dim=c.width,
            sample_size=sample_size,
            patch_size=c.patch_size,
            use_additional_conditions=c.use_additional_conditions,
            caption_channels=c.caption_channels,
        )
        if model.use_additional_conditions and c.width % 3:
            # diffusers embeds height, width and aspect ratio in a third of the width each
            raise ConfigError(
                f"the pixart backbone's resolution/aspect-ratio conditions need a width divisible by 3: "
                f"model.backbone.num_attention_heads x attention_head_dim = {c.width}"
            )
        accepts = {"captions", "caption_mask"}
        if model.use_additional_conditions:
            accepts |= {"resolution", "aspect_ratio"}
        return cls(model, accepts, {"captions"}, c.pixel_scale)

    def call(self, model, x, t, cond):
        added = {"resolution": None, "aspect_ratio": None}
        if self.model.use_additional_conditions:  # the built module's: `model` may be a DDP wrapper around it
            # As diffusers' PixArt pipelines: the output image's (height, width) in pixels and height / width.
            n, (h, w) = x.shape[0], x.shape[-2:]
            res = cond.get("resolution")
            if res is None:
                res = torch.tensor([h * self.pixel_scale, w * self.pixel_scale]).repeat(n, 1)
            ratio = cond.get("aspect_ratio")
            if ratio is None:
                ratio = torch.tensor([float(h / w)]).repeat(n, 1)
            added = {"resolution": res.to(x.device, x.dtype), "aspect_ratio": ratio.to(x.device, x.dtype)}
        return model(
            x,
            encoder_hidden_states=cond["captions"],
            timestep=_per_sample(t, x),
            added_cond_kwargs=added,
            encoder_attention_mask=cond.get("caption_mask"),
        ).sample


class MMDiTBackbone(Backbone):
    kind = "mmdit"
    _unit_lists = ("transformer_blocks",)

    @classmethod
    def build(
        cls,
        c: MMDiTBackboneConfig,
        sample_size: int,
        channels: int,
        num_classes: int | None = None,
        in_channels: int | None = None,
    ):
        if num_classes:
            raise ConfigError(
                "the mmdit backbone is conditioned on captions, not class labels: unset model.num_classes"
            )
        from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

        _check_patches(cls.kind, sample_size, c.patch_size)
        model = SD3Transformer2DModel(
            sample_size=sample_size,
            patch_size=c.patch_size,
            in_channels=in_channels or channels,
            out_channels=channels,
            num_layers=c.num_layers,
            attention_head_dim=c.attention_head_dim,
            num_attention_heads=c.num_attention_heads,
            joint_attention_dim=c.caption_channels,
            # joint attention concatenates caption and image tokens, so both are the model width
            caption_projection_dim=c.width,
            pooled_projection_dim=c.pooled_channels,
            pos_embed_max_size=c.pos_embed_max_size or sample_size // c.patch_size,
            qk_norm=c.qk_norm,
        )
        need = {"captions", "pooled"}
        return cls(model, need, need)

    def call(self, model, x, t, cond):
        return model(
            x, encoder_hidden_states=cond["captions"], pooled_projections=cond["pooled"], timestep=_per_sample(t, x)
        ).sample


BACKBONES: dict[str, type[Backbone]] = {c.kind: c for c in (UNetBackbone, DiTBackbone, PixArtBackbone, MMDiTBackbone)}


def build_backbone(
    cfg: Mapping | BaseModel,
    sample_size: int,
    channels: int,
    num_classes: int | None = None,
    in_channels: int | None = None,
) -> Backbone:
    """The backbone `cfg.kind` names, for inputs of `channels` x `sample_size`^2 (pixels or latents),
    class-conditional on `num_classes` classes when set (and when the kind takes labels). `in_channels`:
    inputs wider than the output (a super-resolution stage's image and its low-resolution condition)."""
    c = parse_backbone(cfg)
    return BACKBONES[c.kind].build(c, sample_size, channels, num_classes, in_channels)
