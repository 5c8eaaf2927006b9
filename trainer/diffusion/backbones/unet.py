"""`kind: unet`: UNet2DModel (class labels by `num_class_embeds`, one extra row for the null class, as the ddpm
task builds it) or, with `caption_channels`, UNet2DConditionModel (captions by cross-attention); with
`unet_config`, the UNet2DConditionModel that diffusers config describes (a released pipeline's
`unet/config.json`, filled from `model.pretrained`: trainer/models/pipelines.py), whatever its shape.

`UNetShape` is the one UNet schema: the ddpm task reads it at `model.*` (when `model.backbone` is not set),
every cascade stage at `model.stages[i].*` (its StageNet's UNet), and `kind: unet` adds its keys to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.diffusion.backbones.base import Backbone
from trainer.errors import ConfigError


class UNetShape(BaseModel):
    """The UNet's shape keys and defaults (ddpm's `model.*`, a cascade stage's, `model.backbone` of kind unet)."""

    model_config = ConfigDict(extra="forbid")
    _keys_at: ClassVar[str] = "model"  # where a config error says the keys are

    block_out_channels: list[int] = Field(default=[32, 64, 64], min_length=1)
    layers_per_block: int = Field(1, ge=1)
    attention: bool = Field(True, description="self-attention in the lowest-resolution blocks")
    norm_num_groups: int = Field(8, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _groups_divide_channels(self) -> UNetShape:
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            at = self._keys_at
            raise ValueError(
                f"{at}.block_out_channels {self.block_out_channels}: every entry must be divisible "
                f"by {at}.norm_num_groups={self.norm_num_groups} (GroupNorm)"
            )
        return self

    @property
    def downsample(self) -> int:
        """The UNet's downsampling factor: its input side must be a multiple."""
        return 2 ** (len(self.block_out_channels) - 1)


UNET_SHAPE_KEYS = frozenset(UNetShape.model_fields)


def changed_unet_keys(c: BaseModel) -> list[str]:
    """The UNet shape keys of `c` that differ from their defaults (by value, not by whether they were typed:
    a config read back from a checkpoint has every key set)."""
    fields = UNetShape.model_fields
    return sorted(k for k in fields if getattr(c, k) != fields[k].get_default(call_default_factory=True))


def architecture_hints(prefix: str) -> dict[str, str]:
    """diffusers UNet config fields -> the gentrain keys that set them (for pretrained-folder mismatches)."""
    return {
        "block_out_channels": f"{prefix}.block_out_channels",
        "layers_per_block": f"{prefix}.layers_per_block",
        "norm_num_groups": f"{prefix}.norm_num_groups",
        "down_block_types": f"{prefix}.attention and {prefix}.block_out_channels",
        "up_block_types": f"{prefix}.attention and {prefix}.block_out_channels",
        "in_channels": "data.channels",
        "out_channels": "data.channels",
        "num_class_embeds": "model.num_classes (the UNet has one more row: the null class)",
    }


def unet_block_types(c: UNetShape, attn_down: str = "AttnDownBlock2D", attn_up: str = "AttnUpBlock2D"):
    """(down, up) block types: plain blocks, attention in the lowest resolution when `attention`."""
    n = len(c.block_out_channels)
    down = ["DownBlock2D"] * n
    up = ["UpBlock2D"] * n
    if c.attention and n > 1:
        down[-1] = attn_down
        up[0] = attn_up
    return tuple(down), tuple(up)


class UNetBackboneConfig(UNetShape):
    """`kind: unet`; the shape keys and defaults of the ddpm task's UNet."""

    _keys_at: ClassVar[str] = "model.backbone"

    kind: Literal["unet"] = "unet"
    caption_channels: int | None = Field(
        None, ge=1, description="width of caption token embeddings: UNet2DConditionModel with cross-attention"
    )
    attention_head_dim: int = Field(8, ge=1, description="cross-attention head width (with caption_channels)")
    unet_config: dict[str, Any] | None = Field(
        None,
        description="a UNet2DConditionModel's diffusers config (a pipeline folder's unet/config.json, filled from "
        "model.pretrained): the UNet is built from it, not from the shape keys; needs caption_channels = its "
        "cross_attention_dim",
    )

    @model_validator(mode="after")
    def _unet_config_is_a_conditional_unet(self) -> UNetBackboneConfig:
        if self.unet_config is None:
            return self
        cls = self.unet_config.get("_class_name", "UNet2DConditionModel")
        if cls != "UNet2DConditionModel":
            raise ValueError(f"model.backbone.unet_config describes a {cls}; it must be a UNet2DConditionModel")
        width = self.unet_config.get("cross_attention_dim")
        if self.caption_channels != width:
            raise ValueError(
                f"model.backbone.caption_channels={self.caption_channels} but model.backbone.unet_config's "
                f"cross_attention_dim is {width!r}: set caption_channels={width}"
            )
        added = self.unet_config.get("addition_embed_type")
        if added not in (None, "text_time") or self.unet_config.get("class_embed_type"):
            raise ValueError(
                f"model.backbone.unet_config: a UNet with added conditions other than SDXL's (addition_embed_type="
                f"{added!r}, class_embed_type={self.unet_config.get('class_embed_type')!r}) is not wired yet"
            )
        return self

    @property
    def micro_conditioned(self) -> bool:
        """SDXL's UNet: the pooled caption embedding and six size micro-conditions (`text_time`)."""
        return self.unet_config is not None and self.unet_config.get("addition_embed_type") == "text_time"

    @property
    def downsample(self) -> int:
        if self.unet_config is not None:
            return 2 ** (len(self.unet_config.get("block_out_channels", (0,))) - 1)
        return super().downsample


class UNetBackbone(Backbone):
    kind = "unet"
    Config = UNetBackboneConfig
    order = 0
    part = "unet"  # as before the backbone section, so checkpoints and optim.unet keep their names
    takes_labels = True
    pipeline = "DDIMPipeline"  # or DDPMPipeline: its loop is any scheduler's own steps
    _unit_lists = ("down_blocks", "up_blocks")
    # Attention projections and the ResNet blocks' convolutions (float8: none, a UNet's convolutions are its
    # FLOPs; `float8_per_sample` stays None and train.float8 is refused).
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2")

    @classmethod
    def config_hints(cls, prefix: str) -> dict[str, str]:
        return architecture_hints(prefix)

    @classmethod
    def pooled_width(cls, c: UNetBackboneConfig) -> int | None:
        """SDXL's UNet reads the pooled caption embedding beside six micro-conditions of addition_time_embed_dim
        each: its add_embedding takes projection_class_embeddings_input_dim = pooled + 6 x that."""
        if not c.micro_conditioned:
            return None
        u = c.unet_config
        return int(u.get("projection_class_embeddings_input_dim") or 0) - 6 * int(u.get("addition_time_embed_dim") or 0)

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any], channels: int) -> UNetBackbone:
        """The UNet2DConditionModel a diffusers config describes (a released pipeline's unet/config.json), its
        captions read by cross-attention as `encoder_hidden_states` with no mask (as the pipeline calls it)."""
        from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel

        given = {k: v for k, v in config.items() if not k.startswith("_")}
        for key in ("in_channels", "out_channels"):
            if given.get(key, 4) != channels:
                raise ConfigError(
                    f"model.backbone.unet_config {key}={given.get(key)!r}, but its inputs have {channels} channels "
                    "(the autoencoder's latent channels)"
                )
        model = UNet2DConditionModel.from_config(given)
        if given.get("addition_embed_type") == "text_time":  # SDXL: pooled caption + size micro-conditions
            takes = {"captions", "pooled", "time_ids"}
            return cls(model, takes, takes)
        return cls(model, {"captions"}, {"captions"})

    @classmethod
    def check_input_side(cls, c: UNetBackboneConfig, side: int, what: str) -> None:
        if side % c.downsample:
            raise ConfigError(
                f"{what} are not divisible by the UNet's downsampling factor {c.downsample} "
                "(2 ** (len(block_out_channels) - 1)): use fewer UNet levels or larger images"
            )

    @classmethod
    def build(
        cls,
        c: UNetBackboneConfig,
        sample_size: int,
        channels: int,
        num_classes: int | None = None,
        in_channels: int | None = None,
    ) -> UNetBackbone:
        if c.unet_config is not None:
            if num_classes:
                raise ConfigError("model.backbone.unet_config: a released pipeline's UNet takes no class labels")
            return cls.from_diffusers_config(c.unet_config, channels)
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
        # What was built decides (`model` may be a DDP wrapper around it): captions = UNet2DConditionModel.
        if "captions" in self.accepts:
            mask = cond.get("caption_mask")
            added = {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]} if "time_ids" in cond else None
            return model(
                x, t, cond["captions"], class_labels=labels, encoder_attention_mask=mask, added_cond_kwargs=added
            ).sample
        return model(x, t, class_labels=labels).sample


BACKBONE = UNetBackbone
