"""Per-part optimization: AdamW param groups, warmup + cosine schedule, loss scaler and EMA."""

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


def build_optimizer(module: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    t = cfg.train
    return torch.optim.AdamW(param_groups(module, t.weight_decay), lr=t.lr, betas=tuple(t.betas))


def build_lr_schedule(optimizer: torch.optim.Optimizer, cfg: Config) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over `train.warmup_steps`, then cosine decay to 0 at `train.max_steps` (or constant)."""
    name = "cosine" if cfg.train.lr_schedule == "cosine" else "constant_with_warmup"
    return get_scheduler(
        name,
        optimizer,
        num_warmup_steps=cfg.train.warmup_steps,
        num_training_steps=cfg.train.max_steps,
    )


def build_ema(module: nn.Module, cfg: Config) -> EMAModel | None:
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
    )


@dataclass
class Part:
    """One independently optimized piece of a task (a UNet, a generator, a discriminator).

    `module` is the bare model; `wrapped` is what forward passes use (the DDP
    wrapper when distributed). Each part keeps its own step counter: in a GAN
    the discriminator may step on steps where the generator does not.
    """

    name: str
    module: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: torch.optim.lr_scheduler.LRScheduler
    # One GradScaler per part: accelerate keeps a single scaler for all
    # optimizers, so an overflow in one part would skip every part's step.
    scaler: torch.amp.GradScaler
    ema: EMAModel | None
    step: int = 0

    def ema_state_dict(self) -> dict[str, torch.Tensor]:
        """The module's state dict with EMA weights in place of parameters (loadable as the model)."""
        state = dict(self.module.state_dict())
        if self.ema is not None:
            for (name, _), shadow in zip(self.module.named_parameters(), self.ema.shadow_params, strict=True):
                state[name] = shadow
        return state

    def ema_meta(self) -> dict[str, Any] | None:
        if self.ema is None:
            return None
        meta = self.ema.state_dict()
        meta.pop("shadow_params")
        return meta

    def load_ema(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        assert self.ema is not None
        params = [tensors[name] for name, _ in self.module.named_parameters()]
        self.ema.load_state_dict({**meta, "shadow_params": params})
        device = next(self.module.parameters()).device
        self.ema.to(device)
