"""Video tokenizer task (`task: video-tokenizer`): a causal C-ViViT (Villegas et al. 2022, Phenaki).

The first frame is patch-embedded on its own and every later group of
`model.temporal_patch` frames as one spatio-temporal patch, so a clip of
T = 1 + k * temporal_patch frames becomes 1 + k token slices of
(H / patch_size) x (W / patch_size) tokens. A spatial transformer attends
within each slice, a causal temporal transformer along each position's
slices: slice j sees slices 0..j only, so a one-frame clip is an image and
tokenizes exactly like that image alone, and the decoder (mirrored: temporal
then spatial transformer, per-slice pixel projections, a shared per-frame
convolution) reconstructs frame t from slices up to t's.

Training is the VQ-GAN task's (the skeleton of `trainer.tasks.base_gan`; the model is
`trainer.models.video_tokenizer`): the same quantizers
(`trainer.models.quantize`), reconstruction/perceptual/hinge losses with the
adaptive weight, LeCAM and gradient penalty (`trainer.models.gan`), a
discriminator with its own optimizer from `model.disc_start_step` on, EMA on
the generator only. The discriminator is
the 2D PatchGAN applied per frame, each sample's logit the mean over its real
frames: images in joint image+video training are one-frame clips that a 3D
discriminator could not judge, temporal coherence is already forced by the
reconstruction loss on every frame, and per-frame convolutions cost a
fraction of 3D ones on CPU. Padding frames (`extras["frames"]` < T) get
zero weight in every loss and metric, and their token slices are masked out
of the codebook update and the code statistics.

Written by hand: phenaki-pytorch and magvit2-pytorch (the maintained C-ViViT
and causal video tokenizers) import torchvision, which does not install
next to the CPU torch here, and download weights when built; the parts used
(torch's transformer layers, vector-quantize-pytorch's quantizers) are libraries.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.models.video_tokenizer import CausalVideoAutoencoder, VideoTokenizerConfig, check_frames, real_tokens
from trainer.tasks.base import Batch, Export, TaskContext
from trainer.tasks.base_gan import QuantizedGANTask
from trainer.tasks.sampling import SampleRequest

__all__ = ["CausalVideoAutoencoder", "VideoTokenizerConfig", "VideoTokenizerTask", "check_frames", "real_tokens"]


class VideoTokenizerTask(QuantizedGANTask):
    """The VQ-GAN's training on videos: generator = `CausalVideoAutoencoder`, per-frame PatchGAN."""

    ModelConfig = VideoTokenizerConfig
    cfg: VideoTokenizerConfig

    def __init__(self, model_cfg: VideoTokenizerConfig, ctx: TaskContext):
        if ctx.image_size % model_cfg.patch_size:
            raise ConfigError(
                f"data.image_size={ctx.image_size} is not divisible by model.patch_size={model_cfg.patch_size}"
            )
        check_frames(ctx.num_frames, model_cfg.temporal_patch)
        super().__init__(model_cfg, ctx)

    def build_generator(self) -> nn.Module:
        return CausalVideoAutoencoder(self.cfg, self.ctx.channels, self.ctx.image_size)

    def forward(self, modules, batch: Batch, step: int) -> dict[str, Any]:
        if batch.images.ndim != 5:
            raise ConfigError(
                "task=video-tokenizer needs clips (N, T, C, H, W): use a video data.source (moving-digits, video); "
                "images join as one-frame clips through data.image_ratio"
            )
        return modules["generator"](batch.images, batch.extras.get("frames"))

    def frame_weights(self, batch: Batch) -> torch.Tensor:
        n, t = batch.images.shape[:2]
        frames = batch.extras.get("frames")
        if frames is None:
            return torch.ones(n, t, device=batch.images.device)
        return (torch.arange(t, device=frames.device)[None] < frames[:, None]).float()

    def export(self, modules, sample, class_names: list[str] | None = None) -> Export:
        raise ConfigError(
            f"a {type(modules['generator']).__name__} (a video tokenizer) has no diffusers model to export: "
            "diffusers' VQModel is a 2D image autoencoder"
        )

    @torch.no_grad()
    def sample(self, modules, request: SampleRequest, device: torch.device) -> torch.Tensor:
        """Not a generative prior: decodes uniformly random codes (shows what codes look like over time)."""
        g = torch.Generator().manual_seed(request.seed)
        side = self.ctx.image_size // self.cfg.patch_size
        shape = (request.num, self.cfg.slices(self.ctx.num_frames), side, side)
        idx = torch.randint(0, self.cfg.num_codes, shape, generator=g).to(device)
        return ((modules["generator"].decode_indices(idx).float() + 1) / 2).cpu()


TASK = VideoTokenizerTask
