"""The KL autoencoder (`task: autoencoder`'s generator, latent diffusion's first stage): diffusers'
`AutoencoderKL` with a small block config plus its measured latent scaling factor, a buffer saved with its
weights (trainer/tasks/autoencoder.py measures it; trainer/diffusion/latent.py reads it)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers.models.autoencoders.autoencoder_kl import AutoencoderKL
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from pydantic import ConfigDict, Field
from torch import nn

from trainer.models.gan import AdversarialConfig, ConvAutoencoderShape


class AutoencoderConfig(ConvAutoencoderShape, AdversarialConfig):
    # What this run's generator is to a run that loads it frozen (`Task.frozen_kind` reads it from here).
    frozen_kind: ClassVar[str] = "kl-autoencoder"
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
