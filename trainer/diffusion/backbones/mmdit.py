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
    # The timestep-and-pooled-text embedding, the caption embedder, each block's two adaLN modulations (`norm1`,
    # `norm1_context`), the final modulation and output layer. Both streams' attention and MLPs (the caption
    # stream's `add_*_proj`, `to_add_out`, `ff_context`) convert.
    float8_per_sample = ("time_text_embed", "context_embedder", "norm1", "norm_out", "proj_out")
    # diffusers' train_dreambooth_lora_sd3.py: both streams' attention projections.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")

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
