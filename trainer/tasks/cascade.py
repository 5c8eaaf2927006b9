"""Imagen-style cascade (`task: cascade`): diffusion stages at increasing resolutions, one part each.

Stage 1 generates at the lowest resolution; stage k > 1 is a super-resolution
model conditioned on the image of stage k-1, upsampled and noised with
Imagen's noise-conditioning augmentation (Saharia et al. 2022, arXiv:2205.11487,
section 2.5): the augmentation level is drawn per sample in training and fixed
at sampling, and the stage is told the level. Every stage is its own part
(`stage1`, `stage2`, ...) with its own optimizer, schedule, scaler, EMA, step
counter and `optim.stageK.max_steps`; `train.stages` picks the stages a run
trains, the engine leaves the others untouched.

Conditioning, all with classifier-free guidance (one dropout draw per sample
drops every condition together; the guidance scale mixes at sampling):
class labels (`model.num_classes`), captions embedded by a frozen sentence
encoder (`model.text`: pooled vector added to the time embedding, token
vectors as cross-attention context) and image embeddings
(`model.image_embed_dim`, the DALL-E 2 decoder: added to the time embedding
and as `image_embed_tokens` extra context tokens), read from the data or
computed from each training image by a frozen `model.image_encoder`
(trainer/conditioning/image.py).

Objectives per stage come from the diffusion core (trainer/diffusion/objectives.py):
epsilon / v (DDPM noise schedule, min-SNR weighting, optional DREAM for
epsilon), rectified flow (`prediction_type: flow`, SD3's timestep densities
and loss weights, a flow-matching Euler sampler), or the elucidated
preconditioning (`prediction_type: edm`, Karras et al. 2022, as
imagen-pytorch's ElucidatedImagen), all from diffusers' own functions; so do
classifier-free guidance and the class-label helpers (trainer/conditioning/guidance.py). The stage networks
and their configs are the core's too (trainer/diffusion/stages.py): which backbones a stage may be, and how
they are conditioned, each backbone declares.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.schedulers.scheduling_ddpm import DDPMScheduler
from torch import nn

from trainer.conditioning.image import ImageEncoder
from trainer.conditioning.text import TextEncoder
from trainer.diffusion import (
    Guidance,
    build_objective,
    check_num_classes,
    default_labels,
    labels_or_null,
)
from trainer.diffusion.backbones import UNetBackbone
from trainer.diffusion.stages import CascadeConfig, StageConfig, StageNet, TransformerStageNet, stage_hints
from trainer.errors import ConfigError
from trainer.models.finetune import EXTRAS_NAME, InputRecord, load_weights, prepare_unet
from trainer.randomness import Stream, per_sample_randn, sample_draws, sample_generators
from trainer.tasks.base import Batch, Export, Loss, Phase, PreviewContext, StepInfo, Task, TaskContext
from trainer.tasks.sampling import SampleRequest

__all__ = ["CascadeConfig", "CascadeTask", "StageConfig", "resize"]

log = logging.getLogger(__name__)

_AUG_TIMESTEPS = 1000  # the noise-augmentation schedule (cosine), shared by all stages


def resize(images: torch.Tensor, size: int) -> torch.Tensor:
    """Down by area averaging (anti-aliased for integer factors), up bilinearly."""
    if images.shape[-1] == size:
        return images
    if images.shape[-1] > size:
        return F.interpolate(images, size=(size, size), mode="area")
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)


def _net(net: nn.Module):
    """A stage's network as the core calls one: (x, t, conditions) -> output."""
    return lambda x, t, cond: net(x, t, cond).sample


