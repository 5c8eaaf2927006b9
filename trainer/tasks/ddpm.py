"""DDPM task (`task: ddpm`): diffusers UNet2DModel + DDPMScheduler, epsilon or v targets, min-SNR weighting, CFG."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, UNet2DModel
from diffusers.training_utils import compute_snr
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from trainer.errors import ConfigError
from trainer.models.finetune import FinetuneFields, prepare_unet
from trainer.randomness import (
    per_sample_rand,
    per_sample_randint,
    per_sample_randn,
    sample_generators,
)
from trainer.tasks.base import Batch, Loss, Phase, StepInfo, Task, TaskContext


class UNetShapeConfig(BaseModel):
    """The UNet's shape; shared by DDPM and every cascade stage."""

    model_config = ConfigDict(extra="forbid")

    block_out_channels: list[int] = Field(default=[32, 64, 64], min_length=1)
    layers_per_block: int = Field(1, ge=1)
    attention: bool = Field(True, description="self-attention in the lowest-resolution blocks")
    norm_num_groups: int = Field(8, ge=1)
    dropout: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _groups_divide_channels(self) -> UNetShapeConfig:
        bad = [c for c in self.block_out_channels if c % self.norm_num_groups]
        if bad:
            raise ValueError(
                f"model.block_out_channels {self.block_out_channels}: every entry must be divisible "
                f"by model.norm_num_groups={self.norm_num_groups} (GroupNorm)"
            )
        return self


class NoiseConfig(UNetShapeConfig, FinetuneFields):
    """The UNet plus its noise schedule and objective, and where its weights start (`pretrained`, `lora`);
    shared by DDPM and every cascade stage."""

    prediction_type: Literal["epsilon", "v_prediction"] = "epsilon"
    num_train_timesteps: int = Field(1000, ge=2)
    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "squaredcos_cap_v2"
    snr_gamma: float | None = Field(5.0, gt=0, description="min-SNR-gamma weighting; null = off")


class DiffusionModelConfig(NoiseConfig):
    num_classes: int | None = Field(None, ge=2, description="class-conditional when set")
    cond_drop_prob: float = Field(0.1, ge=0, lt=1, description="label dropout for CFG")


def noise_scheduler_for(c: NoiseConfig, prediction_type: str | None = None) -> DDPMScheduler:
    """The training noise schedule of a DDPM-style model (diffusers' DDPMScheduler)."""
    return DDPMScheduler(
        num_train_timesteps=c.num_train_timesteps,
        beta_schedule=c.beta_schedule,
        prediction_type=prediction_type or c.prediction_type,
    )


