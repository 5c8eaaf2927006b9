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
`tokenizer_geometry(config)`. The quantizers (`trainer.models.quantize`) and
the GAN machinery (`trainer.models.gan`: discriminator, losses computed per
frame and averaged over each sample's real frames) are shared with the video
tokenizer (`video_tokenizer.py`), which trains like this task.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from diffusers.models.autoencoders.vae import Decoder, Encoder
from pydantic import ConfigDict
from torch import nn

from trainer.errors import ConfigError
from trainer.models.export import vq_model
from trainer.models.gan import (
    AdversarialConfig,
    AdversarialLosses,
    ConvAutoencoderShape,
    PatchDiscriminator,
    frames,
    per_sample,
)
from trainer.models.perceptual import VGGPerceptual
from trainer.models.quantize import CodebookConfig, QuantizedAutoencoder
from trainer.tasks.base import Batch, Export, Loss, Phase, PreviewContext, StepInfo, Task, TaskContext, bare
from trainer.tasks.sampling import SampleRequest


class VQGANConfig(ConvAutoencoderShape, CodebookConfig, AdversarialConfig):
    model_config = ConfigDict(extra="forbid")


def tokenizer_geometry(cfg: Any) -> tuple[int, int]:
    """(codebook size, latent grid side) of a VQ-GAN run's config (a trainer.config.Config)."""
    m: VQGANConfig = cfg.model_cfg
    return m.num_codes, cfg.data.image_size // m.downsample


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
        if ctx.image_size % model_cfg.downsample:
            raise ConfigError(
                f"data.image_size={ctx.image_size} is not divisible by the autoencoder's downsampling factor "
                f"{model_cfg.downsample} (2 ** (len(model.block_out_channels) - 1))"
            )
        perceptual = None
        if model_cfg.perceptual is not None and model_cfg.perceptual.weight > 0:
            perceptual = VGGPerceptual.from_url(model_cfg.perceptual.url, ctx.storage_options)
        self.losses = AdversarialLosses(model_cfg, perceptual)

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

    # Losses and metrics are computed per frame and averaged over each sample's real frames (trainer.models.gan),
    # so the video tokenizer (N, T, C, H, W) with padding frames shares them; an image is one frame of weight 1.
    def frame_weights(self, batch: Batch) -> torch.Tensor:
        """(N, T) weight of each frame in losses and metrics: 1 for real frames, 0 for padding."""
        return torch.ones(len(batch), 1, device=batch.images.device)

    def loss(self, phase: Phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        c = self.cfg
        weights = self.frame_weights(batch)
        recon, real, valid = frames(outputs["reconstruction"]), frames(batch.images), batch.valid
        if phase.part == "generator":
            terms = {k: per_sample(v, weights) for k, v in self.losses.reconstruction(recon, real).items()}
            total = terms["rec"] + c.commitment_weight * outputs["commitment"] + outputs["aux"]
            generator = bare(modules, "generator")
            if info.step >= c.disc_start_step and c.adv_weight > 0:
                adv, weight = self.losses.adversarial(
                    modules["discriminator"], recon, terms["rec"], weights, valid, generator.last_layer
                )
                total = total + weight * adv
                terms["adv"] = adv
                terms["adv_weight"] = weight.detach()
            terms["commitment"] = outputs["commitment"]
            terms.update(self._code_stats(outputs["indices"], generator, outputs.get("token_mask")))
            return Loss(total, {k: v.detach() for k, v in terms.items()})

        # discriminator phase: reconstructions arrive detached
        total, terms = self.losses.discriminator(
            modules["discriminator"], bare(modules, "discriminator"), real, recon, weights, valid, self._penalize(info)
        )
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
        recon = frames(self.forward(modules, batch, -1)["reconstruction"]).float().clamp(-1, 1)
        mse = per_sample((recon - frames(batch.images).float()).pow(2).mean(dim=(1, 2, 3)), self.frame_weights(batch))
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

    def export(self, modules, sample, class_names: list[str] | None = None) -> Export:
        """The generator as a diffusers VQModel in `vqvae/` (`trainer.models.export.vq_model`: vq and lfq
        codebooks; fsq is refused), no pipeline: a VQ-GAN is a component (LDMPipeline's `vqvae`), not a sampler."""
        generator = modules["generator"]
        if not isinstance(generator, VQAutoencoder):
            raise ConfigError(
                f"a {type(generator).__name__} (a video tokenizer) has no diffusers model to export: diffusers' "
                "VQModel is a 2D image autoencoder"
            )
        c, channels, size = self.cfg, self.ctx.channels, self.ctx.image_size
        side = size // c.downsample
        usage = f"""import torch
from diffusers import VQModel

vqvae = VQModel.from_pretrained("path/to/this/folder", subfolder="vqvae").eval()
images = torch.rand(4, {channels}, {size}, {size}) * 2 - 1  # images in [-1, 1]
with torch.no_grad():
    latents = vqvae.encode(images).latents  # before quantization
    reconstructions = vqvae.decode(latents).sample  # quantized to the nearest codes, then decoded
    codes = vqvae.quantize(latents)[2][2].view(4, {side}, {side})  # gentrain's code indices (a MaskGIT's tokens)
"""
        notes = [
            f"`vqvae/`: the `generator`'s {c.quantizer} quantizer as diffusers' VectorQuantizer, {c.num_codes} codes "
            f"of {c.latent_channels} channels (`quantize.embedding.weight`), latents {c.latent_channels}x{side}x{side}",
            "the discriminator is not exported (it only trains the generator)",
        ]
        if c.quantizer == "lfq":
            notes.append(
                "lfq: the codebook is every corner of {-1, 1}^d in LFQ's index order; the corner nearest to a latent "
                "is its channel-wise sign, what LFQ picks"
            )
        return Export(
            models={"vqvae": (vq_model(generator, channels, size), {})},
            parts={"vqvae": "generator"},
            reason="a VQ-GAN is an autoencoder, not a sampler: its VQModel is a pipeline component (LDMPipeline's vqvae)",
            usage=usage,
            notes=notes,
        )

    @torch.no_grad()
    def sample(self, modules, request: SampleRequest, device: torch.device) -> torch.Tensor:
        """A VQ-GAN is not a generative prior: decode uniformly random codes (shows what codes look like)."""
        side = self.ctx.image_size // self.cfg.downsample
        g = torch.Generator().manual_seed(request.seed)
        idx = torch.randint(0, self.cfg.num_codes, (request.num, side, side), generator=g).to(device)
        return ((modules["generator"].decode_indices(idx).float() + 1) / 2).cpu()


TASK = VQGANTask
