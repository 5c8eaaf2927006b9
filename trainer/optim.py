"""Per-part optimization: settings (train.* overridden by optim.<part>.*), AdamW groups, schedule, EMA.

Two optimizers (`train.optimizer`, `optim.<part>.name`): torch's fused AdamW, and torchao's AdamW8bit, which
keeps both running averages block-quantized to 8 bits (codes plus one float32 scale per 256 values), about
a quarter of AdamW's float32 state. torchao rather than bitsandbytes: torchao's low-bit optimizers are plain
PyTorch whose step is compiled by torch.compile, so they run on CPU as well as CUDA (here they train on the
CPU-only build machines and on an H100) and their state is a tensor subclass that also steps inside FSDP2's
DTensors (tried here; gentrain still refuses adamw8bit under fsdp, see trainer/config/schema.py);
bitsandbytes' 8-bit optimizers step through its own native kernels, and its install guide (0.46-0.48)
lists them for NVIDIA GPUs, other backends (CPU among them) being work in progress.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.optimization import get_scheduler
from torch import nn

from trainer.checkpoint.quantized import plain_tensors
from trainer.config import Config
from trainer.ema import EMAModel
from trainer.errors import ConfigError

OPTIMIZERS = ("adamw", "adamw8bit")


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
    optimizer: str = "adamw"

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
            optimizer=pick("name", t.optimizer),
        )


def build_optimizer(module: nn.Module, cfg: Config, part: str | None = None) -> torch.optim.Optimizer:
    """The part's optimizer (`optim.<part>.name`, default `train.optimizer`): build it after the module is on
    its device. adamw8bit: torchao's AdamW8bit (see the module docstring); adamw: torch's AdamW, fused where
    torch has the kernel (CPU, CUDA).

    Why fused: torch only defaults to its multi-tensor path on CUDA, and on CPU
    the default per-parameter loop took 61 ms per step for the 0.65M-parameter
    digits UNet, the foreach path 25 ms and the fused kernel 2 ms. Each element
    is updated independently, so the result does not depend on the thread count.
    """
    s = OptimSettings.for_part(cfg, part)
    if s.optimizer == "adamw8bit":
        return adamw8bit_class()(param_groups(module, s.weight_decay), lr=s.lr, betas=s.betas, eps=s.eps)
    if s.optimizer != "adamw":  # the schema allows only OPTIMIZERS; a typed Config built by hand may not
        raise ConfigError(f"unknown optimizer {s.optimizer!r} (known: {', '.join(OPTIMIZERS)})")
    first = next(module.parameters(), None)
    fused = True if first is not None and first.device.type in ("cpu", "cuda") else None
    return torch.optim.AdamW(param_groups(module, s.weight_decay), lr=s.lr, betas=s.betas, eps=s.eps, fused=fused)


def adamw8bit_class() -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit, imported on first use (the `lowbit` extra); ConfigError naming the extra if absent.

    Its step compiles one small graph per distinct parameter shape with torch.compile the first time (one CPU
    thread, cold cache: 55 s for DiT-S/2, 136 s for a 17M-parameter UNet; 5-9 s from inductor's on-disk cache
    in later processes), then reuses them; torch's caching warning about the state subclass (no `_stable_hash_for_caching`)
    is filtered here. Its import noise is filtered in `trainer/__init__.py`.
    """
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise ConfigError(
            f"train.optimizer=adamw8bit (or optim.<part>.name=adamw8bit) needs torchao: "
            f"pip install 'gentrain[lowbit]' ({e})"
        ) from None
    warnings.filterwarnings("ignore", message=".*does not implement _stable_hash_for_caching.*")
    return AdamW8bit


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`optimizer.step()`, leaving every parameter and state tensor as it was where `skip` (a float32 0-d tensor
    on the device, 1.0 = skip) says so: decided on the device, the host never reads `skip`.

    torch's fused Adam and AdamW take it as `found_inf`, the way the fp16 GradScaler hands its overflow flag over:
    the kernel returns before touching anything and the step counts are taken back. Other optimizers (torchao's
    AdamW8bit, AdamW off CPU and CUDA) have no such input: they step on gradients zeroed where `skip` is set (no
    NaN reaches a state built in this step), and every parameter and state tensor they had is then put back by
    `torch.where`. That keeps a copy of the parameters and state during the step. Limit: a state tensor on
    another device than `skip` (torchao keeps its step count on the host) is not put back: a skipped step
    advances torchao's bias correction by one.
    """
    if isinstance(optimizer, torch.optim.Adam) and all(g.get("fused") for g in optimizer.param_groups):
        optimizer.found_inf = skip  # read by torch.optim.Adam.step (what torch.amp.GradScaler.step sets)
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        return
    skipped = skip.bool()
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    with torch.no_grad():
        for p in params:
            grad = _local(p.grad)
            grad.copy_(torch.where(skipped, torch.zeros((), dtype=grad.dtype, device=grad.device), grad))
        held = [_local(p) for p in params]
        for p in params:
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor):
                    held += [_local(t) for t in plain_tensors(v)]
        held = [t for t in held if t.device == skip.device]
        saved = [t.clone() for t in held]
    optimizer.step()
    with torch.no_grad():
        for t, before in zip(held, saved, strict=True):
            t.copy_(torch.where(skipped, before, t))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what `torch.where` with a plain flag can take); plain tensors as they are."""
    return t.to_local() if hasattr(t, "to_local") else t


def build_lr_schedule(
    optimizer: torch.optim.Optimizer, cfg: Config, part: str | None = None
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup over `warmup_steps`, then diffusers' schedule `lr_schedule` to the part's max steps:
    cosine (to 0), constant, linear (to 0), cosine_with_restarts (`lr_num_cycles` hard restarts),
    polynomial (`lr_power`, to diffusers' lr_end 1e-7). A LambdaLR: its state is the step count, so a resumed schedule continues exactly."""
    s = OptimSettings.for_part(cfg, part)
    name = "constant_with_warmup" if s.lr_schedule in ("constant", "constant_with_warmup") else s.lr_schedule
    schedule = get_scheduler(
        name,
        optimizer,
        num_warmup_steps=s.warmup_steps,
        num_training_steps=s.max_steps,
        num_cycles=s.lr_num_cycles,
        power=s.lr_power,
    )
    # torchao keeps each group's lr as a float32 tensor (its compiled step reads it without recompiling), so
    # torch's scheduler took tensor base lrs and would compute each lr in float32; a checkpoint stores them
    # as JSON numbers, and a resumed schedule would compute in float64 and round once. Plain floats from the
    # start give every run the same lr bits (torch fills the tensor with the rounded value either way).
    schedule.base_lrs = [float(lr) for lr in schedule.base_lrs]
    return schedule


def build_ema(module: nn.Module, cfg: Config) -> EMAModel | None:
    """diffusers' EMAModel (trainer/ema.py) with its multi-tensor update (one kernel per op for all parameters)."""
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


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state as it is held (an 8-bit state: its codes, block scales and
    code map; under FSDP2: this rank's shards). What bench/memory.py reports and tests compare."""
    total = 0
    for per_param in optimizer.state.values():
        for v in per_param.values():
            if isinstance(v, torch.Tensor):
                local = v.to_local() if hasattr(v, "to_local") else v
                total += sum(t.numel() * t.element_size() for t in plain_tensors(local))
    return total
