"""Video MaskGIT task (`task: video-maskgit`): Phenaki's masked-token transformer over a frozen causal video
tokenizer's codes.

The MaskGIT skeleton (`trainer.tasks.base_maskgit`) over the token slices of a
`video-tokenizer` run (`frozen_kind` "video-tokenizer") (`model.tokenizer.url`, digest-pinned like MaskGIT's
tokenizer, with the same geometry checks plus the clip length): a clip of T
frames is S = 1 + (T - 1) / temporal_patch slices of h x w tokens, one
sequence of S*h*w tokens with learned positions, conditioned on captions
(`model.text`) or classes with classifier-free guidance, and decoded
iteratively. Padding slices (images in joint image+video training) are
neither attended nor masked nor scored, which is exactly a shorter
sequence: since the tokenizer is causal, sampling fewer frames than trained
is sampling fewer slices (the positions are a prefix).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from pydantic import ConfigDict, Field
from torch import nn

from trainer.errors import ConfigError
from trainer.models.maskgit import MaskGITConfig
from trainer.models.video_tokenizer import CausalVideoAutoencoder, check_frames, real_tokens
from trainer.tasks.base import Batch, TaskContext
from trainer.tasks.base_maskgit import MaskedTokenTask


class VideoMaskGITConfig(MaskGITConfig):
    model_config = ConfigDict(extra="forbid")

    # Expected tokenizer geometry beyond MaskGIT's; null = whatever the tokenizer has.
    temporal_patch: int | None = Field(None, ge=1, description="frames per token slice after the first")


class VideoMaskGITTask(MaskedTokenTask):
    ModelConfig = VideoMaskGITConfig
    cfg: VideoMaskGITConfig
    tokenizer_kind = "video-tokenizer"
    tokenizer_name = "video-tokenizer run"

    def __init__(self, model_cfg: VideoMaskGITConfig, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        self.temporal_patch = 1

    def _check_tokenizer(self, source: Any, url: str) -> tuple[int, int]:
        geometry = super()._check_tokenizer(source, url)
        tp = source.model_cfg.temporal_patch
        if self.cfg.temporal_patch is not None and self.cfg.temporal_patch != tp:
            raise ConfigError(
                f"model.temporal_patch={self.cfg.temporal_patch} but the tokenizer at {url} groups {tp} frames per "
                f"token slice. Set model.temporal_patch={tp} (or leave it unset)."
            )
        check_frames(self.ctx.num_frames, tp)
        trained = source.data.num_frames
        if self.ctx.num_frames > trained:
            raise ConfigError(
                f"data.num_frames={self.ctx.num_frames} but the tokenizer at {url} was trained on {trained}-frame "
                f"clips: its temporal transformer never saw later slices. Use data.num_frames<={trained}."
            )
        self.temporal_patch = tp
        return geometry

    def build_tokenizer(self, source: Any) -> nn.Module:
        """The tokenizer as its own run built it (its image size and channels)."""
        return CausalVideoAutoencoder(source.model_cfg, source.data.channels, source.data.image_size)

    def sample_accepts(self) -> frozenset[str]:
        return super().sample_accepts() | {"frames"}

    def token_layout(self, frames: int | None = None) -> tuple[int, ...]:
        """(slices, h, w) for `frames` frames (default: the trained clip length); frames off the
        1 + k * temporal_patch grid round up to the next slice, and `decode_tokens` trims them."""
        trained = self.ctx.num_frames
        if frames is None:
            frames = trained
        if frames < 1 or frames > trained:
            raise ConfigError(
                f"--frames {frames}: this model was trained on {trained}-frame clips (data.num_frames); "
                f"ask for 1 to {trained} frames"
            )
        return (1 + math.ceil((frames - 1) / self.temporal_patch), self.grid, self.grid)

    def token_mask(self, batch: Batch, tokens: torch.Tensor) -> torch.Tensor | None:
        frames = batch.extras.get("frames")
        if frames is None:
            return None
        return real_tokens(frames, tokens.shape[1], self.temporal_patch, self.grid * self.grid)

    def decode_tokens(self, modules: Mapping[str, nn.Module], tokens: torch.Tensor, frames: int | None) -> torch.Tensor:
        video = super().decode_tokens(modules, tokens, frames)
        return video[:, : frames or self.ctx.num_frames]


TASK = VideoMaskGITTask
