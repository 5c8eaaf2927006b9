"""The skeleton the GAN autoencoder tasks share (`autoencoder`, `vqgan`, `video-tokenizer`): not a task itself.

Parts: `generator` (the task's autoencoder, `build_generator`) and `discriminator` (the PatchGAN of
`trainer.models.gan`, with its own optimizer, schedule, scaler and clipping via `optim.discriminator.*`); only
the generator has an EMA. One generator forward per chunk (`forward`); the generator phase calls the
discriminator bare with gradients off (so DDP all-reduces nothing for it and sees no unused parameters); the
discriminator phase runs from `model.disc_start_step` on the detached reconstructions (hinge, LeCAM, gradient
penalty). The generator's loss is the reconstruction terms (L1, L2, optional VGG perceptual), the task's own
regularizer (`generator_total`: KL, commitment) and, from `model.disc_start_step`, `model.adv_weight` x
Esser et al.'s adaptive weight x the hinge adversarial term.

Losses and metrics are computed per frame and averaged over each sample's real frames (`frame_weights`,
trainer.models.gan), so a video tokenizer (N, T, C, H, W) with padding frames shares them; an image is one
frame of weight 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from pydantic import BaseModel
from torch import nn

from trainer.errors import ConfigError
from trainer.models.gan import AdversarialLosses, PatchDiscriminator, frames, per_sample
from trainer.models.perceptual import VGGPerceptual
from trainer.models.quantize import QuantizedAutoencoder
from trainer.tasks.base import Batch, Loss, Phase, PreviewContext, StepInfo, Task, TaskContext, bare


def check_downsample(ctx: TaskContext, downsample: int) -> None:
    """The images must tile into the autoencoder's latent grid (exit 2 otherwise)."""
    if ctx.image_size % downsample:
        raise ConfigError(
            f"data.image_size={ctx.image_size} is not divisible by the autoencoder's downsampling factor "
            f"{downsample} (2 ** (len(model.block_out_channels) - 1))"
        )


