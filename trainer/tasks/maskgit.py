"""MaskGIT task (`task: maskgit`): a bidirectional transformer over a frozen VQ-GAN's codes (Chang et al. 2022).

The tokenizer is the `generator` part of a run whose task is an image tokenizer (`frozen_kind`
"image-tokenizer": a `vqgan` run), loaded from `model.tokenizer.url`; a sample is its (h, w) token grid.
Training, conditioning and iterative decoding are the skeleton's (trainer/tasks/base_maskgit.py), the
transformer is trainer/models/maskgit.py.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from trainer.models.maskgit import MaskGITConfig, MaskTransformer, TokenCache
from trainer.models.vqgan import VQAutoencoder
from trainer.tasks.base_maskgit import MaskedTokenTask, check_tokenizer_geometry

__all__ = ["MaskGITConfig", "MaskGITTask", "MaskTransformer", "TokenCache", "check_tokenizer_geometry"]


class MaskGITTask(MaskedTokenTask):
    tokenizer_kind = "image-tokenizer"
    tokenizer_name = "vqgan tokenizer"

    def build_tokenizer(self, source: Any) -> nn.Module:
        return VQAutoencoder(source.model_cfg, self.ctx.channels)

    def token_layout(self, frames: int | None = None) -> tuple[int, ...]:
        """Shape of one sample's token grid; images take no `frames` (see `sample_accepts`)."""
        return (self.grid, self.grid)


TASK = MaskGITTask
