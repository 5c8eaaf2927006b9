"""`kind: mmdit`: SD3Transformer2DModel, caption tokens in joint attention plus a pooled embedding (Esser et al.
2024)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from trainer.diffusion.backbones.base import Backbone, TransformerConfig, per_sample


class MMDiTBackboneConfig(TransformerConfig):
    """`kind: mmdit`: caption tokens joined to the image tokens in every block, plus a pooled embedding."""

    kind: Literal["mmdit"] = "mmdit"
    caption_channels: int = Field(..., ge=1, description="width of the caption token embeddings (joint_attention_dim)")
    pooled_channels: int = Field(..., ge=1, description="width of the pooled caption embedding (pooled_projection_dim)")
    pos_embed_max_size: int | None = Field(None, ge=1, description="position grid side in patches; null = the input's")
    qk_norm: Literal["rms_norm", "layer_norm"] | None = None


class MMDiTBackbone(Backbone):
    kind = "mmdit"
    Config = MMDiTBackboneConfig
    order = 30
    stage_conditioning = "tokens"
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
        from diffusers.models.transformers.transformer_sd3 import SD3Transformer2DModel

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
