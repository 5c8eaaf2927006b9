"""KL autoencoder task (`task: autoencoder`): the first stage of latent diffusion (Rombach et al. 2022).

Parts: `generator` (diffusers' `AutoencoderKL` with a small block config, plus the measured latent
scaling factor) and `discriminator` (the VQ-GAN's PatchGAN from `trainer.models.gan`, with its own
optimizer, schedule and scaler via `optim.discriminator.*`). Only the generator has an EMA.

Generator loss per sample: the tokenizers' reconstruction terms (L1, L2, optional VGG perceptual;
`AdversarialLosses.reconstruction`) + `model.kl_weight` x KL(q(z|x) || N(0, I)) per latent element +,
from `model.disc_start_step`, `model.adv_weight` x Esser et al.'s adaptive weight x the hinge adversarial
term; the discriminator phase (hinge, LeCAM, gradient penalty) is the VQ-GAN's. The decoder reconstructs
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
from diffusers import AutoencoderKL
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from pydantic import ConfigDict, Field
from torch import nn

from trainer.errors import ConfigError
from trainer.models.export import plain_autoencoder_kl
from trainer.models.gan import AdversarialConfig, AdversarialLosses, ConvAutoencoderShape, PatchDiscriminator
from trainer.models.perceptual import VGGPerceptual
from trainer.randomness import Stream, sample_draws
from trainer.tasks.base import Batch, Export, Loss, Phase, PreviewContext, StepInfo, Task, TaskContext, bare
from trainer.tasks.sampling import SampleRequest


class AutoencoderConfig(ConvAutoencoderShape, AdversarialConfig):
    model_config = ConfigDict(extra="forbid")

    latent_channels: int = Field(4, ge=1)
    attention: bool = Field(False, description="self-attention in the encoder's and decoder's middle blocks")
    kl_weight: float = Field(1e-4, ge=0, description="weight of the KL term (per latent element)")
    sample_posterior: bool = Field(
        True, description="decode a posterior sample in training (false: the posterior mean)"
    )
    scale_samples: int = Field(
        512, ge=1, description="training images the latent scaling factor (1 / std of their latents) is measured on"
    )


def latent_geometry(cfg: Any) -> tuple[int, int]:
    """(latent channels, latent side) of an autoencoder run's config (a trainer.config.Config)."""
    m: AutoencoderConfig = cfg.model_cfg
    return m.latent_channels, cfg.data.image_size // m.downsample


class KLAutoencoder(nn.Module):
    """diffusers' AutoencoderKL plus its measured latent scaling factor (a buffer, saved with the weights)."""

    def __init__(self, cfg: AutoencoderConfig, channels: int, image_size: int):
        super().__init__()
        self.vae = AutoencoderKL(
            **cfg.diffusers_shape(channels, image_size),
            latent_channels=cfg.latent_channels,
            scaling_factor=1.0,  # diffusers' config value is unused: the measured one is the buffer below
            mid_block_add_attention=cfg.attention,
        )
        # 1 / std of the latents of the fixed calibration sample; 1 until first measured.
        self.register_buffer("scaling_factor", torch.ones((), dtype=torch.float32))

    @property
    def last_layer(self) -> torch.Tensor:
        return self.vae.decoder.conv_out.weight

    def posterior(self, images: torch.Tensor) -> DiagonalGaussianDistribution:
        return self.vae.encode(images).latent_dist

    def forward(
        self, images: torch.Tensor, noise: torch.Tensor | None = None, decode: bool = True
    ) -> dict[str, torch.Tensor]:
        """Reconstruct a posterior sample mean + std * `noise` (None: the mean); per-sample KL per element.
        `decode=False`: the posterior mean only (through `forward`, so a sharded module gathers its weights)."""
        post = self.posterior(images)
        # The latents serve statistics only; a copy, not a view of the encoder's output (FSDP2 warns on views).
        latents = post.mean.detach().clone()
        if not decode:
            return {"latents": latents}
        z = post.mean if noise is None else post.mean + post.std * noise.to(post.mean.dtype)
        recon = self.vae.decode(z).sample
        kl = post.kl() / post.mean[0].numel()
        return {"reconstruction": recon, "kl": kl, "latents": latents}

    @torch.no_grad()
    def encode_latents(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] (N, C, H, W) -> scaled latents (posterior mean x scaling factor)."""
        return self.posterior(images).mean * self.scaling_factor

    @torch.no_grad()
    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Scaled latents -> images in [-1, 1] (N, C, H, W)."""
        return self.vae.decode(latents / self.scaling_factor).sample.clamp(-1, 1)


