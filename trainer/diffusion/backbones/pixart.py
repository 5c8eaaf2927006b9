"""`kind: pixart`: PixArtTransformer2DModel, adaLN-single, captions by cross-attention (Chen et al. 2023); with
`transformer_config`, the PixArtTransformer2DModel that diffusers config describes (a released PixArt-Sigma
pipeline's `transformer/config.json`, filled from `model.pretrained`: trainer/models/pipelines.py).

Learned sigma: a released PixArt predicts the noise and a variance (out_channels = 2 x the latent channels). As
diffusers' PixArt pipelines sample and its PixArt training scripts train it, the noise half is the prediction
(`noise_pred.chunk(2, dim=1)[0]`) and the variance half is left as it is: it gets no gradient and no sampler
reads it."""

from __future__ import annotations

from collections.abc import Mapping
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
    transformer_config: dict[str, Any] | None = Field(
        None,
        description="a PixArtTransformer2DModel's diffusers config (a PixArt-Sigma folder's transformer/config.json, "
        "filled from model.pretrained): the transformer is built from it, not from the shape keys; needs "
        "caption_channels = its caption_channels",
    )

    @model_validator(mode="after")
    def _transformer_config_is_pixarts(self) -> PixArtBackboneConfig:
        check_transformer_config(self, "PixArtTransformer2DModel", (("caption_channels", "caption_channels"),))
        return self


class PixArtBackbone(Backbone):
    kind = "pixart"
    Config = PixArtBackboneConfig
    order = 20
    stage_conditioning = "tokens"
    _unit_lists = ("transformer_blocks",)
    # The shared adaLN-single (timestep embedding and modulation), the caption projection (run once per step
    # on the caption tokens before the blocks: a small share of the FLOPs) and the output layer.
    float8_per_sample = ("adaln_single", "caption_projection", "proj_out")

    def __init__(self, model, accepts, requires, pixel_scale: int = 1, learned_sigma: bool = False):
        super().__init__(model, accepts, requires)
        self.pixel_scale = pixel_scale
        self.learned_sigma = learned_sigma  # the output's second half is a variance: the noise is the first

    @classmethod
    def check_input_side(cls, c: PixArtBackboneConfig, side: int, what: str) -> None:
        check_patches(cls.kind, side, c.patch)

    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any], channels: int, pixel_scale: int) -> PixArtBackbone:
        """The PixArtTransformer2DModel a diffusers config describes (a released pipeline's
        transformer/config.json), called as PixArtSigmaPipeline calls it (captions and their mask)."""
        from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel

        given = {k: v for k, v in config.items() if not k.startswith("_")}
        inputs = given.get("in_channels", 4)
        outputs = given.get("out_channels") or inputs
        if inputs != channels or outputs not in (channels, 2 * channels):
            raise ConfigError(
                f"model.backbone.transformer_config in_channels={inputs!r}, out_channels={outputs!r}, but its inputs "
                f"have {channels} channels (the autoencoder's latent channels): it must read {channels} and predict "
                f"{channels} (or {2 * channels}: the noise and a learned variance)"
            )
        if given.get("norm_type", "ada_norm_single") != "ada_norm_single":
            raise ConfigError(
                f"model.backbone.transformer_config norm_type={given.get('norm_type')!r}: PixArt's is ada_norm_single"
            )
        model = PixArtTransformer2DModel.from_config(given)
        accepts = {"captions", "caption_mask"}
        if model.use_additional_conditions:
            accepts |= {"resolution", "aspect_ratio"}
        return cls(model, accepts, {"captions"}, pixel_scale, learned_sigma=outputs == 2 * channels)

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
            return cls.from_diffusers_config(c.transformer_config, channels, c.pixel_scale)
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
        out = model(
            x,
            encoder_hidden_states=cond["captions"],
            timestep=per_sample(t, x),
            added_cond_kwargs=added,
            encoder_attention_mask=cond.get("caption_mask"),
        ).sample
        return out.chunk(2, dim=1)[0] if self.learned_sigma else out


BACKBONE = PixArtBackbone