class CascadeTask(Task):
    """A cascade of diffusion stages; parts `stage1` ... `stageN` (see module doc)."""

    ModelConfig = CascadeConfig
    cfg: CascadeConfig

    def __init__(self, model_cfg: CascadeConfig, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        c = self.cfg
        n = len(c.stages)
        if c.stages[-1].image_size > ctx.image_size:
            raise ConfigError(
                f"model.stages[{n - 1}].image_size={c.stages[-1].image_size} is larger than data.image_size="
                f"{ctx.image_size}; the last stage trains on the data's images: set data.image_size="
                f"{c.stages[-1].image_size}"
            )
        check_num_classes(c.num_classes, ctx.num_classes)
        if ctx.stages is not None:
            bad = [k for k in ctx.stages if not 1 <= k <= n]
            if bad or len(set(ctx.stages)) != len(ctx.stages):
                raise ConfigError(
                    f"train.stages={ctx.stages}: stages are numbered 1..{n} (model.stages has {n}), each at most "
                    "once; e.g. train.stages=[2] trains only the second stage"
                )
        self.channels = ctx.channels
        self.objectives = [build_objective(s) for s in c.stages]
        self.aug_scheduler = DDPMScheduler(num_train_timesteps=_AUG_TIMESTEPS, beta_schedule="squaredcos_cap_v2")
        self.text = TextEncoder(c.text, ctx.storage_options) if c.text is not None else None
        self._inputs: dict[str, InputRecord] = {}
        self.image_encoder = None
        if c.image_encoder is not None:
            self.image_encoder = ImageEncoder(c.image_encoder)
            if c.image_embed_dim != self.image_encoder.dim:
                raise ConfigError(
                    f"model.image_encoder={c.image_encoder} gives {self.image_encoder.dim}-wide embeddings: set "
                    f"model.image_embed_dim={self.image_encoder.dim} (it is {c.image_embed_dim})"
                )

    # ---- parts
    @classmethod
    def trainable_part_names(cls, model_cfg: CascadeConfig) -> list[str]:
        return [f"stage{k}" for k in range(1, len(model_cfg.stages) + 1)]

    @classmethod
    def sampling_refusal(cls, model_cfg: CascadeConfig, inference_steps: int, scheduler: str) -> str | None:
        for i, stage in enumerate(model_cfg.stages):  # every stage samples with the same settings
            refusal = build_objective(stage).sampler_refusal(inference_steps, scheduler)
            if refusal is not None:
                return f"model.stages[{i}]: {refusal}"
        return None

    def learning_parts(self) -> list[str]:
        stages = self.ctx.stages or range(1, len(self.cfg.stages) + 1)
        return [f"stage{k}" for k in sorted(stages)]

    def build(self, frozen) -> dict[str, nn.Module]:
        nets = {}
        for k, s in enumerate(self.cfg.stages, 1):
            if s.backbone is not None:
                nets[f"stage{k}"] = TransformerStageNet(s, self.cfg, self.channels, lowres=k > 1)
                continue
            net = nets[f"stage{k}"] = StageNet(s, self.cfg, self.channels, lowres=k > 1)
            key = f"model.stages[{k - 1}]"
            folder = prepare_unet(
                net.unet,
                s,
                key,
                stage_hints(key),
                self.ctx.storage_options,
                self.ctx.load_pretrained,
                UNetBackbone.lora_targets,  # a stage's UNet is a UNet backbone's model, shaped by the stage's keys
            )
            if folder is None:
                continue
            # LoRA: checkpoints hold the adapters only, the base is this folder's: pinned (a changed one is exit 2).
            self._inputs[f"stage{k}.pretrained"] = folder.record.pinned(s.lora is not None)
            if folder.extras is not None:
                load_weights(
                    net,
                    folder.extras,
                    f"{key}.pretrained={s.pretrained!r}",
                    f"the layers of {EXTRAS_NAME}",
                    skip="unet.",
                )
            if s.lora is not None:
                # LoRA trains the adapters only; the stage's conditioning layers stay trainable when the
                # folder had none to give (a plain diffusers UNet): new layers cannot stay random.
                for name, p in net.named_parameters():
                    if not name.startswith("unet."):
                        p.requires_grad_(folder.extras is None)
        return nets

    def inputs(self) -> dict[str, InputRecord]:
        out = dict(self._inputs)
        if self.text is not None:
            out["text_encoder"] = InputRecord(source=self.cfg.text.source, digest=self.text.digest, pin=True)
        if self.image_encoder is not None:
            enc = self.image_encoder
            out["image_encoder"] = InputRecord(source=enc.name, digest=enc.digest, pin=True)
        return out

    def export_unets(self, modules) -> dict[str, tuple[nn.Module, dict[str, torch.Tensor]]]:
        """Each stage's diffusers UNet plus its gentrain conditioning layers (for `checkpoints export`)."""
        transformers = [name for name, net in modules.items() if isinstance(net, TransformerStageNet)]
        if transformers:
            raise ConfigError(
                f"{', '.join(transformers)} of this cascade {'is' if len(transformers) == 1 else 'are'} a transformer "
                "backbone, not a diffusers UNet: nothing to export as UNets"
            )
        return {
            name: (net.unet, {k: v for k, v in net.state_dict().items() if not k.startswith("unet.")})
            for name, net in modules.items()
        }

    def export(self, modules, sample, class_names: list[str] | None = None) -> Export:
        """Each stage's UNet folder (as `export_unets`), no pipeline: no diffusers pipeline chains gentrain stages."""
        return Export(
            models=self.export_unets(modules),
            reason=(
                "each stage is a diffusers UNet2DConditionModel plus gentrain's conditioning layers (low-resolution "
                "image, augmentation level, labels, text, embeddings; gentrain_conditioning.safetensors beside its "
                "weights), which no diffusers pipeline runs: the stages are exported one folder each"
            ),
        )

    def phases(self, step: int, part_steps: Mapping[str, int]) -> list[Phase]:
        return [Phase(name, name) for name in self.learning_parts()]

    # ---- conditions
    def conditions(
        self,
        n: int,
        device: torch.device,
        drop: torch.Tensor,
        labels: torch.Tensor | None = None,
        captions: list[str] | None = None,
        image_embed: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The model's condition tensors; samples with `drop` set get the null condition of each kind."""
        c = self.cfg
        drop = drop.to(device)
        cond: dict[str, torch.Tensor] = {}
        if c.num_classes:
            if labels is None:
                labels = torch.full((n,), -1, dtype=torch.long)
            cond["labels"] = labels_or_null(labels.to(device), drop, c.num_classes)
        if self.text is not None:
            if captions is None:
                raise ConfigError(
                    "model.text is set but the data has no captions: put a .txt beside each image (or use "
                    "shards with a txt field), or remove model.text"
                )
            emb = self.text.encode(["" if d else cap for cap, d in zip(captions, drop.tolist(), strict=True)], device)
            cond.update(text_tokens=emb.tokens, text_mask=emb.mask, text_pooled=emb.pooled)
        if c.image_embed_dim is not None:
            if image_embed is None:
                raise ConfigError(
                    "model.image_embed_dim is set but the data has no image embeddings: put a .npy beside each "
                    "image (or use shards with an image_embed field), or remove model.image_embed_dim"
                )
            if image_embed.shape[-1] != c.image_embed_dim:
                raise ConfigError(
                    f"image embeddings are {image_embed.shape[-1]}-wide but model.image_embed_dim={c.image_embed_dim}"
                )
            e = image_embed.to(device, torch.float32).reshape(n, -1)
            cond["image_embed"] = e * (~drop).float()[:, None]
        return cond

    def image_embeds(self, batch: Batch) -> torch.Tensor | None:
        """The batch's image embeddings: from the data, else computed by `model.image_encoder`."""
        given = batch.extras.get("image_embed")
        if given is None and self.image_encoder is not None:
            return self.image_encoder.encode(batch.images)
        return given

    @property
    def conditional(self) -> bool:
        c = self.cfg
        return bool(c.num_classes) or c.text is not None or c.image_embed_dim is not None

    def _lowres(self, k: int, images: torch.Tensor, aug_t: torch.Tensor, aug_noise: torch.Tensor) -> torch.Tensor:
        """Stage k's condition: the stage k-1 image upsampled, then noised to level `aug_t`."""
        up = resize(images, self.cfg.stages[k - 1].image_size)
        return self.aug_scheduler.add_noise(up, aug_noise.to(up.device, up.dtype), aug_t.to(up.device))

    # ---- training
    def stage_loss(self, k: int, net: nn.Module, batch: Batch, step: int) -> Loss:
        s = self.cfg.stages[k - 1]
        x0 = resize(batch.images, s.image_size)
        n, device = x0.shape[0], x0.device
        # Per sample: its noise, its noise level (the objective's draw), its condition dropout, then (stage > 1)
        # its augmentation level and augmentation noise.
        draws = sample_draws(self.seed, step, batch.positions, Stream.CASCADE_STAGE, substream=k, device=device)
        noise = draws.randn(x0.shape[1:]).to(x0.dtype)
        objective = self.objectives[k - 1]
        draw = objective.draw(draws, n, device, x0.dtype)
        drop = draws.rand() < self.cfg.cond_drop_prob
        cond = self.conditions(n, device, drop, batch.labels, batch.captions, self.image_embeds(batch))
        if k > 1:
            level = draws.rand() * s.noise_aug_max
            aug_t = (level * _AUG_TIMESTEPS).long().clamp(max=_AUG_TIMESTEPS - 1)
            low = resize(batch.images, self.cfg.stages[k - 2].image_size)
            cond["lowres"] = self._lowres(k, low, aug_t, draws.randn((low.shape[1], s.image_size, s.image_size)))
            cond["aug_t"] = aug_t.to(device)
        return objective.loss(_net(net), x0, noise, draw, cond)

    def loss(self, phase: Phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        k = int(phase.part.removeprefix("stage"))
        return self.stage_loss(k, modules[phase.part], batch, info.step)

    def validate(self, modules, batch: Batch) -> dict[str, torch.Tensor]:
        return {
            f"stage{k}_loss": self.stage_loss(k, modules[f"stage{k}"], batch, -1).per_sample
            for k in range(1, len(self.cfg.stages) + 1)
        }

    # ---- sampling
    def previews(self, modules, ctx: PreviewContext) -> dict[str, torch.Tensor]:
        """`samples`: the cascade up to the last stage trained so far; `superres-stageK`: stage K on the
        held-out batch's own low-resolution images (shows a stage trained before the ones below it)."""
        steps = ctx.part_steps
        trained = [
            k
            for k in range(1, len(self.cfg.stages) + 1)
            if steps.get(f"stage{k}", 1) > 0 or self.cfg.stages[k - 1].pretrained is not None
        ]
        out: dict[str, torch.Tensor] = {}
        b = ctx.batch
        with ctx.preferred_weights():
            upto = 0
            while upto + 1 in trained:
                upto += 1
            if upto:
                captions = ctx.held_out_prompts() if self.text is not None else None  # or sample.prompts' row
                has_embeds = self.cfg.image_embed_dim is not None and b is not None
                embeds = self.image_embeds(b) if has_embeds else None
                if embeds is not None:
                    embeds = embeds.repeat((ctx.num + len(embeds) - 1) // len(embeds), 1)[: ctx.num]
                request = ctx.request(stop_at_stage=upto, prompts=captions, image_embeds=embeds)
                out["samples"] = self.sample(modules, request, ctx.device)
            for k in (k for k in trained if k > 1 and b is not None):
                low = resize(b.images, self.cfg.stages[k - 2].image_size)
                cond = self.conditions(
                    len(b),
                    ctx.device,
                    torch.zeros(len(b), dtype=torch.bool),
                    b.labels,
                    b.captions,
                    self.image_embeds(b),
                )
                x = self._run_stage(k, modules[f"stage{k}"], low, cond, range(len(b)), ctx.request(), ctx.device)
                out[f"superres-stage{k}"] = ((x.float().clamp(-1, 1) + 1) / 2).cpu()
        return out

    def _uncond(self, cond: Mapping[str, torch.Tensor], n: int, device) -> dict[str, torch.Tensor]:
        null = self.conditions(
            n,
            device,
            torch.ones(n, dtype=torch.bool),
            None,
            [""] * n if self.text is not None else None,
            cond["image_embed"] if "image_embed" in cond else None,
        )
        return null

    def _run_stage(
        self,
        k: int,
        net: nn.Module,
        low: torch.Tensor | None,
        cond: dict[str, torch.Tensor],
        positions: range,
        request: SampleRequest,
        device: torch.device,
    ) -> torch.Tensor:
        """Denoise stage k for the samples at `positions` of the grid with the request's sampler settings;
        noise is drawn per sample (seed, position), so chunking a large grid into batches does not change
        which noise a sample gets."""
        s = self.cfg.stages[k - 1]
        n = len(positions)
        guidance_scale = request.option("guidance_scale", 1.0)
        gens = sample_generators(request.seed, 0, positions, Stream.CASCADE_STAGE, substream=k)
        x = per_sample_randn(gens, (self.channels, s.image_size, s.image_size)).to(device)
        cond = dict(cond)
        if low is not None:
            aug_t = torch.full((n,), round(s.noise_aug_sample * (_AUG_TIMESTEPS - 1)), dtype=torch.long)
            aug_noise = per_sample_randn(gens, (self.channels, s.image_size, s.image_size))
            cond["lowres"] = self._lowres(k, low.to(device), aug_t, aug_noise)
            cond["aug_t"] = aug_t.to(device)
        uncond = None
        if self.conditional and guidance_scale != 1.0:
            uncond = self._uncond(cond, n, device)  # lacks lowres and aug_t: both halves get the same ones
        guidance = Guidance(cond, uncond, guidance_scale)
        steps, scheduler = request.option("inference_steps", 50), request.option("scheduler", "ddim")
        return self.objectives[k - 1].denoise(_net(net), x, steps, scheduler, guidance, request.check_between_steps)

    def sample_accepts(self) -> frozenset[str]:
        c = self.cfg
        conditions = {
            "labels": bool(c.num_classes),
            "prompts": self.text is not None,
            "image_embeds": c.image_embed_dim is not None,
        }
        guided = {"guidance_scale"} if self.conditional else set()
        return frozenset(
            {"inference_steps", "scheduler", "stop_at_stage", "batch_size", *guided}
            | {k for k, on in conditions.items() if on}
        )

    @torch.no_grad()
    def sample(self, modules: Mapping[str, nn.Module], request: SampleRequest, device: torch.device) -> torch.Tensor:
        """Run stages 1..`stop_at_stage` (default all); refuses stages that were never trained."""
        num, labels, prompts, image_embeds = request.num, request.labels, request.prompts, request.image_embeds
        stop_at_stage, part_steps = request.stop_at_stage, request.part_steps
        n_stages = len(self.cfg.stages)
        last = stop_at_stage or n_stages
        if not 1 <= last <= n_stages:
            raise ConfigError(f"--stop-at-stage {stop_at_stage}: this cascade has stages 1..{n_stages}")
        untrained = [
            k
            for k in range(1, last + 1)
            if part_steps is not None
            and part_steps.get(f"stage{k}", 0) == 0
            and self.cfg.stages[k - 1].pretrained is None
        ]
        if untrained:
            names = ", ".join(f"stage {k}" for k in untrained)
            raise ConfigError(
                f"{names} of this checkpoint {'was' if len(untrained) == 1 else 'were'} never trained (step 0) and "
                f"would only produce noise. Train {'it' if len(untrained) == 1 else 'them'} (train.stages="
                f"{untrained}), or sample fewer stages with --stop-at-stage {untrained[0] - 1 or 1}."
            )
        c = self.cfg
        if labels is not None and ((labels < 0) | (labels >= c.num_classes)).any():
            raise ConfigError(f"--class must be in 0..{c.num_classes - 1}")
        if labels is None and c.num_classes:
            labels = default_labels(num, c.num_classes)
        if labels is not None:
            labels = torch.as_tensor(labels).long().expand(num) if torch.as_tensor(labels).ndim == 0 else labels
        if self.text is not None and prompts is None:
            log.warning("text-conditioned cascade sampled without a prompt: unconditional samples")
            prompts = [""] * num
        if prompts is not None and len(prompts) != num:
            prompts = (list(prompts) * num)[:num]
        embeds = None
        if image_embeds is not None:
            embeds = torch.as_tensor(np.asarray(image_embeds), dtype=torch.float32)
            embeds = embeds.reshape(-1, embeds.shape[-1])
            embeds = embeds.repeat((num + len(embeds) - 1) // len(embeds), 1)[:num]
        chunk = request.batch_size or num
        images = None
        for k in range(1, last + 1):
            outs = []
            for start in range(0, num, chunk):
                sl = slice(start, min(start + chunk, num))
                m = sl.stop - sl.start
                cond = self.conditions(
                    m,
                    device,
                    torch.zeros(m, dtype=torch.bool),
                    labels[sl] if labels is not None else None,
                    prompts[sl] if prompts is not None else None,
                    embeds[sl] if embeds is not None else None,
                )
                low = images[sl] if images is not None else None
                net = modules[f"stage{k}"]
                outs.append(self._run_stage(k, net, low, cond, range(sl.start, sl.stop), request, device))
            images = torch.cat(outs)
        if self.text is not None:
            log.info(self.text.usage())
        return ((images.float().clamp(-1, 1) + 1) / 2).cpu()


TASK = CascadeTask
