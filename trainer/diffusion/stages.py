"""The cascade's stage networks and their configs (`task: cascade`, trainer/tasks/cascade.py), beside the
diffusion core whose objectives and backbones they use.

A stage's denoiser is its `StageNet` (a diffusers UNet2DConditionModel of the stage's UNet keys, the one UNet
schema, plus the small layers that turn the cascade's conditions into its inputs) or, with
`model.stages[i].backbone`, a `TransformerStageNet` around a core backbone. Which backbones a stage may name,
and how they are conditioned, is what each backbone declares (`Backbone.stage_conditioning`): "labels" takes
the class label itself (stage 1 only, no context), "tokens" reads every condition as caption tokens. The
stage config union is derived from the registry, so a new backbone that declares it needs no change here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import torch
from diffusers.models.embeddings import TimestepEmbedding, Timesteps
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.unets.unet_2d_condition import UNet2DConditionModel
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from trainer.conditioning.text import TextEncoderConfig
from trainer.diffusion.backbones import (
    architecture_hints,
    backbone_class,
    backbone_configs,
    build_backbone,
    changed_unet_keys,
    kinds,
    unet_block_types,
)
from trainer.diffusion.config import NoiseConfig


def _staged(cls) -> bool:
    return cls.stage_conditioning is not None


def _labels_only(cls) -> bool:
    return cls.stage_conditioning == "labels"


def _as_tokens(cls) -> bool:
    return cls.stage_conditioning == "tokens"


# A stage's transformer denoiser: the core's backbones that declare how a stage conditions them; a stage
# without one is its conditioned UNet.
StageBackboneConfig = backbone_configs(_staged)


class StageConfig(NoiseConfig):
    """One stage: its resolution, denoiser (a UNet, or a transformer `backbone`), objective (the core's keys, as
    `model.*` of ddpm) and low-resolution augmentation."""

    image_size: int = Field(..., ge=4)
    noise_aug_max: float = Field(0.5, ge=0, le=1, description="training: level drawn in [0, max) (fraction of T)")
    noise_aug_sample: float = Field(0.1, ge=0, le=1, description="sampling: the fixed level")
    gradient_checkpointing: bool = False
    backbone: StageBackboneConfig | None = Field(
        None,
        description=f"a transformer denoiser (kind: {' | '.join(kinds(_staged))}) instead of the stage's UNet; "
        "null = the UNet",
    )

    @model_validator(mode="after")
    def _a_unet_or_a_backbone(self) -> StageConfig:
        if self.backbone is None:
            return self
        both = changed_unet_keys(self)
        if both:
            raise ValueError(
                f"{', '.join(both)} shape the stage's UNet, but this stage's denoiser is model.backbone "
                f"(kind {self.backbone.kind}): remove them"
            )
        if self.pretrained is not None:
            raise ValueError("pretrained is a diffusers UNet folder: a stage with a backbone starts from scratch")
        return self


class CascadeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stages: list[StageConfig] = Field(..., min_length=1)
    num_classes: int | None = Field(None, ge=2, description="class-conditional when set")
    cond_drop_prob: float = Field(0.1, ge=0, lt=1, description="condition dropout for classifier-free guidance")
    text: TextEncoderConfig | None = Field(None, description="caption conditioning; null = none")
    image_embed_dim: int | None = Field(None, ge=1, description="DALL-E 2 decoder: width of data's image_embed")
    image_embed_tokens: int = Field(4, ge=1, description="context tokens made from the image embedding")
    image_encoder: Literal["digits-features"] | None = Field(
        None, description="embed each training image with this frozen encoder when the data carries no image_embed"
    )
    context_dim: int = Field(64, ge=8, description="cross-attention width")

    @model_validator(mode="after")
    def _sizes_increase(self) -> CascadeConfig:
        sizes = [s.image_size for s in self.stages]
        if any(b <= a for a, b in zip(sizes, sizes[1:], strict=False)):
            raise ValueError(f"model.stages image_size must increase from stage to stage, got {sizes}")
        return self

    @model_validator(mode="after")
    def _labels_only_backbones_take_nothing_else(self) -> CascadeConfig:
        # A backbone conditioned on labels only (diffusers' DiT: a timestep and a class label, nothing else) has
        # no input for captions, image embeddings or a low-resolution image's augmentation level; the backbones
        # that take conditions as tokens do.
        tokens = " or ".join(kinds(_as_tokens))
        for i, s in enumerate(self.stages):
            if s.backbone is None or not _labels_only(backbone_class(s.backbone)):
                continue
            kind = s.backbone.kind
            if i > 0:
                raise ValueError(
                    f"model.stages[{i}].backbone.kind={kind}: a super-resolution stage is told its low-resolution "
                    f"image's augmentation level, which {kind} has no input for; use {tokens} (or the UNet)"
                )
            if self.has_context:
                raise ValueError(
                    f"model.stages[{i}].backbone.kind={kind} conditions on class labels only: use {tokens} for "
                    "model.text or model.image_embed_dim"
                )
        return self

    @property
    def has_context(self) -> bool:
        return self.text is not None or self.image_embed_dim is not None


class StageNet(nn.Module):
    """A diffusers UNet2DConditionModel plus the small embeddings that turn conditions into its inputs.

    The UNet sees [noisy image, augmented low-res image] as channels, a
    vector (class + augmentation level + pooled text + image embedding) added
    to its time embedding (`class_embed_type="projection"`), and, when there
    is text or an image embedding, context tokens for cross-attention.
    """

    def __init__(self, s: StageConfig, cfg: CascadeConfig, channels: int, lowres: bool):
        super().__init__()
        cond_dim = s.block_out_channels[0] * 4
        context = cfg.has_context
        attn_down, attn_up = (
            ("CrossAttnDownBlock2D", "CrossAttnUpBlock2D") if context else ("AttnDownBlock2D", "AttnUpBlock2D")
        )
        down, up = unet_block_types(s, attn_down, attn_up)
        self.unet = UNet2DConditionModel(
            sample_size=s.image_size,
            in_channels=channels * (2 if lowres else 1),
            out_channels=channels,
            block_out_channels=tuple(s.block_out_channels),
            layers_per_block=s.layers_per_block,
            down_block_types=down,
            up_block_types=up,
            mid_block_type="UNetMidBlock2DCrossAttn" if context else "UNetMidBlock2D",
            norm_num_groups=s.norm_num_groups,
            dropout=s.dropout,
            cross_attention_dim=cfg.context_dim,
            attention_head_dim=8,
            class_embed_type="projection",
            projection_class_embeddings_input_dim=cond_dim,
        )
        if s.gradient_checkpointing:
            self.unet.enable_gradient_checkpointing()
        self.lowres = lowres
        self.cond_dim = cond_dim
        # One extra row is the "no label" class used for guidance.
        self.class_embed = nn.Embedding(cfg.num_classes + 1, cond_dim) if cfg.num_classes else None
        if lowres:
            self.aug_proj = Timesteps(s.block_out_channels[0], flip_sin_to_cos=True, downscale_freq_shift=0)
            self.aug_embed = TimestepEmbedding(s.block_out_channels[0], cond_dim)
        if cfg.text is not None:
            self.text_pooled = nn.Linear(cfg.text.pooled_dim, cond_dim)
            self.text_tokens = nn.Linear(cfg.text.width, cfg.context_dim)
        self.embed_tokens_n = cfg.image_embed_tokens
        if cfg.image_embed_dim is not None:
            self.embed_vector = nn.Linear(cfg.image_embed_dim, cond_dim)
            self.embed_tokens = nn.Linear(cfg.image_embed_dim, cfg.image_embed_tokens * cfg.context_dim)
        self.context_dim = cfg.context_dim

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]):
        """Returns diffusers' UNet output (`.sample`), so diffusers' DREAM helper can call it as a UNet."""
        n = x.shape[0]
        vec = torch.zeros(n, self.cond_dim, device=x.device, dtype=x.dtype)
        context, mask = [], []
        if self.lowres:
            x = torch.cat([x, cond["lowres"]], dim=1)
            vec = vec + self.aug_embed(self.aug_proj(cond["aug_t"]).to(x.dtype))
        if self.class_embed is not None:
            vec = vec + self.class_embed(cond["labels"])
        vec = _embed_conditions(self, cond, vec, context, mask, self.context_dim)
        hidden = torch.cat(context, dim=1) if context else None
        attn_mask = torch.cat(mask, dim=1) if mask else None
        return self.unet(x, t, hidden, class_labels=vec, encoder_attention_mask=attn_mask)


class TransformerStageNet(nn.Module):
    """A stage whose denoiser is a transformer backbone of the diffusion core (`model.stages[i].backbone`).

    As in StageNet, the backbone sees [noisy image, augmented low-res image] as channels. A backbone of
    `stage_conditioning` "labels" (DiT) takes the class label itself (stage 1 only, see CascadeConfig); one of
    "tokens" (PixArt, MMDiT) reads every condition as caption tokens of its caption width: one token from the
    condition vector (class + augmentation level + pooled text + image embedding, as wide as its pooled
    embedding when it reads one, as MMDiT does, which also gets the vector as that), then the text's tokens
    and the image embedding's tokens.
    """

    def __init__(self, s: StageConfig, cfg: CascadeConfig, channels: int, lowres: bool):
        super().__init__()
        b = s.backbone
        assert b is not None
        self.lowres = lowres
        kind = backbone_class(b)
        self.tokens = _as_tokens(kind)
        labels = cfg.num_classes if not self.tokens else None
        in_channels = channels * (2 if lowres else 1)
        self.backbone = build_backbone(b, s.image_size, channels, labels, in_channels=in_channels)
        if s.gradient_checkpointing:
            self.backbone.model.enable_gradient_checkpointing()
        if not self.tokens:
            return
        width = kind.caption_width(b)
        self.vec_dim = vec = kind.pooled_width(b) or width
        self.width = width
        self.class_embed = nn.Embedding(cfg.num_classes + 1, vec) if cfg.num_classes else None
        if lowres:
            self.aug_proj = Timesteps(64, flip_sin_to_cos=True, downscale_freq_shift=0)
            self.aug_embed = TimestepEmbedding(64, vec)
        if cfg.text is not None:
            self.text_pooled = nn.Linear(cfg.text.pooled_dim, vec)
            self.text_tokens = nn.Linear(cfg.text.width, width)
        self.embed_tokens_n = cfg.image_embed_tokens
        if cfg.image_embed_dim is not None:
            self.embed_vector = nn.Linear(cfg.image_embed_dim, vec)
            self.embed_tokens = nn.Linear(cfg.image_embed_dim, cfg.image_embed_tokens * width)
        self.vec_token = nn.Linear(vec, width)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]):
        """Returns a diffusers output (`.sample`), as StageNet does."""
        n = x.shape[0]
        if self.lowres:
            x = torch.cat([x, cond["lowres"]], dim=1)
        if not self.tokens:
            labels = {"labels": cond["labels"]} if "labels" in cond else {}
            return Transformer2DModelOutput(sample=self.backbone(x, t, labels))
        vec = torch.zeros(n, self.vec_dim, device=x.device, dtype=x.dtype)
        if self.class_embed is not None:
            vec = vec + self.class_embed(cond["labels"])
        if self.lowres:
            vec = vec + self.aug_embed(self.aug_proj(cond["aug_t"]).to(x.dtype))
        tokens, masks = [], []
        vec = _embed_conditions(self, cond, vec, tokens, masks, self.width)
        tokens.insert(0, self.vec_token(vec)[:, None])
        masks.insert(0, torch.ones(n, 1, device=x.device))
        given = {"captions": torch.cat(tokens, dim=1), "caption_mask": torch.cat(masks, dim=1), "pooled": vec}
        conds = {k: v for k, v in given.items() if k in self.backbone.accepts}
        return Transformer2DModelOutput(sample=self.backbone(x, t, conds))


def _embed_conditions(
    net: nn.Module, cond: Mapping[str, torch.Tensor], vec: torch.Tensor, tokens: list, masks: list, dim: int
) -> torch.Tensor:
    """A stage network's text and image-embedding conditions, as both stage networks take them: the pooled
    vectors added to `vec` (returned), the caption tokens and `embed_tokens_n` image tokens of width `dim`
    appended to `tokens`, with their masks to `masks`."""
    n = vec.shape[0]
    if "text_pooled" in cond:
        vec = vec + net.text_pooled(cond["text_pooled"])
        tokens.append(net.text_tokens(cond["text_tokens"]))
        masks.append(cond["text_mask"])
    if "image_embed" in cond:
        e = cond["image_embed"]
        vec = vec + net.embed_vector(e)
        tokens.append(net.embed_tokens(e).view(n, net.embed_tokens_n, dim))
        masks.append(torch.ones(n, net.embed_tokens_n, device=vec.device))
    return vec


def stage_hints(prefix: str) -> dict[str, str]:
    """diffusers UNet2DConditionModel config fields -> the gentrain keys that set them."""
    context = "model.text / model.image_embed_dim (cross-attention when either is set)"
    return {
        **architecture_hints(prefix),
        "in_channels": "data.channels (twice that after stage 1: the low-resolution image is concatenated)",
        "down_block_types": f"{prefix}.attention, {prefix}.block_out_channels, {context}",
        "up_block_types": f"{prefix}.attention, {prefix}.block_out_channels, {context}",
        "mid_block_type": context,
        "cross_attention_dim": "model.context_dim",
        "projection_class_embeddings_input_dim": f"{prefix}.block_out_channels (4 x its first entry)",
    }
