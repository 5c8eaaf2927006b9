"""KL autoencoder task (`task: autoencoder`): the first stage of latent diffusion (Rombach et al. 2022).

Parts: `generator` (diffusers' `AutoencoderKL` with a small block config, plus the measured latent
scaling factor) and `discriminator` (the VQ-GAN's PatchGAN from `trainer.models.gan`, with its own
optimizer, schedule and scaler via `optim.discriminator.*`). Only the generator has an EMA.

Generator loss per sample: the tokenizers' reconstruction terms (L1, L2, optional VGG perceptual;
`AdversarialLosses.reconstruction`) + `model.kl_weight` x KL(q(z|x) || N(0, I)) per latent element +,
from `model.disc_start_step`, `model.adv_weight` x Esser et al.'s adaptive weight x the hinge adversarial
term; the discriminator phase (hinge, LeCAM, gradient penalty) is the VQ-GAN's: both train on the skeleton
of trainer/tasks/base_gan.py, and the model is trainer/models/autoencoder.py. The decoder reconstructs
a posterior sample z = mean + std * eps, eps drawn per sample from a counter-based stream keyed by the
step and the sample's place in the global batch (`Stream.AUTOENCODER`: the same draws at any world size
and after a resume), or the posterior mean with `model.sample_posterior=false`.

The latent scaling factor is 1 / std of the posterior means of a fixed sample of training images (the
first `model.scale_samples`), measured by `calibrate` before every checkpoint save with the EMA weights
(what sampling and a frozen consumer use by default) and kept in the generator's `scaling_factor` buffer:
saved with its weights (model and EMA files alike), restored exactly on resume, and read with the weights
by a latent-diffusion run. `KLAutoencoder.encode_latents` / `decode_latents` apply it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from trainer.errors import ConfigError
from trainer.models.autoencoder import AutoencoderConfig, KLAutoencoder, latent_geometry
from trainer.models.export import plain_autoencoder_kl
from trainer.randomness import Stream, sample_draws
from trainer.tasks.base import Batch, Export, TaskContext, bare
from trainer.tasks.base_gan import GANAutoencoderTask, check_downsample
from trainer.tasks.sampling import SampleRequest

__all__ = ["AutoencoderConfig", "AutoencoderTask", "KLAutoencoder", "latent_geometry"]


class AutoencoderTask(GANAutoencoderTask):
    ModelConfig = AutoencoderConfig
    cfg: AutoencoderConfig
    samples_reconstruct = True

    def __init__(self, model_cfg: AutoencoderConfig, ctx: TaskContext):
        if ctx.num_frames > 1:
            raise ConfigError(
                "task autoencoder trains on images: use an image source (data.num_frames applies to video)"
            )
        check_downsample(ctx, model_cfg.downsample)
        super().__init__(model_cfg, ctx)

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        side = self.ctx.image_size // self.cfg.downsample
        return (self.cfg.latent_channels, side, side)

    def build_generator(self) -> nn.Module:
        return KLAutoencoder(self.cfg, self.ctx.channels, self.ctx.image_size)

    def forward(self, modules, batch: Batch, step: int) -> dict[str, Any]:
        noise = None
        if self.cfg.sample_posterior and step >= 0:
            draws = sample_draws(self.seed, step, batch.positions, Stream.AUTOENCODER, device=batch.images.device)
            noise = draws.randn(self.latent_shape)
        return modules["generator"](batch.images, noise)

    def generator_total(self, terms: dict[str, torch.Tensor], outputs: Mapping[str, Any]) -> torch.Tensor:
        return terms["rec"] + self.cfg.kl_weight * outputs["kl"]

    def generator_terms(self, outputs: Mapping[str, Any], generator: nn.Module) -> dict[str, torch.Tensor]:
        return {"kl": outputs["kl"], "scaling_factor": generator.scaling_factor}

    # ---- the latent scaling factor
    def calibration_size(self) -> int:
        return self.cfg.scale_samples

    def calibrate(self, modules, batches: Iterable[Batch]) -> None:
        """scaling_factor = 1 / std (float64, unbiased) of every element of the fixed sample's posterior means."""
        generator = bare(modules, "generator")
        latents = [
            generator(b.images, decode=False)["latents"][b.valid.bool()].double().cpu().flatten() for b in batches
        ]
        z = torch.cat(latents) if latents else torch.zeros(0, dtype=torch.float64)
        if z.numel() >= 2:
            generator.scaling_factor.fill_(float(1 / z.std().clamp(min=1e-12)))

    # ---- evaluation and output
    def validation_terms(self, outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        z = outputs["latents"].float().flatten(1)
        return {"kl": outputs["kl"].float(), "latent_mean": z.mean(dim=1), "latent_std": z.std(dim=1)}

    def export(self, modules, sample, class_names: list[str] | None = None) -> Export:
        """The generator as a plain diffusers AutoencoderKL in `vae/`, its config's `scaling_factor` the measured
        one (a float32 buffer: JSON keeps it exactly); no pipeline: an autoencoder is a component, not a sampler."""
        generator = modules["generator"]
        scale = float(generator.scaling_factor)
        channels, size = self.ctx.channels, self.ctx.image_size
        usage = f"""import torch
from diffusers import AutoencoderKL

vae = AutoencoderKL.from_pretrained("path/to/this/folder", subfolder="vae").eval()
images = torch.rand(4, {channels}, {size}, {size}) * 2 - 1  # images in [-1, 1]
with torch.no_grad():
    latents = vae.encode(images).latent_dist.mean * vae.config.scaling_factor  # gentrain's scaled latents
    reconstructions = vae.decode(latents / vae.config.scaling_factor).sample
"""
        c, (lc, side) = self.cfg, (self.cfg.latent_channels, size // self.cfg.downsample)
        return Export(
            models={"vae": (plain_autoencoder_kl(generator.vae, scale), {})},
            parts={"vae": "generator"},
            reason=(
                "an autoencoder is not a sampler: its AutoencoderKL is a latent diffusion pipeline's `vae` component"
            ),
            usage=usage,
            notes=[
                f"`vae/`: latents {lc}x{side}x{side}; config `scaling_factor` = {scale!r}, 1 / std of the posterior "
                f"means of the first {c.scale_samples} training images, measured at this checkpoint's save",
                "the discriminator is not exported (it only trains the generator)",
            ],
        )

    @torch.no_grad()
    def sample(self, modules, request: SampleRequest, device: torch.device) -> torch.Tensor:
        """With the request's `images` (held-out images in [-1, 1]): input | reconstruction cells. Without: an
        autoencoder is no generative prior, so it decodes latents drawn from N(0, I) in the scaled latent space
        (what its latents look like to a diffusion model)."""
        generator = modules["generator"]
        num, seed, images = request.num, request.seed, request.images
        if images is not None:
            images = images[:num].to(device)
            return self.reconstruction_cells(images, generator(images)["reconstruction"])
        g = torch.Generator().manual_seed(seed)
        latents = torch.randn((num, *self.latent_shape), generator=g).to(device)
        return ((generator.decode_latents(latents).float() + 1) / 2).cpu()


TASK = AutoencoderTask