class GANAutoencoderTask(Task):
    """An autoencoder `generator` trained with a PatchGAN `discriminator` (see the module doc)."""

    # The adaptive weight comes from a whole chunk's gradients: micro-batching would change it.
    micro_batch_invariant = False

    def __init__(self, model_cfg: BaseModel, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        perceptual = None
        if model_cfg.perceptual is not None and model_cfg.perceptual.weight > 0:
            perceptual = VGGPerceptual.from_url(model_cfg.perceptual.url, ctx.storage_options)
        self.losses = AdversarialLosses(model_cfg, perceptual)

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

    @classmethod
    def trainable_part_names(cls, model_cfg: BaseModel) -> list[str]:
        return ["generator", "discriminator"]

    @classmethod
    def ema_part_names(cls, model_cfg: BaseModel) -> list[str]:
        return ["generator"]

    def build_generator(self) -> nn.Module:
        raise NotImplementedError

    def build(self, frozen) -> dict[str, nn.Module]:
        c = self.cfg
        return {
            "generator": self.build_generator(),
            "discriminator": PatchDiscriminator(self.ctx.channels, c.disc_channels, c.disc_layers, c.lecam_decay),
        }

    def phases(self, step: int, part_steps: Mapping[str, int]) -> list[Phase]:
        phases = [Phase("generator", "generator")]
        if step >= self.cfg.disc_start_step:
            phases.append(Phase("discriminator", "discriminator"))
        return phases

    def frame_weights(self, batch: Batch) -> torch.Tensor:
        """(N, T) weight of each frame in losses and metrics: 1 for real frames, 0 for padding."""
        return torch.ones(len(batch), 1, device=batch.images.device)

    # ---- what each autoencoder adds to the generator's loss
    def generator_total(self, terms: dict[str, torch.Tensor], outputs: Mapping[str, Any]) -> torch.Tensor:
        """The generator's per-sample loss before the adversarial term: `terms["rec"]` plus its regularizer."""
        raise NotImplementedError

    def generator_terms(self, outputs: Mapping[str, Any], generator: nn.Module) -> dict[str, torch.Tensor]:
        """More terms to log for the generator phase (after the adversarial ones)."""
        return {}

    def loss(self, phase: Phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        c = self.cfg
        weights = self.frame_weights(batch)
        recon, real, valid = frames(outputs["reconstruction"]), frames(batch.images), batch.valid
        if phase.part == "generator":
            terms = {k: per_sample(v, weights) for k, v in self.losses.reconstruction(recon, real).items()}
            total = self.generator_total(terms, outputs)
            generator = bare(modules, "generator")
            if info.step >= c.disc_start_step and c.adv_weight > 0:
                adv, weight = self.losses.adversarial(
                    modules["discriminator"], recon, terms["rec"], weights, valid, generator.last_layer
                )
                total = total + weight * adv
                terms["adv"] = adv
                terms["adv_weight"] = weight.detach()
            terms.update(self.generator_terms(outputs, generator))
            return Loss(total, {k: v.detach() for k, v in terms.items()})

        # discriminator phase: reconstructions arrive detached
        every = c.grad_penalty_every
        penalize = bool(every) and info.part_step % every == 0
        total, terms = self.losses.discriminator(
            modules["discriminator"], bare(modules, "discriminator"), real, recon, weights, valid, penalize
        )
        return Loss(total, terms)

    # ---- evaluation and output
    def validation_terms(self, outputs: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Per-sample metrics beyond mse and psnr, from the validation forward's outputs."""
        return {}

    def validate(self, modules, batch: Batch) -> dict[str, torch.Tensor]:
        out = self.forward(modules, batch, -1)  # step -1: no draws in validation (the posterior mean)
        recon = frames(out["reconstruction"]).float().clamp(-1, 1)
        mse = per_sample((recon - frames(batch.images).float()).pow(2).mean(dim=(1, 2, 3)), self.frame_weights(batch))
        # Images span [-1, 1]: peak-to-peak 2, so PSNR = 10 log10(4 / MSE).
        return {"mse": mse, "psnr": 10 * torch.log10(4.0 / mse.clamp(min=1e-10)), **self.validation_terms(out)}

    @staticmethod
    def reconstruction_cells(images: torch.Tensor, *recons: torch.Tensor) -> torch.Tensor:
        """One cell per image (or video): input | reconstruction(s) side by side (a 1-pixel dark gap), in
        [0, 1] on CPU."""
        gap = torch.full_like(images[..., :1], -1)
        cells = [images]
        for r in recons:
            cells += [gap, r]
        return ((torch.cat(cells, dim=-1).float().clamp(-1, 1) + 1) / 2).cpu()

    def previews(self, modules, ctx: PreviewContext) -> dict[str, torch.Tensor]:
        """input | online | EMA reconstruction of each image (or video) of a fixed held-out batch."""
        if ctx.batch is None:
            return {}
        images = ctx.batch.images[: ctx.num]
        with ctx.weights(False):
            online = modules["generator"](images)["reconstruction"]
        with ctx.weights(True):
            ema = modules["generator"](images)["reconstruction"]
        return {"reconstruction": self.reconstruction_cells(images, online, ema)}


class QuantizedGANTask(GANAutoencoderTask):
    """A tokenizer: the generator quantizes its latents (`trainer.models.quantize`); the loss adds the
    commitment term and the quantizer's auxiliary loss, and logs the codes' perplexity and codebook usage."""

    def forward(self, modules, batch: Batch, step: int) -> dict[str, Any]:
        return modules["generator"](batch.images)

    def generator_total(self, terms: dict[str, torch.Tensor], outputs: Mapping[str, Any]) -> torch.Tensor:
        return terms["rec"] + self.cfg.commitment_weight * outputs["commitment"] + outputs["aux"]

    def generator_terms(self, outputs: Mapping[str, Any], generator: nn.Module) -> dict[str, torch.Tensor]:
        return {
            "commitment": outputs["commitment"],
            **self._code_stats(outputs["indices"], generator, outputs.get("token_mask")),
        }

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
