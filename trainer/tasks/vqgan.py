"""VQ-GAN task (`task: vqgan`): a convolutional VQ autoencoder trained with a PatchGAN (Esser et al. 2021).

Parts: `generator` (diffusers' VAE Encoder/Decoder blocks around a quantizer
from vector-quantize-pytorch: classic VQ with an EMA codebook, FSQ or LFQ) and
`discriminator` (a PatchGAN with its own optimizer, schedule, scaler and
clipping via `optim.discriminator.*`).

One generator forward per chunk; the generator phase calls the discriminator
bare with gradients off (so DDP all-reduces nothing for it and sees no unused
parameters); the discriminator phase runs from `model.disc_start_step` on the
detached reconstructions. Only the generator has an EMA.

MaskGIT uses the trained generator as a frozen tokenizer through
`VQAutoencoder.encode_indices` / `decode_indices` and
`tokenizer_geometry(config)`. The video tokenizer (`video_tokenizer.py`)
shares the config sections (`CodebookConfig`, `AdversarialConfig`), the
quantizer (`QuantizedAutoencoder`), the discriminator and the losses: they
are computed per frame and averaged over each sample's real frames.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.vae import Decoder, Encoder
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn
from vector_quantize_pytorch import FSQ, LFQ, VectorQuantize

from trainer.tasks.base import Batch, Loss, Phase, PreviewContext, StepInfo, Task, TaskContext


class PerceptualConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(description="VGG16 feature weights (torchvision `features.*` keys) as safetensors; path or URL")
    weight: float = Field(1.0, ge=0)


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


class VQGANConfig(CodebookConfig, AdversarialConfig):
    model_config = ConfigDict(extra="forbid")

    # autoencoder (each level after the first halves the resolution)
    block_out_channels: list[int] = Field(default=[32, 64, 64], min_length=1)
    layers_per_block: int = Field(1, ge=1)
    norm_num_groups: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check(self) -> VQGANConfig:
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


def tokenizer_geometry(cfg: Any) -> tuple[int, int]:
    """(codebook size, latent grid side) of a VQ-GAN run's config (a trainer.config.Config)."""
    m: VQGANConfig = cfg.model_cfg
    return m.num_codes, cfg.data.image_size // m.downsample


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


def _bare(module: nn.Module) -> nn.Module:
    return getattr(module, "module", module)


