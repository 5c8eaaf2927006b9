"""`kind: mmdit`: SD3Transformer2DModel, caption tokens in joint attention plus a pooled embedding (Esser et al.
2024); with `transformer_config`, the SD3Transformer2DModel that diffusers config describes (a released SD3/3.5
pipeline's `transformer/config.json`, filled from `model.pretrained`: trainer/models/pipelines.py), whatever its
shape (SD3.5's dual-attention layers and qk norm included)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from trainer.diffusion.backbones.base import (
    Backbone,
    TransformerConfig,
    check_patches,
    check_transformer_config,
    per_sample,
)
from trainer.errors import ConfigError


class MMDiTBackboneConfig(TransformerConfig):
    """`kind: mmdit`: caption tokens joined to the image tokens in every block, plus a pooled embedding."""

    kind: Literal["mmdit"] = "mmdit"
    caption_channels: int = Field(..., ge=1, description="width of the caption token embeddings (joint_attention_dim)")
    pooled_channels: int = Field(..., ge=1, description="width of the pooled caption embedding (pooled_projection_dim)")
    pos_embed_max_size: int | None = Field(None, ge=1, description="position grid side in patches; null = the input's")
    qk_norm: Literal["rms_norm", "layer_norm"] | None = None
    transformer_config: dict[str, Any] | None = Field(
        None,
        description="an SD3Transformer2DModel's diffusers config (a pipeline folder's transformer/config.json, filled "
        "from model.pretrained): the transformer is built from it, not from the shape keys; needs caption_channels "
        "= its joint_attention_dim and pooled_channels = its pooled_projection_dim",
    )

    @model_validator(mode="after")
    def _transformer_config_is_sd3s(self) -> MMDiTBackboneConfig:
        widths = (("caption_channels", "joint_attention_dim"), ("pooled_channels", "pooled_projection_dim"))
        check_transformer_config(self, "SD3Transformer2DModel", widths)
        return self


class MMDiTBackbone(Backbone):
    kind = "mmdit"
    Config = MMDiTBackboneConfig
    order = 30
    stage_conditioning = "tokens"
    _unit_lists = ("transformer_blocks",)
    # The timestep-and-pooled-text embedding, the caption embedder, each block's two adaLN modulations (`norm1`,
    # `norm1_context`), the final modulation and output layer. Both streams' attention and MLPs (the caption
    # stream's `add_*_proj`, `to_add_out`, `ff_context`) convert.
    float8_per_sample = ("time_text_embed", "context_embedder", "norm1", "norm_out", "proj_out")
    # diffusers' train_dreambooth_lora_sd3.py: both streams' attention projections.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

    @classmethod
    def check_input_side(cls, c: MMDiTBackboneConfig, side: int, what: str) -> None:
        check_patches(cls.kind, side, c.patch)
        limit = (c.transformer_config or {}).get("pos_embed_max_size")
        if limit and side // c.patch > limit:
            raise ConfigError(
                f"{what} are {side // c.patch} patches high, more than the transformer's position grid "
                f"(pos_embed_max_size={limit}): use a smaller data.image_size"
            )

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any], channels: int) -> MMDiTBackbone:
        """The SD3Transformer2DModel a diffusers config describes (a released pipeline's transformer/config.json),
        called as StableDiffusion3Pipeline calls it: caption tokens, the pooled embedding, the timestep."""
        from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

        given = {k: v for k, v in config.items() if not k.startswith("_")}
        for key in ("in_channels", "out_channels"):
            if given.get(key, 16) != channels:
                raise ConfigError(
                    f"model.backbone.transformer_config {key}={given.get(key)!r}, but its inputs have {channels} "
                    "channels (the autoencoder's latent channels)"
                )
        need = {"captions", "pooled"}
        return cls(SD3Transformer2DModel.from_config(given), need, need)

    @classmethod
    def build(
        cls,
        c: MMDiTBackboneConfig,
        sample_size: int,
        channels: int,
        num_classes: int | None = None,
        in_channels: int | None = None,
    ):
        from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

        if c.transformer_config is not None:
            if num_classes:
                raise ConfigError(
                    "model.backbone.transformer_config: a released pipeline's transformer takes no labels"
                )
            if in_channels not in (None, channels):
                raise ConfigError(
                    "backbone.transformer_config: a released pipeline's transformer reads its latents alone, not "
                    f"{in_channels} input channels (a super-resolution stage's): remove transformer_config"
                )
            return cls.from_diffusers_config(c.transformer_config, channels)
        cls.check_build(c, sample_size, num_classes)
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
            x, encoder_hidden_states=cond["captions"], pooled_projections=cond["pooled"], timestep=per_sample(t, x)
        ).sample


BACKBONE = MMDiTBackbone
