"""The causal video tokenizer's generator (`task: video-tokenizer`): C-ViViT (Villegas et al. 2022, Phenaki),
videos (N, T, C, H, W) <-> code indices, the first frame alone and then temporal patches, so a one-frame clip
tokenizes exactly like that image. Video MaskGIT loads it frozen through `encode_indices` / `decode_indices`;
`check_frames` and `real_tokens` are the clip-length rules both share."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import nn

from trainer.errors import ConfigError
from trainer.models.gan import AdversarialConfig
from trainer.models.quantize import CodebookConfig, QuantizedAutoencoder


class VideoTokenizerConfig(CodebookConfig, AdversarialConfig):
    # What this run's generator is to a run that loads it frozen (`Task.frozen_kind` reads it from here).
    frozen_kind: ClassVar[str] = "video-tokenizer"
    model_config = ConfigDict(extra="forbid")

    patch_size: int = Field(4, ge=1, description="spatial patch side: a frame becomes (H/p) x (W/p) tokens")
    temporal_patch: int = Field(2, ge=1, description="frames after the first per token slice; T-1 must divide by it")
    dim: int = Field(128, ge=8)
    heads: int = Field(4, ge=1)
    spatial_depth: int = Field(2, ge=1, description="spatial transformer layers, encoder and decoder each")
    temporal_depth: int = Field(2, ge=1, description="causal temporal transformer layers, encoder and decoder each")
    mlp_ratio: float = Field(4.0, gt=0)
    pixel_channels: int = Field(16, ge=1, description="channels of the decoder's shared per-frame output conv")
    encoder_context: Literal["clip", "patch"] = Field(
        "clip",
        description="what a code sees: its causal clip (C-ViViT), or its own spatio-temporal patch (local codes, "
        "which a masked transformer learns much faster); the decoder always sees the whole causal clip",
    )

    @model_validator(mode="after")
    def _check(self) -> VideoTokenizerConfig:
        if self.dim % self.heads:
            raise ValueError(f"model.dim={self.dim} must be divisible by model.heads={self.heads}")
        return self

    @property
    def downsample(self) -> int:
        """Pixels per token side (what `vqgan.tokenizer_geometry` reads)."""
        return self.patch_size

    def slices(self, frames: int) -> int:
        """Token slices of a clip of `frames` frames (1 + k * temporal_patch)."""
        return 1 + (frames - 1) // self.temporal_patch


def check_frames(frames: int, temporal_patch: int, key: str = "data.num_frames") -> None:
    """Clips are 1 + k * temporal_patch frames long: refuse others with the nearest valid counts."""
    if frames < 1 or (frames - 1) % temporal_patch:
        lower = 1 + (frames - 1) // temporal_patch * temporal_patch if frames > 1 else 1
        raise ConfigError(
            f"{key}={frames}: the causal tokenizer takes the first frame alone and then groups of "
            f"model.temporal_patch={temporal_patch} frames, so the frame count must be 1 + k * {temporal_patch} "
            f"(e.g. {lower} or {lower + temporal_patch})"
        )


def real_tokens(frames: torch.Tensor, length: int, temporal_patch: int, per_slice: int) -> torch.Tensor:
    """(N, length) True for the tokens of slices that start with a real frame: `frames` (N,) real frames per
    sample, slice 0 is frame 0 and slice j >= 1 starts at frame 1 + (j - 1) * temporal_patch."""
    slices = torch.arange(length // per_slice, device=frames.device)
    first_frame = (slices - 1).clamp(min=0) * temporal_patch + (slices > 0).long()
    return (first_frame[None] < frames[:, None]).repeat_interleave(per_slice, dim=1)


def sinusoidal(length: int, dim: int, device: torch.device) -> torch.Tensor:
    """Fixed sinusoidal positions (Vaswani et al. 2017) (length, dim): slice t's code depends on t alone, so
    any clip length on the 1 + k * temporal_patch grid works and a prefix keeps its embeddings."""
    pos = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    out = torch.zeros(length, dim, device=device)
    out[:, 0::2] = torch.sin(pos * freq)
    out[:, 1::2] = torch.cos(pos * freq)[:, : dim // 2]
    return out


def _transformer(cfg: VideoTokenizerConfig, depth: int) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(
        cfg.dim,
        cfg.heads,
        int(cfg.dim * cfg.mlp_ratio),
        dropout=0.0,
        activation="gelu",
        batch_first=True,
        norm_first=True,
    )
    return nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)


class CausalVideoAutoencoder(QuantizedAutoencoder):
    """C-ViViT: videos (N, T, C, H, W) in [-1, 1] <-> code indices (N, S, h, w), S = 1 + (T - 1) / temporal_patch."""

    def __init__(self, cfg: VideoTokenizerConfig, channels: int, image_size: int):
        super().__init__()
        self.cfg = cfg
        self.channels = channels
        p, tp, d = cfg.patch_size, cfg.temporal_patch, cfg.dim
        self.grid = image_size // p
        self.embed_first = nn.Linear(channels * p * p, d)
        self.embed_rest = nn.Linear(tp * channels * p * p, d)
        self.dec_spatial_pos = nn.Parameter(torch.zeros(1, self.grid * self.grid, d))
        nn.init.trunc_normal_(self.dec_spatial_pos, std=0.02)
        if cfg.encoder_context == "clip":  # local codes have no positions (and DDP wants no unused parameters)
            self.enc_spatial_pos = nn.Parameter(torch.zeros(1, self.grid * self.grid, d))
            nn.init.trunc_normal_(self.enc_spatial_pos, std=0.02)
        self.enc_spatial = _transformer(cfg, cfg.spatial_depth)
        self.enc_temporal = _transformer(cfg, cfg.temporal_depth)
        self.enc_norm = nn.LayerNorm(d)
        self.to_latent = nn.Linear(d, cfg.latent_channels)
        self.from_latent = nn.Linear(cfg.latent_channels, d)
        self.dec_temporal = _transformer(cfg, cfg.temporal_depth)
        self.dec_spatial = _transformer(cfg, cfg.spatial_depth)
        self.dec_norm = nn.LayerNorm(d)
        k = cfg.pixel_channels
        self.to_pixels_first = nn.Linear(d, k * p * p)
        self.to_pixels_rest = nn.Linear(d, tp * k * p * p)
        # Shared by every frame (first or later): smooths patch seams and is the adaptive weight's last layer.
        self.pixel_out = nn.Sequential(nn.SiLU(), nn.Conv2d(k, channels, 3, padding=1))
        self._init_quantizer(cfg, channel_first=False)

    @property
    def last_layer(self) -> torch.Tensor:
        return self.pixel_out[1].weight

    # ---- patches
    def _patchify(self, video: torch.Tensor) -> torch.Tensor:
        """(N, T, C, H, W) -> slice embeddings (N, S, h*w, dim)."""
        n, t, c, _, _ = video.shape
        p, tp, g = self.cfg.patch_size, self.cfg.temporal_patch, self.grid

        def patches(x: torch.Tensor, frames: int) -> torch.Tensor:  # (N, S*frames, C, H, W) -> (N, S, g*g, f*C*p*p)
            x = x.reshape(n, -1, frames, c, g, p, g, p)
            return x.permute(0, 1, 4, 6, 2, 3, 5, 7).reshape(n, x.shape[1], g * g, frames * c * p * p)

        first = self.embed_first(patches(video[:, :1], 1))
        if t == 1:
            return first
        return torch.cat([first, self.embed_rest(patches(video[:, 1:], tp))], dim=1)

    def _unpatchify(self, slices: torch.Tensor) -> torch.Tensor:
        """Decoded slice features (N, S, h*w, dim) -> videos (N, 1 + (S-1) * temporal_patch, C, H, W)."""
        n, s = slices.shape[:2]
        p, tp, g, k = self.cfg.patch_size, self.cfg.temporal_patch, self.grid, self.cfg.pixel_channels

        def frames(x: torch.Tensor, f: int) -> torch.Tensor:  # (N, S', g*g, f*k*p*p) -> (N, S'*f, k, H, W)
            x = x.reshape(n, -1, g, g, f, k, p, p).permute(0, 1, 4, 5, 2, 6, 3, 7)
            return x.reshape(n, -1, k, g * p, g * p)

        out = frames(self.to_pixels_first(slices[:, :1]), 1)
        if s > 1:
            out = torch.cat([out, frames(self.to_pixels_rest(slices[:, 1:]), tp)], dim=1)
        pixels = self.pixel_out(out.flatten(0, 1))
        return pixels.view(n, -1, *pixels.shape[1:])

    # ---- transformers
    def _spatial(self, x: torch.Tensor, transformer: nn.Module, pos: torch.Tensor) -> torch.Tensor:
        n, s, length, d = x.shape
        return transformer(x.reshape(n * s, length, d) + pos).view(n, s, length, d)

    def _temporal(self, x: torch.Tensor, transformer: nn.Module) -> torch.Tensor:
        """Causal attention along the slices of each spatial position."""
        n, s, length, d = x.shape
        seq = x.permute(0, 2, 1, 3).reshape(n * length, s, d) + sinusoidal(s, d, x.device).to(x.dtype)
        causal = nn.Transformer.generate_square_subsequent_mask(s, device=x.device, dtype=x.dtype)
        out = transformer(seq, mask=causal, is_causal=True)
        return out.view(n, length, s, d).permute(0, 2, 1, 3)

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Videos -> continuous latents (N, S*h*w, latent) before quantization."""
        x = self._patchify(video)
        if self.cfg.encoder_context == "patch":
            # Every token a sequence of its own: no positions, no attention to other tokens, so a code is a
            # function of its patch alone (an empty patch is one code anywhere, a stroke the same code wherever
            # it is); the first slice keeps its own embedding.
            n, s, length, d = x.shape
            x = self.enc_temporal(self.enc_spatial(x.reshape(-1, 1, d))).view(n, s, length, d)
        else:
            x = self._spatial(x, self.enc_spatial, self.enc_spatial_pos)
            x = self._temporal(x, self.enc_temporal)
        return self.to_latent(self.enc_norm(x)).flatten(1, 2)

    def decode(self, q: torch.Tensor) -> torch.Tensor:
        """Quantized latents (N, S*h*w, latent) -> videos (N, T, C, H, W)."""
        n = q.shape[0]
        x = self.from_latent(q).view(n, -1, self.grid * self.grid, self.cfg.dim)
        x = self._temporal(x, self.dec_temporal)
        x = self._spatial(x, self.dec_spatial, self.dec_spatial_pos)
        return self._unpatchify(self.dec_norm(x))

    def forward(self, video: torch.Tensor, frames: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        z = self.encode(video)
        mask = None if frames is None else real_tokens(frames, z.shape[1], self.cfg.temporal_patch, self.grid**2)
        q, idx, aux = self.quantize(z, mask)
        recon = self.decode(q)
        # Per-sample commitment ||z - sg(q)||^2 over the real slices' tokens.
        per_token = (z - q.detach()).pow(2).mean(-1)
        if mask is None:
            commit = per_token.mean(1)
        else:
            commit = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)
        if self.training:
            self._record_usage(idx, mask)
        return {"reconstruction": recon, "indices": idx, "commitment": commit, "aux": aux, "token_mask": mask}

    @torch.no_grad()
    def encode_indices(self, video: torch.Tensor) -> torch.Tensor:
        """Videos in [-1, 1] (N, T, C, H, W) -> code indices (N, S, h, w); an image is a one-frame video."""
        idx = self.quantize(self.encode(video))[1]
        return idx.view(video.shape[0], -1, self.grid, self.grid)

    @torch.no_grad()
    def decode_indices(self, idx: torch.Tensor) -> torch.Tensor:
        """Code indices (N, S, h, w) -> videos in [-1, 1] (N, 1 + (S-1) * temporal_patch, C, H, W)."""
        q = self.lookup_codes(idx.flatten(1))
        return self.decode(q.to(self.from_latent.weight.dtype)).clamp(-1, 1)
