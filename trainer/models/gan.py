"""The GAN machinery the tokenizers share (VQ-GAN and the video tokenizer): their loss keys, a PatchGAN
discriminator, the hinge loss with LeCAM and a gradient penalty, Esser et al.'s adaptive weight, and
reconstruction losses computed per frame.

Everything works on frames (M, C, H, W): an image is one frame, a clip (N, T, C, H, W) is N*T frames
(`frames`), and a per-frame value becomes a per-sample one as the mean over the sample's real frames
(`per_sample`, with (N, T) frame weights: 1 for real frames, 0 for padding).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from trainer.models.perceptual import PerceptualConfig, VGGPerceptual


class AdversarialConfig(BaseModel):
    """`model.*` keys of a tokenizer's losses: reconstruction, perceptual, hinge GAN with its regularizers."""

    model_config = ConfigDict(extra="forbid")

    l1_weight: float = Field(1.0, ge=0)
    l2_weight: float = Field(0.0, ge=0)
    perceptual: PerceptualConfig | None = None
    adv_weight: float = Field(0.1, ge=0, description="generator's hinge adversarial weight (times the adaptive one)")
    adaptive_weight: bool = Field(
        True, description="Esser et al.: scale adv by |grad rec| / |grad adv| at the last layer"
    )
    adaptive_weight_max: float = Field(1e4, gt=0)
    disc_start_step: int = Field(2000, ge=0, description="global step from which the discriminator trains and is used")
    disc_channels: int = Field(32, ge=1)
    disc_layers: int = Field(2, ge=1)
    grad_penalty_every: int = Field(
        0, ge=0, description="gradient penalty on the discriminator's own steps 0, k, 2k, ..."
    )
    grad_penalty_weight: float = Field(10.0, ge=0)
    lecam_weight: float = Field(0.0, ge=0, description="LeCAM regularizer (Tseng et al. 2021); 0 = off")
    lecam_decay: float = Field(0.999, gt=0, lt=1)


class ConvAutoencoderShape(BaseModel):
    """The shape keys of the convolutional autoencoders the GAN tasks train (the VQ-GAN, the KL
    autoencoder): each level after the first halves the resolution."""

    block_out_channels: list[int] = Field(default=[32, 64, 64], min_length=1)
    layers_per_block: int = Field(1, ge=1)
    norm_num_groups: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check_groups(self) -> ConvAutoencoderShape:
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(
                f"model.block_out_channels {self.block_out_channels}: every entry must be divisible by "
                f"model.norm_num_groups={self.norm_num_groups}"
            )
        return self

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    def diffusers_shape(self, channels: int, image_size: int) -> dict[str, Any]:
        """This shape as the keys of diffusers' whole autoencoders (`AutoencoderKL`, `VQModel`)."""
        n = len(self.block_out_channels)
        return {
            "in_channels": channels,
            "out_channels": channels,
            "down_block_types": ("DownEncoderBlock2D",) * n,
            "up_block_types": ("UpDecoderBlock2D",) * n,
            "block_out_channels": tuple(self.block_out_channels),
            "layers_per_block": self.layers_per_block,
            "norm_num_groups": self.norm_num_groups,
            "sample_size": image_size,
        }


