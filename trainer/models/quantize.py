"""Quantizers of the tokenizers (VQ-GAN, video tokenizer): vector-quantize-pytorch's VQ (EMA codebook), FSQ
and LFQ behind one interface, their `model.*` keys, and codebook usage statistics.

A tokenizer subclasses `QuantizedAutoencoder` and calls `_init_quantizer` in its constructor; the task
that trains it reads `codebook_usage()`, and a MaskGIT calls the tokenizer's `encode_indices` /
`decode_indices`, which use `quantize` and `lookup_codes`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from vector_quantize_pytorch import FSQ, LFQ, VectorQuantize


class CodebookConfig(BaseModel):
    """`model.*` keys of a quantizer (shared by the image and the video tokenizer)."""

    model_config = ConfigDict(extra="forbid")

    quantizer: Literal["vq", "fsq", "lfq"] = "vq"
    codebook_size: int = Field(256, ge=2, description="vq and lfq (lfq: a power of two); fsq: product of fsq_levels")
    codebook_dim: int = Field(16, ge=1, description="vq: code vector width")
    fsq_levels: list[int] = Field(default=[8, 6, 5], min_length=1)
    commitment_weight: float = Field(0.25, ge=0)
    codebook_decay: float = Field(0.8, gt=0, lt=1, description="vq: EMA decay of the codebook")
    dead_code_threshold: float = Field(
        0.0, ge=0, description="vq: restart codes whose EMA usage falls below this (0 = off)"
    )
    lfq_entropy_weight: float = Field(0.1, ge=0)
    usage_window: int = Field(100, ge=1, description="training forwards over which codebook usage is measured")

    @model_validator(mode="after")
    def _check_codebook(self) -> CodebookConfig:
        if self.quantizer == "lfq" and self.codebook_size & (self.codebook_size - 1):
            raise ValueError(f"model.codebook_size={self.codebook_size}: lfq needs a power of two (e.g. 256, 1024)")
        if self.quantizer == "fsq" and any(level < 3 for level in self.fsq_levels):
            raise ValueError(f"model.fsq_levels={self.fsq_levels}: every level must be >= 3")
        return self

    @property
    def num_codes(self) -> int:
        return math.prod(self.fsq_levels) if self.quantizer == "fsq" else self.codebook_size

    @property
    def latent_channels(self) -> int:
        if self.quantizer == "fsq":
            return len(self.fsq_levels)
        if self.quantizer == "lfq":
            return int(math.log2(self.codebook_size))
        return self.codebook_dim


class QuantizedAutoencoder(nn.Module):
    """What every tokenizer shares: a quantizer from vector-quantize-pytorch (VQ with an EMA codebook, FSQ
    or LFQ), codebook usage over the last training forwards, and code lookup for decoding.

    `channel_first`: latents are image maps (N, C, h, w) (VQ-GAN); else token sequences (N, L, C) (video).
    """

    cfg: CodebookConfig
    # What a MaskGIT calls on its frozen tokenizer: under train.shard_frozen these gather the weights (FSDP2).
    fsdp_forward_methods = ("encode_indices", "decode_indices")

    def _init_quantizer(self, cfg: CodebookConfig, channel_first: bool) -> None:
        latent = cfg.latent_channels
        self.channel_first = channel_first
        if cfg.quantizer == "vq":
            # Commitment is computed per sample by the callers (the library returns a batch mean).
            self.quantizer = VectorQuantize(
                dim=latent,
                codebook_size=cfg.codebook_size,
                decay=cfg.codebook_decay,
                commitment_weight=0.0,
                threshold_ema_dead_code=cfg.dead_code_threshold,
                accept_image_fmap=channel_first,
            )
        elif cfg.quantizer == "fsq":
            self.quantizer = FSQ(levels=list(cfg.fsq_levels), dim=latent, channel_first=channel_first)
        else:
            self.quantizer = LFQ(
                dim=latent,
                codebook_size=cfg.codebook_size,
                entropy_loss_weight=cfg.lfq_entropy_weight,
                commitment_loss_weight=0.0,
                channel_first=channel_first,
            )
        # Which codes were used in each of the last `usage_window` training forwards (a ring).
        self.register_buffer("recent_codes", torch.zeros(cfg.usage_window, cfg.num_codes, dtype=torch.bool))
        self.register_buffer("recent_pos", torch.zeros((), dtype=torch.long))

    @property
    def last_layer(self) -> torch.Tensor:
        """The weight the adaptive GAN weight differentiates against."""
        raise NotImplementedError

    def quantize(
        self, z: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(quantized like z, indices, auxiliary loss scalar). `mask` (N, L) (sequences only): False tokens
        are padding, left out of the VQ codebook's EMA update and LFQ's entropy loss."""
        if self.cfg.quantizer == "vq":
            q, idx, _ = self.quantizer(z, mask=mask) if mask is not None else self.quantizer(z)
            return q, idx, z.new_zeros(())
        if self.cfg.quantizer == "fsq":
            q, idx = self.quantizer(z)
            return q, idx, z.new_zeros(())
        q, idx, aux = self.quantizer(z, mask=mask) if mask is not None else self.quantizer(z)
        return q, idx, aux

    @torch.no_grad()
    def _record_usage(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        used = torch.zeros(self.cfg.num_codes, dtype=torch.bool, device=idx.device)
        used[idx[mask] if mask is not None else idx.flatten()] = True
        self.recent_codes[self.recent_pos % self.cfg.usage_window] = used
        self.recent_pos += 1

    def codebook_usage(self) -> torch.Tensor:
        """Fraction of the codebook used over the last `usage_window` training forwards (rows not yet
        written are all False, so no slicing and no device sync on the training step)."""
        return self.recent_codes.any(0).float().mean()

    def lookup_codes(self, idx: torch.Tensor) -> torch.Tensor:
        """Code indices -> quantized latents: (N, C, h, w) for image maps, (N, L, C) for sequences."""
        if self.cfg.quantizer == "vq":
            return self.quantizer.get_output_from_indices(idx)  # the quantizer's own layout
        return self.quantizer.indices_to_codes(idx)


def tokenizer_geometry(cfg: Any) -> tuple[int, int]:
    """(codebook size, latent grid side) of a tokenizer run's config (a trainer.config.Config): a VQ-GAN's
    or a video tokenizer's, whose `downsample` is pixels per token side."""
    m = cfg.model_cfg
    return m.num_codes, cfg.data.image_size // m.downsample
