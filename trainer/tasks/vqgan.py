"""VQ-GAN task (`task: vqgan`): a convolutional VQ autoencoder trained with a PatchGAN (Esser et al. 2021).

Parts: `generator` (diffusers' VAE Encoder/Decoder blocks around a quantizer
from vector-quantize-pytorch: classic VQ with an EMA codebook, FSQ or LFQ) and
`discriminator` (a PatchGAN with its own optimizer, schedule, scaler and
clipping via `optim.discriminator.*`).

One generator forward per chunk; the generator phase calls the discriminator
bare with gradients off (so DDP all-reduces nothing for it and sees no unused
parameters); the discriminator phase runs from `model.disc_start_step` on the
detached reconstructions. Only the generator has an EMA.

MaskGIT uses the trained generator as a frozen tokenizer (`frozen_kind`
"image-tokenizer") through `VQAutoencoder.encode_indices` / `decode_indices`
(trainer/models/vqgan.py) and `tokenizer_geometry(config)`. The training
skeleton (trainer/tasks/base_gan.py), the quantizers (`trainer.models.quantize`)
and the GAN machinery (`trainer.models.gan`: discriminator, losses computed per
frame and averaged over each sample's real frames) are shared with the video
tokenizer (`video_tokenizer.py`), which trains like this task.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.models.export import vq_model
from trainer.models.quantize import tokenizer_geometry
from trainer.models.vqgan import VQAutoencoder, VQGANConfig
from trainer.tasks.base import Export, TaskContext
from trainer.tasks.base_gan import QuantizedGANTask, check_downsample
from trainer.tasks.sampling import SampleRequest

__all__ = ["VQAutoencoder", "VQGANConfig", "VQGANTask", "tokenizer_geometry"]


class VQGANTask(QuantizedGANTask):
    ModelConfig = VQGANConfig
    cfg: VQGANConfig

    def __init__(self, model_cfg: VQGANConfig, ctx: TaskContext):
        check_downsample(ctx, model_cfg.downsample)
        super().__init__(model_cfg, ctx)

    def build_generator(self) -> nn.Module:
        return VQAutoencoder(self.cfg, self.ctx.channels)

    def export(self, modules, sample, class_names: list[str] | None = None) -> Export:
        """The generator as a diffusers VQModel in `vqvae/` (`trainer.models.export.vq_model`: vq and lfq
        codebooks; fsq is refused), no pipeline: a VQ-GAN is a component (LDMPipeline's `vqvae`), not a sampler."""
        generator = modules["generator"]
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
