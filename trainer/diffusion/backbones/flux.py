"""`kind: flux`: FluxTransformer2DModel (Black Forest Labs' Flux.1): double-stream blocks (image and caption tokens
in joint attention, as MMDiT) then single-stream blocks, rotary positions over (text, row, column) ids, the
timestep with the pooled caption embedding and, for Flux.1 dev, a guidance embedding. With `transformer_config`,
the FluxTransformer2DModel that diffusers config describes (a released Flux.1 folder's `transformer/config.json`).

The backbone is called on latents (N, C, H, W) like every other one and does what FluxPipeline does around the
transformer: packs 2 x 2 latent patches into tokens of 4C channels (`_pack_latents`), gives the image tokens
their (0, row, column) ids and the caption tokens zeros (`_prepare_latent_image_ids`, `text_ids`), tells it the
noise level as sigma = t / 1000 (the pipeline's `timestep / 1000`), the guidance scale for dev (`guidance`:
`guidance_scale` on every sample, as diffusers' train_dreambooth_lora_flux.py trains it), and unpacks the output.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import Field, model_validator

from trainer.diffusion.backbones.base import (
    Backbone,
    TransformerConfig,
    check_patches,
    check_transformer_config,
    per_sample,
)
from trainer.errors import ConfigError


def default_rope_axes(head_dim: int) -> list[int]:
    """Rotary dims for the (text, row, column) axes: Flux.1's (16, 56, 56) at head width 128, even numbers
    summing to the head width at any other."""
    first = 2 * max(1, head_dim // 16)
    second = (head_dim - first) // 2 // 2 * 2
    return [first, second, head_dim - first - second]


class FluxBackboneConfig(TransformerConfig):
    """`kind: flux`: `num_layers` double-stream blocks, then `num_single_layers` single-stream ones; `patch_size`
    is the 2 x 2 packing of latents into tokens (Flux's transformer itself runs patch 1)."""

    kind: Literal["flux"] = "flux"
    caption_channels: int = Field(..., ge=1, description="width of the caption token embeddings (joint_attention_dim)")
    pooled_channels: int = Field(..., ge=1, description="width of the pooled caption embedding (pooled_projection_dim)")
    num_single_layers: int = Field(4, ge=0, description="single-stream blocks after the double-stream ones")
    guidance_embeds: bool = Field(False, description="Flux.1 dev's guidance embedding (schnell: none)")
    guidance_scale: float = Field(
        3.5, ge=0, description="guidance_embeds: the guidance value every training and sampling call is told"
    )
    axes_dims_rope: list[int] | None = Field(
        None,
        description="rotary dims of the (text, row, column) axes, summing to attention_head_dim; null = Flux's rule",
    )
    transformer_config: dict[str, Any] | None = Field(
        None,
        description="a FluxTransformer2DModel's diffusers config (a Flux.1 folder's transformer/config.json): the "
        "transformer is built from it, not from the shape keys; caption_channels = its joint_attention_dim, "
        "pooled_channels = its pooled_projection_dim",
    )

    @model_validator(mode="after")
    def _shapes_fit(self) -> FluxBackboneConfig:
        if self.patch_size != 2:
            raise ValueError("model.backbone.patch_size: flux packs 2 x 2 latent patches into a token; it must be 2")
        axes = self.rope_axes
        if sum(axes) != self.head_dim or any(a % 2 for a in axes):
            raise ValueError(
                f"model.backbone.axes_dims_rope={axes}: three even numbers summing to the head width {self.head_dim}"
            )
        t = self.transformer_config
        if t is not None:
            if t.get("patch_size", 1) != 1:
                raise ValueError("model.backbone.transformer_config: gentrain packs latents 2 x 2 for patch_size 1")
            widths = (("caption_channels", "joint_attention_dim"), ("pooled_channels", "pooled_projection_dim"))
            check_transformer_config(self, "FluxTransformer2DModel", widths)
            guidance = t.get("guidance_embeds", False)  # diffusers' default: none (schnell)
            if self.guidance_embeds != guidance:
                raise ValueError(
                    f"model.backbone.guidance_embeds={self.guidance_embeds} but model.backbone.transformer_config's "
                    f"guidance_embeds is {guidance!r}: set guidance_embeds={guidance}"
                )
        return self

    @property
    def patch(self) -> int:
        """2: gentrain packs latents 2 x 2 into a token (the config's patch_size 1 is the packed tokens')."""
        return 2

    @property
    def head_dim(self) -> int:
        t = self.transformer_config
        return int(t.get("attention_head_dim", 128)) if t else self.attention_head_dim

    @property
    def rope_axes(self) -> list[int]:
        t = self.transformer_config
        if t is not None:
            return list(t.get("axes_dims_rope", (16, 56, 56)))
        return list(self.axes_dims_rope or default_rope_axes(self.attention_head_dim))


class FluxBackbone(Backbone):
    kind = "flux"
    Config = FluxBackboneConfig
    order = 40
    _unit_lists = ("transformer_blocks", "single_transformer_blocks")
    # The timestep/guidance/pooled embedding, the image and caption embedders, the double blocks' adaLN
    # modulations (`norm1`, `norm1_context`), the single blocks' (`.norm.`) and the final one (`norm_out`).
    # Both streams' attention and MLPs, and the single blocks' fused MLP and output projections, convert.
    float8_per_sample = ("time_text_embed", "x_embedder", "context_embedder", "norm1", ".norm.", "norm_out")
    # diffusers' train_dreambooth_lora_flux.py: both streams' attention projections and MLPs (the single
    # blocks' attention projections match `attn.to_q` etc. too).
    lora_targets = (
        "attn.to_k",
        "attn.to_q",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_k_proj",
        "attn.add_q_proj",
        "attn.add_v_proj",
        "attn.to_add_out",
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    )

    def __init__(self, model, accepts, requires, guidance_scale: float | None = None):
        super().__init__(model, accepts, requires)
        self.guidance_scale = guidance_scale  # None: no guidance embedding (schnell)

    @classmethod
    def check_input_side(cls, c: FluxBackboneConfig, side: int, what: str) -> None:
        check_patches(cls.kind, side, 2)

    @classmethod
    def build(
        cls,
        c: FluxBackboneConfig,
        sample_size: int,
        channels: int,
        num_classes: int | None = None,
        in_channels: int | None = None,
    ) -> FluxBackbone:
        from diffusers.models.transformers.transformer_flux import FluxTransformer2DModel

        cls.check_build(c, sample_size, num_classes)
        need = {"captions", "pooled"}
        guidance = c.guidance_scale if c.guidance_embeds else None
        if c.transformer_config is not None:
            given = {k: v for k, v in c.transformer_config.items() if not k.startswith("_")}
            packed = given.get("in_channels", 64)
            if packed != 4 * channels or given.get("out_channels") not in (None, packed):
                raise ConfigError(
                    f"model.backbone.transformer_config in_channels={packed!r}, out_channels="
                    f"{given.get('out_channels')!r}: Flux reads 2 x 2 packed latents, 4 x the autoencoder's "
                    f"{channels} latent channels = {4 * channels}"
                )
            return cls(FluxTransformer2DModel.from_config(given), need, need, guidance)
        model = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * (in_channels or channels),
            out_channels=4 * channels,
            num_layers=c.num_layers,
            num_single_layers=c.num_single_layers,
            attention_head_dim=c.attention_head_dim,
            num_attention_heads=c.num_attention_heads,
            joint_attention_dim=c.caption_channels,
            pooled_projection_dim=c.pooled_channels,
            guidance_embeds=c.guidance_embeds,
            axes_dims_rope=tuple(c.rope_axes),
        )
        return cls(model, need, need, guidance)

    def call(self, model, x, t, cond):
        n, ch, h, w = x.shape
        # FluxPipeline._pack_latents: each 2 x 2 patch of the latents one token of 4C channels, row-major.
        packed = x.view(n, ch, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(n, h * w // 4, ch * 4)
        # FluxPipeline._prepare_latent_image_ids: (0, row, column) per image token; the caption tokens' ids are 0.
        ids = torch.zeros(h // 2, w // 2, 3, device=x.device)
        ids[..., 1] += torch.arange(h // 2, device=x.device)[:, None]
        ids[..., 2] += torch.arange(w // 2, device=x.device)[None, :]
        captions = cond["captions"]
        text_ids = torch.zeros(captions.shape[1], 3, device=x.device, dtype=x.dtype)
        guidance = None
        if self.guidance_scale is not None:
            guidance = torch.full((n,), float(self.guidance_scale), device=x.device, dtype=torch.float32)
        out = model(
            packed,
            encoder_hidden_states=captions,
            pooled_projections=cond["pooled"],
            timestep=per_sample(t, x) / 1000,
            img_ids=ids.reshape(-1, 3).to(x.dtype),
            txt_ids=text_ids,
            guidance=guidance,
        ).sample
        # FluxPipeline._unpack_latents
        return out.view(n, h // 2, w // 2, -1, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, -1, h, w)


BACKBONE = FluxBackbone