class VQGANTask(Task):
    ModelConfig = VQGANConfig
    cfg: VQGANConfig
    # The adaptive weight comes from a whole chunk's gradients: micro-batching would change it.
    micro_batch_invariant = False

    def fsdp_refusal(self) -> str | None:
        if self.cfg.grad_penalty_every:
            # A double backward (create_graph=True) through the sharded discriminator: FSDP2's backward
            # hooks free its gathered weights before the second pass needs them (measured: it fails).
            return (
                f"model.grad_penalty_every={self.cfg.grad_penalty_every} differentiates the discriminator twice "
                "(a gradient penalty), which FSDP2 does not support; set model.grad_penalty_every=0 "
                "(model.lecam_weight regularizes the discriminator without it) or use train.parallel=ddp"
            )
        return None

    def __init__(self, model_cfg: VQGANConfig, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        from trainer.config import ConfigError

        if ctx.image_size % model_cfg.downsample:
            raise ConfigError(
                f"data.image_size={ctx.image_size} is not divisible by the autoencoder's downsampling factor "
                f"{model_cfg.downsample} (2 ** (len(model.block_out_channels) - 1))"
            )
        self.perceptual = None
        if model_cfg.perceptual is not None and model_cfg.perceptual.weight > 0:
            from trainer.models.perceptual import VGGPerceptual

            self.perceptual = VGGPerceptual.from_url(model_cfg.perceptual.url, ctx.storage_options)

    @classmethod
    def trainable_part_names(cls, model_cfg: VQGANConfig) -> list[str]:
        return ["generator", "discriminator"]

    @classmethod
    def ema_part_names(cls, model_cfg: VQGANConfig) -> list[str]:
        return ["generator"]

    def build(self, frozen) -> dict[str, nn.Module]:
        c = self.cfg
        return {
            "generator": VQAutoencoder(c, self.ctx.channels),
            "discriminator": PatchDiscriminator(self.ctx.channels, c.disc_channels, c.disc_layers, c.lecam_decay),
        }

    def phases(self, step: int, part_steps: Mapping[str, int]) -> list[Phase]:
        phases = [Phase("generator", "generator")]
        if step >= self.cfg.disc_start_step:
            phases.append(Phase("discriminator", "discriminator"))
        return phases

    def forward(self, modules, batch: Batch, step: int) -> dict[str, Any]:
        return modules["generator"](batch.images)

    # Losses and metrics are computed per frame and averaged over each sample's real frames, so the video
    # tokenizer (N, T, C, H, W) with padding frames shares them; an image is one frame of weight 1.
    def frame_weights(self, batch: Batch) -> torch.Tensor:
        """(N, T) weight of each frame in losses and metrics: 1 for real frames, 0 for padding."""
        return torch.ones(len(batch), 1, device=batch.images.device)

    @staticmethod
    def _frames(x: torch.Tensor) -> torch.Tensor:
        """(N, C, H, W) or (N, T, C, H, W) -> frames (N*T, C, H, W)."""
        return x.flatten(0, 1) if x.ndim == 5 else x

    @staticmethod
    def _per_sample(per_frame: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Per-frame values (N*T,) -> the mean over each sample's real frames (N,)."""
        return (per_frame.view(weights.shape) * weights).sum(1) / weights.sum(1).clamp(min=1)

    def _reconstruction_loss(self, recon: torch.Tensor, real: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-frame terms of frames (M, C, H, W)."""
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

    def loss(self, phase: Phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        c = self.cfg
        weights = self.frame_weights(batch)
        recon, real, valid = self._frames(outputs["reconstruction"]), self._frames(batch.images), batch.valid

        def per_sample(per_frame: torch.Tensor) -> torch.Tensor:
            return self._per_sample(per_frame, weights)

        if phase.part == "generator":
            terms = {k: per_sample(v) for k, v in self._reconstruction_loss(recon, real).items()}
            total = terms["rec"] + c.commitment_weight * outputs["commitment"] + outputs["aux"]
            if info.step >= c.disc_start_step and c.adv_weight > 0:
                adv = per_sample(-modules["discriminator"](recon).float())
                weight = torch.tensor(c.adv_weight, device=recon.device)
                if c.adaptive_weight:
                    n = valid.sum().clamp(min=1)
                    layer = _bare(modules["generator"]).last_layer
                    weight = weight * adaptive_weight(
                        (terms["rec"] * valid).sum() / n, (adv * valid).sum() / n, layer, c.adaptive_weight_max
                    )
                total = total + weight * adv
                terms["adv"] = adv
                terms["adv_weight"] = weight.detach()
            terms["commitment"] = outputs["commitment"]
            generator = _bare(modules["generator"])
            terms.update(self._code_stats(outputs["indices"], generator, outputs.get("token_mask")))
            return Loss(total, {k: v.detach() for k, v in terms.items()})

        # discriminator phase: reconstructions arrive detached
        disc = modules["discriminator"]
        real_in = real.detach().requires_grad_(self._penalize(info))
        d_real_frames, d_fake_frames = disc(real_in).float(), disc(recon).float()
        total = per_sample(hinge_d(d_real_frames, d_fake_frames))
        d_real, d_fake = per_sample(d_real_frames), per_sample(d_fake_frames)
        terms = {"hinge": total.detach(), "real_logit": d_real.detach(), "fake_logit": d_fake.detach()}
        if c.lecam_weight > 0:
            bare = _bare(disc)
            lecam = per_sample(
                F.relu(d_real_frames - bare.ema_fake).pow(2) + F.relu(bare.ema_real - d_fake_frames).pow(2)
            )
            total = total + c.lecam_weight * lecam
            terms["lecam"] = lecam.detach()
            with torch.no_grad():
                n = valid.sum().clamp(min=1)
                bare.ema_real.lerp_((d_real * valid).sum() / n, 1 - bare.lecam_decay)
                bare.ema_fake.lerp_((d_fake * valid).sum() / n, 1 - bare.lecam_decay)
        if real_in.requires_grad:
            # Gradient penalty on real frames (the seed's apply_grad_penalty_every): per frame
            # (||grad_x D(x)|| - 1)^2, differentiated again for the discriminator's update.
            (grad,) = torch.autograd.grad(d_real_frames.sum(), real_in, create_graph=True)
            gp = per_sample((grad.flatten(1).norm(dim=1) - 1).pow(2))
            total = total + c.grad_penalty_weight * gp
            terms["grad_penalty"] = gp.detach()
        return Loss(total, terms)

    def _penalize(self, info: StepInfo) -> bool:
        every = self.cfg.grad_penalty_every
        return bool(every) and info.part_step % every == 0

    def _code_stats(
        self, idx: torch.Tensor, generator: QuantizedAutoencoder, mask: torch.Tensor | None = None
    ) -> dict[str, torch.Tensor]:
        counts = torch.bincount(idx[mask] if mask is not None else idx.flatten(), minlength=self.cfg.num_codes)
        p = counts.float() / counts.sum().clamp(min=1)
        perplexity = torch.exp(-(p * torch.log(p.clamp(min=1e-12))).sum())
        return {
            "perplexity": perplexity,
            "codebook_usage": generator.codebook_usage(),
        }

    def validate(self, modules, batch: Batch) -> dict[str, torch.Tensor]:
        recon = self._frames(self.forward(modules, batch, -1)["reconstruction"]).float().clamp(-1, 1)
        mse = self._per_sample((recon - self._frames(batch.images).float()).pow(2).mean(dim=(1, 2, 3)),
                               self.frame_weights(batch))  # fmt: skip
        # Images span [-1, 1]: peak-to-peak 2, so PSNR = 10 log10(4 / MSE).
        return {"mse": mse, "psnr": 10 * torch.log10(4.0 / mse.clamp(min=1e-10))}

    def previews(self, modules, ctx: PreviewContext) -> dict[str, torch.Tensor]:
        """input | online reconstruction | EMA reconstruction of each image (or video) of a fixed held-out batch."""
        if ctx.batch is None:
            return {}
        images = ctx.batch.images[: ctx.num]
        with ctx.weights(False):
            online = modules["generator"](images)["reconstruction"]
        with ctx.weights(True):
            ema = modules["generator"](images)["reconstruction"]
        # One cell per sample: input | online | EMA side by side (a 1-pixel dark gap between them).
        gap = torch.full_like(images[..., :1], -1)
        cells = torch.cat([images, gap, online, gap, ema], dim=-1).float().clamp(-1, 1).cpu()
        return {"reconstruction": (cells + 1) / 2}

    @torch.no_grad()
    def sample(self, modules, num: int, seed: int, device: torch.device, **unused: Any) -> torch.Tensor:
        """A VQ-GAN is not a generative prior: decode uniformly random codes (shows what codes look like)."""
        side = self.ctx.image_size // self.cfg.downsample
        g = torch.Generator().manual_seed(seed)
        idx = torch.randint(0, self.cfg.num_codes, (num, side, side), generator=g).to(device)
        return ((modules["generator"].decode_indices(idx).float() + 1) / 2).cpu()


TASK = VQGANTask
