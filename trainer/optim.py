"""Per-part optimization: settings (train.* overridden by optim.<part>.*), AdamW groups, schedule, EMA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers.optimization import get_scheduler
from diffusers.training_utils import EMAModel
from torch import nn

from trainer.config import Config


def param_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: no weight decay on biases and normalization weights (1-D params)."""
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@dataclass(frozen=True)
class OptimSettings:
    """One part's optimizer settings: `train.*`, overridden by `optim.<part>.*`."""

    lr: float
    betas: tuple[float, float]
    weight_decay: float
    eps: float
    warmup_steps: int
    lr_schedule: str
    lr_num_cycles: int
    lr_power: float
    max_grad_norm: float | None
    max_steps: int

    @classmethod
    def for_part(cls, cfg: Config, part: str | None = None) -> OptimSettings:
        t = cfg.train
        o = cfg.optim.get(part) if part else None

        def pick(name: str, default: Any) -> Any:
            value = getattr(o, name) if o is not None else None
            return default if value is None else value

        return cls(
            lr=pick("lr", t.lr),
            betas=tuple(pick("betas", t.betas)),
            weight_decay=pick("weight_decay", t.weight_decay),
            eps=pick("eps", 1e-8),
            warmup_steps=pick("warmup_steps", t.warmup_steps),
            lr_schedule=pick("lr_schedule", t.lr_schedule),
            lr_num_cycles=pick("lr_num_cycles", t.lr_num_cycles),
            lr_power=pick("lr_power", t.lr_power),
            max_grad_norm=pick("max_grad_norm", t.max_grad_norm),
            max_steps=pick("max_steps", t.max_steps),
        )


def build_optimizer(module: nn.Module, cfg: Config, part: str | None = None) -> torch.optim.Optimizer:
    """AdamW, fused where torch has the kernel (CPU, CUDA): build it after the module is on its device.

    Why fused: torch only defaults to its multi-tensor path on CUDA, and on CPU
    the default per-parameter loop took 61 ms per step for the 0.65M-parameter
    digits UNet, the foreach path 25 ms and the fused kernel 2 ms. Each element
    is updated independently, so the result does not depend on the thread count.
    """
    s = OptimSettings.for_part(cfg, part)
    first = next(module.parameters(), None)
    fused = True if first is not None and first.device.type in ("cpu", "cuda") else None
    return torch.optim.AdamW(param_groups(module, s.weight_decay), lr=s.lr, betas=s.betas, eps=s.eps, fused=fused)


def build_lr_schedule(
    optimizer: torch.optim.Optimizer, cfg: Config, part: str | None = None
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over `warmup_steps`, then diffusers' schedule `lr_schedule` to the part's max steps:
    cosine (to 0), constant, linear (to 0), cosine_with_restarts (`lr_num_cycles` hard restarts),
    polynomial (`lr_power`, to diffusers' lr_end 1e-7). A LambdaLR: its state is the step count, so a resumed schedule continues exactly."""
    s = OptimSettings.for_part(cfg, part)
    name = "constant_with_warmup" if s.lr_schedule in ("constant", "constant_with_warmup") else s.lr_schedule
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=s.warmup_steps,
        num_training_steps=s.max_steps,
        num_cycles=s.lr_num_cycles,
        power=s.lr_power,
    )


def build_ema(module: nn.Module, cfg: Config) -> EMAModel | None:
    """diffusers' EMAModel with its multi-tensor update (one kernel per op for all parameters, not one per tensor)."""
    e = cfg.ema
    if not e.enabled:
        return None
    return EMAModel(
        module.parameters(),
        decay=e.decay,
        min_decay=e.min_decay,
        update_after_step=e.update_after_step,
        use_ema_warmup=e.warmup,
        inv_gamma=e.inv_gamma,
        power=e.power,
        foreach=True,
    )