class AutoencoderTask(Task):
    ModelConfig = AutoencoderConfig
    cfg: AutoencoderConfig
    # The adaptive weight comes from a whole chunk's gradients: micro-batching would change it.
    micro_batch_invariant = False
    samples_reconstruct = True

    def __init__(self, model_cfg: AutoencoderConfig, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        if ctx.num_frames > 1:
            raise ConfigError(
                "task autoencoder trains on images: use an image source (data.num_frames applies to video)"
            )
        if ctx.image_size % model_cfg.downsample:
            raise ConfigError(
                f"data.image_size={ctx.image_size} is not divisible by the autoencoder's downsampling factor "
                f"{model_cfg.downsample} (2 ** (len(model.block_out_channels) - 1))"
            )
        perceptual = None
        if model_cfg.perceptual is not None and model_cfg.perceptual.weight > 0:
            perceptual = VGGPerceptual.from_url(model_cfg.perceptual.url, ctx.storage_options)
        self.losses = AdversarialLosses(model_cfg, perceptual)

    def fsdp_refusal(self) -> str | None:
        if self.cfg.grad_penalty_every:
            # The same double backward through a sharded discriminator the VQ-GAN refuses (see VQGANTask).
            return (
                f"model.grad_penalty_every={self.cfg.grad_penalty_every} differentiates the discriminator twice "
                "(a gradient penalty), which FSDP2 does not support; set model.grad_penalty_every=0 "
                "(model.lecam_weight regularizes the discriminator without it) or use train.parallel=ddp"
            )
        return None

    @property
    def latent_shape(self) -> tuple[int, int, int]:
        side = self.ctx.image_size // self.cfg.downsample
        return (self.cfg.latent_channels, side, side)

    @classmethod
    def trainable_part_names(cls, model_cfg: AutoencoderConfig) -> list[str]:
        return ["generator", "discriminator"]

    @classmethod
    def ema_part_names(cls, model_cfg: AutoencoderConfig) -> list[str]:
        return ["generator"]

    def build(self, frozen) -> dict[str, nn.Module]:
        c = self.cfg
        return {
            "generator": KLAutoencoder(c, self.ctx.channels, self.ctx.image_size),
            "discriminator": PatchDiscriminator(self.ctx.channels, c.disc_channels, c.disc_layers, c.lecam_decay),
        }

    def phases(self, step: int, part_steps: Mapping[str, int]) -> list[Phase]:
        phases = [Phase("generator", "generator")]
        if step >= self.cfg.disc_start_step:
            phases.append(Phase("discriminator", "discriminator"))
        return phases

    def forward(self, modules, batch: Batch, step: int) -> dict[str, Any]:
        noise = None
        if self.cfg.sample_posterior and step >= 0:
            draws = sample_draws(self.seed, step, batch.positions, Stream.AUTOENCODER, device=batch.images.device)
            noise = draws.randn(self.latent_shape)
        return modules["generator"](batch.images, noise)

    def loss(self, phase: Phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        c = self.cfg
        weights = torch.ones(len(batch), 1, device=batch.images.device)  # one frame per sample
        recon, real, valid = outputs["reconstruction"], batch.images, batch.valid
        if phase.part == "generator":
            terms = self.losses.reconstruction(recon, real)
            total = terms["rec"] + c.kl_weight * outputs["kl"]
            generator = bare(modules, "generator")
            if info.step >= c.disc_start_step and c.adv_weight > 0:
                adv, weight = self.losses.adversarial(
                    modules["discriminator"], recon, terms["rec"], weights, valid, generator.last_layer
                )
                total = total + weight * adv
                terms["adv"] = adv
                terms["adv_weight"] = weight.detach()
            terms["kl"] = outputs["kl"]
            terms["scaling_factor"] = generator.scaling_factor
            return Loss(total, {k: v.detach() for k, v in terms.items()})

        # discriminator phase: reconstructions arrive detached
        every = c.grad_penalty_every
        penalize = bool(every) and info.part_step % every == 0
        total, terms = self.losses.discriminator(
            modules["discriminator"], bare(modules, "discriminator"), real, recon, weights, valid, penalize
        )
        return Loss(total, terms)

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
    def validate(self, modules, batch: Batch) -> dict[str, torch.Tensor]:
        out = modules["generator"](batch.images)  # the posterior mean: no draws in validation
        recon = out["reconstruction"].float().clamp(-1, 1)
        mse = (recon - batch.images.float()).pow(2).mean(dim=(1, 2, 3))
        z = out["latents"].float().flatten(1)
        return {
            "mse": mse,
            # Images span [-1, 1]: peak-to-peak 2, so PSNR = 10 log10(4 / MSE).
            "psnr": 10 * torch.log10(4.0 / mse.clamp(min=1e-10)),
            "kl": out["kl"].float(),
            "latent_mean": z.mean(dim=1),
            "latent_std": z.std(dim=1),
        }

    def _reconstruction_cells(self, images: torch.Tensor, *recons: torch.Tensor) -> torch.Tensor:
        """One cell per image: input | reconstruction(s) side by side (a 1-pixel dark gap), in [0, 1] on CPU."""
        gap = torch.full_like(images[..., :1], -1)
        cells = [images]
        for r in recons:
            cells += [gap, r]
        return ((torch.cat(cells, dim=-1).float().clamp(-1, 1) + 1) / 2).cpu()

    def previews(self, modules, ctx: PreviewContext) -> dict[str, torch.Tensor]:
        """input | online | EMA reconstruction of each image of a fixed held-out batch."""
        if ctx.batch is None:
            return {}
        images = ctx.batch.images[: ctx.num]
        with ctx.weights(False):
            online = modules["generator"](images)["reconstruction"]
        with ctx.weights(True):
            ema = modules["generator"](images)["reconstruction"]
        return {"reconstruction": self._reconstruction_cells(images, online, ema)}

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
            return self._reconstruction_cells(images, generator(images)["reconstruction"])
        g = torch.Generator().manual_seed(seed)
        latents = torch.randn((num, *self.latent_shape), generator=g).to(device)
        return ((generator.decode_latents(latents).float() + 1) / 2).cpu()


TASK = AutoencoderTask
