"""Classifier-free guidance (Ho & Salimans 2022) and the class-label helpers every conditional task shares.

One guided prediction runs the network once on the conditional and the unconditional inputs stacked
along the batch (conditional first) and mixes the halves as uncond + scale * (cond - uncond). The null
class of a class-conditional model is the extra embedding row `num_classes`; a sample whose condition
is dropped in training, or that has no label (-1), gets it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from trainer.errors import ConfigError

Tensor = torch.Tensor


def cfg_batch(cond: Mapping[str, Tensor], uncond: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The conditions of a guided batch: each of `cond`'s entries, then the same entry of `uncond`. An entry
    `uncond` lacks is one guidance does not drop (a super-resolution stage's low-resolution image): both
    halves get `cond`'s."""
    return {k: torch.cat([cond[k], uncond[k] if k in uncond else cond[k]]) for k in cond}


def guide(cond: Tensor, uncond: Tensor, scale: float) -> Tensor:
    """The guided prediction uncond + scale * (cond - uncond) (scale 1: cond; larger: further from uncond).
    The one formula of every guided task, for outputs from one batched forward or from two."""
    return uncond + scale * (cond - uncond)


def cfg_combine(out: Tensor, scale: float) -> Tensor:
    """Mix the output of a `cfg_batch` forward: `guide` of its conditional and unconditional halves."""
    cond, uncond = out.chunk(2)
    return guide(cond, uncond, scale)


@dataclass(frozen=True)
class Guidance:
    """What a sampler conditions on: `cond`, and `uncond` plus `scale` for classifier-free guidance (off
    when `uncond` is None or `scale` is 1: one plain forward per step)."""

    cond: Mapping[str, Tensor]
    uncond: Mapping[str, Tensor] | None = None
    scale: float = 1.0

    @property
    def active(self) -> bool:
        return self.uncond is not None and self.scale != 1.0

    def predictor(self, net_fn: Callable[[Tensor, Tensor, Mapping[str, Tensor]], Tensor]):
        """`(x, t) -> output` of `net_fn(x, t, cond)`, guided when `active`."""
        if not self.active:
            cond = self.cond
            return lambda x, t: net_fn(x, t, cond)
        both, scale = cfg_batch(self.cond, self.uncond), self.scale
        return lambda x, t: cfg_combine(net_fn(torch.cat([x, x]), t, both), scale)


def default_labels(num: int, num_classes: int) -> Tensor:
    """The classes of a grid sampled without --class: 0, 1, ..., num_classes - 1, 0, 1, ..."""
    return torch.arange(num) % num_classes


def labels_or_null(labels: Tensor, drop: Tensor, num_classes: int) -> Tensor:
    """`labels` with the null class (`num_classes`) where `drop` is set or the sample has no label (< 0)."""
    return torch.where(drop | (labels < 0), num_classes, labels)


def check_num_classes(model_classes: int | None, data_classes: int | None) -> None:
    """Refuse a class-conditional model whose `model.num_classes` differs from the dataset's class count."""
    if model_classes and data_classes and model_classes != data_classes:
        raise ConfigError(f"model.num_classes={model_classes} but the dataset has {data_classes} classes")