class PatchDiscriminator(nn.Module):
    """PatchGAN (Isola et al. 2017; taming-transformers' NLayerDiscriminator) with GroupNorm instead of
    BatchNorm: no running statistics to keep in sync across ranks, and a per-sample gradient penalty stays
    per sample. Written here because no maintained library ships a PatchGAN without torchvision."""

    def __init__(self, channels: int, width: int, layers: int, lecam_decay: float):
        super().__init__()
        mods: list[nn.Module] = [nn.Conv2d(channels, width, 4, 2, 1), nn.LeakyReLU(0.2)]
        c = width
        for i in range(1, layers + 1):
            out = width * min(2**i, 8)
            stride = 2 if i < layers else 1
            mods += [nn.Conv2d(c, out, 4, stride, 1), nn.GroupNorm(min(8, out), out), nn.LeakyReLU(0.2)]
            c = out
        mods.append(nn.Conv2d(c, 1, 3, 1, 1))
        self.net = nn.Sequential(*mods)
        self.lecam_decay = lecam_decay
        # LeCAM anchors: EMAs of the mean logits on real and on generated images.
        self.register_buffer("ema_real", torch.zeros(()))
        self.register_buffer("ema_fake", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Per-sample mean patch logit (N,)."""
        return self.net(x).flatten(1).mean(1)


def hinge_d(real: torch.Tensor, fake: torch.Tensor) -> torch.Tensor:
    return F.relu(1 - real) + F.relu(1 + fake)


def adaptive_weight(rec: torch.Tensor, adv: torch.Tensor, layer: torch.Tensor, max_weight: float) -> torch.Tensor:
    """Esser et al. (2021) eq. 7: ||grad_L rec|| / (||grad_L adv|| + 1e-4) at the decoder's last layer L."""
    g_rec = torch.autograd.grad(rec, layer, retain_graph=True)[0]
    g_adv = torch.autograd.grad(adv, layer, retain_graph=True)[0]
    return (g_rec.norm() / (g_adv.norm() + 1e-4)).clamp(0.0, max_weight).detach()


def frames(x: torch.Tensor) -> torch.Tensor:
    """(N, C, H, W) or (N, T, C, H, W) -> frames (N*T, C, H, W)."""
    return x.flatten(0, 1) if x.ndim == 5 else x


def per_sample(per_frame: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-frame values (N*T,) -> the mean over each sample's real frames (N,); `weights` (N, T)."""
    return (per_frame.view(weights.shape) * weights).sum(1) / weights.sum(1).clamp(min=1)


class AdversarialLosses:
    """A tokenizer's losses against a `PatchDiscriminator`, per frame (see module doc): reconstruction
    (L1, L2, perceptual), the generator's adversarial term with the adaptive weight, and the discriminator's
    hinge loss with LeCAM and the gradient penalty."""

    def __init__(self, cfg: AdversarialConfig, perceptual: VGGPerceptual | None = None):
        self.cfg = cfg
        self.perceptual = perceptual

    def reconstruction(self, recon: torch.Tensor, real: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-frame terms of frames (M, C, H, W); `rec` is their weighted sum."""
        c = self.cfg
        diff = recon.float() - real.float()
        terms = {}
        if c.l1_weight:
            terms["l1"] = diff.abs().mean(dim=(1, 2, 3))
        if c.l2_weight:
            terms["l2"] = diff.pow(2).mean(dim=(1, 2, 3))
        rec = sum((getattr(c, f"{k}_weight") * v for k, v in terms.items()), torch.zeros_like(diff[:, 0, 0, 0]))
        if self.perceptual is not None:
            self.perceptual.to(real.device)
            terms["perceptual"] = self.perceptual(recon.float(), real.float())
            rec = rec + c.perceptual.weight * terms["perceptual"]
        terms["rec"] = rec
        return terms

    def adversarial(
        self,
        discriminator: nn.Module,
        recon: torch.Tensor,
        rec: torch.Tensor,
        weights: torch.Tensor,
        valid: torch.Tensor,
        last_layer: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The generator's per-sample adversarial loss on frames `recon` and its weight: `model.adv_weight`,
        times the adaptive weight against the per-sample reconstruction loss `rec` at `last_layer`."""
        c = self.cfg
        adv = per_sample(-discriminator(recon).float(), weights)
        weight = torch.tensor(c.adv_weight, device=recon.device)
        if c.adaptive_weight:
            n = valid.sum().clamp(min=1)
            weight = weight * adaptive_weight(
                (rec * valid).sum() / n, (adv * valid).sum() / n, last_layer, c.adaptive_weight_max
            )
        return adv, weight

    def discriminator(
        self,
        discriminator: nn.Module,
        anchors: PatchDiscriminator,
        real: torch.Tensor,
        recon: torch.Tensor,
        weights: torch.Tensor,
        valid: torch.Tensor,
        penalize: bool,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-sample discriminator loss on real and (detached) reconstructed frames, and its terms.
        `anchors`: the discriminator's own module, which keeps the LeCAM EMAs; `penalize`: add the
        gradient penalty on real frames this step."""
        c = self.cfg
        real_in = real.detach().requires_grad_(penalize)
        d_real_frames, d_fake_frames = discriminator(real_in).float(), discriminator(recon).float()
        total = per_sample(hinge_d(d_real_frames, d_fake_frames), weights)
        d_real, d_fake = per_sample(d_real_frames, weights), per_sample(d_fake_frames, weights)
        terms = {"hinge": total.detach(), "real_logit": d_real.detach(), "fake_logit": d_fake.detach()}
        if c.lecam_weight > 0:
            lecam = per_sample(
                F.relu(d_real_frames - anchors.ema_fake).pow(2) + F.relu(anchors.ema_real - d_fake_frames).pow(2),
                weights,
            )
            total = total + c.lecam_weight * lecam
            terms["lecam"] = lecam.detach()
            with torch.no_grad():
                n = valid.sum().clamp(min=1)
                anchors.ema_real.lerp_((d_real * valid).sum() / n, 1 - anchors.lecam_decay)
                anchors.ema_fake.lerp_((d_fake * valid).sum() / n, 1 - anchors.lecam_decay)
        if real_in.requires_grad:
            # Gradient penalty on real frames (the seed's apply_grad_penalty_every): per frame
            # (||grad_x D(x)|| - 1)^2, differentiated again for the discriminator's update.
            (grad,) = torch.autograd.grad(d_real_frames.sum(), real_in, create_graph=True)
            gp = per_sample((grad.flatten(1).norm(dim=1) - 1).pow(2), weights)
            total = total + c.grad_penalty_weight * gp
            terms["grad_penalty"] = gp.detach()
        return total, terms
