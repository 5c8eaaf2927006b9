"""The EMA of a part's weights: diffusers' `EMAModel`, same update, same state, without importing peft.

diffusers keeps `EMAModel` in `diffusers.training_utils`, which imports peft (and with it transformers'
model code, scipy and torchao) and diffusers' pipelines whenever they are installed: about 2 CPU seconds
of every process's start, for a class that is twenty lines of arithmetic. This is that class, kept to
what gentrain uses, with the same `state_dict` (checkpoints store it: trainer.json's `ema`), the same
`load_state_dict` checks (trainer/checkpoint/validity.py builds one to vet a stored state) and the same
update: the decay schedule of `get_decay` and the multi-tensor `foreach` step, so shadow weights match
diffusers' bit for bit (tests/test_startup.py steps both side by side).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch


class EMAModel:
    """Exponential moving average of parameters (diffusers.training_utils.EMAModel, what gentrain calls:
    no deepspeed, no store/restore/copy_to, no deprecated arguments)."""

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_ema_warmup: bool = False,
        inv_gamma: float | int = 1.0,
        power: float | int = 2 / 3,
        foreach: bool = False,
    ) -> None:
        self.shadow_params = [p.clone().detach() for p in parameters]
        self.decay = decay
        self.min_decay = min_decay
        self.update_after_step = update_after_step
        self.use_ema_warmup = use_ema_warmup
        self.inv_gamma = inv_gamma
        self.power = power
        self.optimization_step = 0
        self.cur_decay_value: float | None = None  # set in `step()`
        self.foreach = foreach

    def get_decay(self, optimization_step: int) -> float:
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:
            value = 1 - (1 + step / self.inv_gamma) ** -self.power
        else:
            value = (1 + step) / (10 + step)
        return max(min(value, self.decay), self.min_decay)

    @torch.no_grad()
    def step(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        parameters = list(parameters)
        self.optimization_step += 1
        decay = self.get_decay(self.optimization_step)
        self.cur_decay_value = decay
        one_minus_decay = 1 - decay
        if self.foreach:
            params_grad = [p for p in parameters if p.requires_grad]
            s_params_grad = [s for s, p in zip(self.shadow_params, parameters, strict=True) if p.requires_grad]
            if len(params_grad) < len(parameters):
                # Frozen weights (a LoRA part's base) are copied shard by shard: DTensor (FSDP2) has no
                # multi-tensor copy, and a copy of the local shards is the same copy.
                torch._foreach_copy_(
                    [_local(s) for s, p in zip(self.shadow_params, parameters, strict=True) if not p.requires_grad],
                    [_local(p) for p in parameters if not p.requires_grad],
                    non_blocking=True,
                )
            torch._foreach_sub_(s_params_grad, torch._foreach_sub(s_params_grad, params_grad), alpha=one_minus_decay)
        else:
            for s_param, param in zip(self.shadow_params, parameters, strict=True):
                if param.requires_grad:
                    s_param.sub_(one_minus_decay * (s_param - param))
                else:
                    s_param.copy_(param)

    def to(self, device=None, dtype=None, non_blocking: bool = False) -> None:
        self.shadow_params = [
            p.to(device=device, dtype=dtype, non_blocking=non_blocking)
            if p.is_floating_point()
            else p.to(device=device, non_blocking=non_blocking)
            for p in self.shadow_params
        ]

    def state_dict(self) -> dict:
        """The state as diffusers writes it (references to the shadow tensors, not copies)."""
        return {
            "decay": self.decay,
            "min_decay": self.min_decay,
            "optimization_step": self.optimization_step,
            "update_after_step": self.update_after_step,
            "use_ema_warmup": self.use_ema_warmup,
            "inv_gamma": self.inv_gamma,
            "power": self.power,
            "shadow_params": self.shadow_params,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """diffusers' checks, in its order and with its messages (ValueError)."""
        state_dict = copy.deepcopy(state_dict)
        checks = (
            ("decay", None, None),
            ("min_decay", float, "Invalid min_decay"),
            ("optimization_step", int, "Invalid optimization_step"),
            ("update_after_step", int, "Invalid update_after_step"),
            ("use_ema_warmup", bool, "Invalid use_ema_warmup"),
            ("inv_gamma", (float, int), "Invalid inv_gamma"),
            ("power", (float, int), "Invalid power"),
        )
        for key, kind, message in checks:
            setattr(self, key, state_dict.get(key, getattr(self, key)))
            if key == "decay":
                if self.decay < 0.0 or self.decay > 1.0:
                    raise ValueError("Decay must be between 0 and 1")
            elif not isinstance(getattr(self, key), kind):
                raise ValueError(message)
        shadow_params = state_dict.get("shadow_params", None)
        if shadow_params is not None:
            self.shadow_params = shadow_params
            if not isinstance(self.shadow_params, list):
                raise ValueError("shadow_params must be a list")
            if not all(isinstance(p, torch.Tensor) for p in self.shadow_params):
                raise ValueError("shadow_params must all be Tensors")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes reach the DTensor), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t