def inference_scheduler(noise_scheduler: DDPMScheduler, kind: str):
    """A sampler (`sample.scheduler`: ddim | dpm) with the training schedule's settings."""
    cls = {"ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler}[kind]
    return cls.from_config(noise_scheduler.config)


def unet_block_types(c: UNetShapeConfig, attn_down: str = "AttnDownBlock2D", attn_up: str = "AttnUpBlock2D"):
    """(down, up) block types: plain blocks, attention in the lowest resolution when `attention`."""
    n = len(c.block_out_channels)
    down = ["DownBlock2D"] * n
    up = ["UpBlock2D"] * n
    if c.attention and n > 1:
        down[-1] = attn_down
        up[0] = attn_up
    return tuple(down), tuple(up)


def architecture_hints(prefix: str) -> dict[str, str]:
    """diffusers UNet config fields -> the gentrain keys that set them (for pretrained-folder mismatches)."""
    return {
        "block_out_channels": f"{prefix}.block_out_channels",
        "layers_per_block": f"{prefix}.layers_per_block",
        "norm_num_groups": f"{prefix}.norm_num_groups",
        "down_block_types": f"{prefix}.attention and {prefix}.block_out_channels",
        "up_block_types": f"{prefix}.attention and {prefix}.block_out_channels",
        "in_channels": "data.channels",
        "out_channels": "data.channels",
        "num_class_embeds": "model.num_classes (the UNet has one more row: the null class)",
    }


def diffusion_loss(
    noise_scheduler: DDPMScheduler, c: NoiseConfig, pred: torch.Tensor, target: torch.Tensor, t: torch.Tensor
) -> Loss:
    """Per-sample MSE, min-SNR weighted when `snr_gamma` is set; the unweighted MSE is logged."""
    mse = F.mse_loss(pred.float(), target.float(), reduction="none").mean(dim=tuple(range(1, pred.ndim)))
    if c.snr_gamma is None:
        return Loss(mse, {"mse": mse.detach()})
    snr = compute_snr(noise_scheduler, t)
    return Loss(mse * min_snr_weights(snr, c.snr_gamma, c.prediction_type), {"mse": mse.detach()})


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Per-sample loss weights of min-SNR-gamma (Hang et al. 2023, arXiv:2303.09556).

    The weight is min(SNR, gamma) / SNR for epsilon targets and
    min(SNR, gamma) / (SNR + 1) for v targets, as in diffusers' training scripts.
    """
    clipped = torch.clamp(snr, max=gamma)
    if prediction_type == "epsilon":
        return clipped / snr
    return clipped / (snr + 1)


class DDPMTask(Task):
    """Denoising diffusion (Ho et al. 2020) with one part, `unet`."""

    ModelConfig = DiffusionModelConfig
    cfg: DiffusionModelConfig

    def __init__(self, model_cfg: DiffusionModelConfig, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        c = self.cfg
        self.image_size = ctx.image_size
        self.channels = ctx.channels
        if c.num_classes and ctx.num_classes and c.num_classes != ctx.num_classes:
            raise ConfigError(f"model.num_classes={c.num_classes} but the dataset has {ctx.num_classes} classes")
        self.noise_scheduler = noise_scheduler_for(c)
        self._inputs: dict[str, dict] = {}

    @classmethod
    def trainable_part_names(cls, model_cfg: DiffusionModelConfig) -> list[str]:
        return ["unet"]

    @property
    def conditional(self) -> bool:
        return self.cfg.num_classes is not None

    def build(self, frozen) -> dict[str, nn.Module]:
        c = self.cfg
        down, up = unet_block_types(c)
        unet = UNet2DModel(
            sample_size=self.image_size,
            in_channels=self.channels,
            out_channels=self.channels,
            block_out_channels=tuple(c.block_out_channels),
            layers_per_block=c.layers_per_block,
            down_block_types=down,
            up_block_types=up,
            norm_num_groups=c.norm_num_groups,
            dropout=c.dropout,
            # One extra embedding row is the "no label" class used for CFG.
            num_class_embeds=(c.num_classes + 1) if self.conditional else None,
        )
        folder = prepare_unet(
            unet, c, "model", architecture_hints("model"), self.ctx.storage_options, self.ctx.load_pretrained
        )
        if folder is not None:
            self._inputs["unet.pretrained"] = folder.record
        return {"unet": unet}

    def inputs(self) -> dict[str, dict]:
        return dict(self._inputs)

    def export_unets(self, modules) -> dict[str, tuple[nn.Module, dict[str, torch.Tensor]]]:
        return {"unet": (modules["unet"], {})}

    def _null_label(self) -> int:
        assert self.cfg.num_classes is not None
        return self.cfg.num_classes

    def loss(self, phase: Phase, modules: Mapping[str, nn.Module], batch: Batch, outputs, info: StepInfo) -> Loss:
        x0 = batch.images
        device = x0.device
        gens = sample_generators(self.seed, info.step, batch.positions)
        noise = per_sample_randn(gens, x0.shape[1:]).to(device, x0.dtype)
        t = per_sample_randint(gens, self.noise_scheduler.config.num_train_timesteps).to(device)
        labels = None
        if self.conditional:
            drop = per_sample_rand(gens).to(device) < self.cfg.cond_drop_prob
            labels = torch.where(drop | (batch.labels < 0), self._null_label(), batch.labels)

        noisy = self.noise_scheduler.add_noise(x0, noise, t)
        if self.cfg.prediction_type == "epsilon":
            target = noise
        else:
            target = self.noise_scheduler.get_velocity(x0, noise, t)
        pred = modules["unet"](noisy, t, class_labels=labels).sample
        return diffusion_loss(self.noise_scheduler, self.cfg, pred, target, t)

    def inference_scheduler(self, kind: str):
        return inference_scheduler(self.noise_scheduler, kind)

    @torch.no_grad()
    def sample(
        self,
        modules: Mapping[str, nn.Module],
        num: int,
        seed: int,
        device: torch.device,
        inference_steps: int = 50,
        scheduler: str = "ddim",
        guidance_scale: float = 1.0,
        labels: torch.Tensor | None = None,
        **unused: Any,
    ) -> torch.Tensor:
        asked = [k for k in ("prompts", "image_embeds", "stop_at_stage", "frames") if unused.get(k) is not None]
        if asked or (labels is not None and not self.conditional):
            what = ", ".join(asked) or "labels (--class)"
            raise ConfigError(
                f"this DDPM model takes no {what}: it is {'class-conditional' if self.conditional else 'unconditional'}"
            )
        unet = modules["unet"]
        sched = self.inference_scheduler(scheduler)
        sched.set_timesteps(inference_steps)
        g = torch.Generator().manual_seed(seed)
        shape = (num, self.channels, self.image_size, self.image_size)
        x = torch.randn(shape, generator=g).to(device) * sched.init_noise_sigma
        if self.conditional and labels is None:
            labels = torch.arange(num) % self.cfg.num_classes
        use_cfg = self.conditional and guidance_scale != 1.0
        if labels is not None:
            labels = labels.to(device)
            null = torch.full_like(labels, self._null_label())
        for t in sched.timesteps:
            model_in = sched.scale_model_input(x, t)
            if use_cfg:
                both = unet(torch.cat([model_in, model_in]), t, class_labels=torch.cat([labels, null])).sample
                cond, uncond = both.chunk(2)
                out = uncond + guidance_scale * (cond - uncond)
            else:
                out = unet(model_in, t, class_labels=labels).sample
            x = sched.step(out, t, x).prev_sample
        return ((x.float().clamp(-1, 1) + 1) / 2).cpu()


TASK = DDPMTask
