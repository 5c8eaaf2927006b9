"""`kind: pixart`: PixArtTransformer2DModel, adaLN-single, captions by cross-attention (Chen et al. 2023)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from trainer.diffusion.backbones.base import Backbone, TransformerConfig, per_sample
from trainer.errors import ConfigError


class PixArtBackboneConfig(TransformerConfig):
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


class PixArtBackbone(Backbone):
    kind = "pixart"
    Config = PixArtBackboneConfig
    order = 20
    stage_conditioning = "tokens"
    _unit_lists = ("transformer_blocks",)
    # The shared adaLN-single (timestep embedding and modulation), the caption projection (run once per step
    # on the caption tokens before the blocks: a small share of the FLOPs) and the output layer.
    float8_per_sample = ("adaln_single", "caption_projection", "proj_out")

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
        from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel

        cls.check_build(c, sample_size, num_classes)
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
            timestep=per_sample(t, x),
            added_cond_kwargs=added,
            encoder_attention_mask=cond.get("caption_mask"),
        ).sample


BACKBONE = PixArtBackbone
