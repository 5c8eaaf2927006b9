"""The VQ-GAN's generator (`task: vqgan`, Esser et al. 2021): diffusers' VAE Encoder/Decoder blocks around a
quantizer of `trainer.models.quantize` (VQ, FSQ or LFQ). MaskGIT and latent diffusion load it frozen as an
image tokenizer through `encode_indices` / `decode_indices`."""

from __future__ import annotations

from typing import ClassVar

import torch
from diffusers.models.autoencoders.vae import Decoder, Encoder
from pydantic import ConfigDict
from torch import nn

from trainer.models.gan import AdversarialConfig, ConvAutoencoderShape
from trainer.models.quantize import CodebookConfig, QuantizedAutoencoder


class VQGANConfig(ConvAutoencoderShape, CodebookConfig, AdversarialConfig):
    # What this run's generator is to a run that loads it frozen (`Task.frozen_kind` reads it from here).
    frozen_kind: ClassVar[str] = "image-tokenizer"
    model_config = ConfigDict(extra="forbid")


class VQAutoencoder(QuantizedAutoencoder):
    """Encoder -> 1x1 conv -> quantizer -> 1x1 conv -> Decoder; `forward` returns what the losses need."""

    def __init__(self, cfg: VQGANConfig, channels: int):
        super().__init__()
        self.cfg = cfg
        n = len(cfg.block_out_channels)
        latent = cfg.latent_channels
        self.encoder = Encoder(
            in_channels=channels,
            out_channels=latent,
            down_block_types=("DownEncoderBlock2D",) * n,
            block_out_channels=tuple(cfg.block_out_channels),
            layers_per_block=cfg.layers_per_block,
            norm_num_groups=cfg.norm_num_groups,
            double_z=False,
            mid_block_add_attention=False,
        )
        self.decoder = Decoder(
            in_channels=latent,
            out_channels=channels,
            up_block_types=("UpDecoderBlock2D",) * n,
            block_out_channels=tuple(cfg.block_out_channels),
            layers_per_block=cfg.layers_per_block,
            norm_num_groups=cfg.norm_num_groups,
            mid_block_add_attention=False,
        )
        self.quant_conv = nn.Conv2d(latent, latent, 1)
        self.post_quant_conv = nn.Conv2d(latent, latent, 1)
        self._init_quantizer(cfg, channel_first=True)

    @property
    def last_layer(self) -> torch.Tensor:
        return self.decoder.conv_out.weight

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        z = self.quant_conv(self.encoder(images))
        q, idx, aux = self.quantize(z)
        recon = self.decoder(self.post_quant_conv(q))
        # Per-sample commitment ||z - sg(q)||^2 (the codebook itself learns by EMA for vq).
        commit = (z - q.detach()).pow(2).mean(dim=(1, 2, 3))
        if self.training:
            self._record_usage(idx)
        return {"reconstruction": recon, "indices": idx, "commitment": commit, "aux": aux}

    @torch.no_grad()
    def encode_indices(self, images: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] (N, C, H, W) -> code indices (N, h, w)."""
        z = self.quant_conv(self.encoder(images))
        return self.quantize(z)[1]

    @torch.no_grad()
    def decode_indices(self, idx: torch.Tensor) -> torch.Tensor:
        """Code indices (N, h, w) -> images in [-1, 1] (N, C, H, W)."""
        q = self.lookup_codes(idx)  # channel-first (N, C, h, w)
        return self.decoder(self.post_quant_conv(q.to(self.post_quant_conv.weight.dtype))).clamp(-1, 1)
