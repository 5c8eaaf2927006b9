"""The Task interface the training loop drives; tasks never touch devices, precision or checkpoints."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from pydantic import BaseModel
from torch import nn


@dataclass
class Batch:
    """One chunk of a step's batch on the training device.

    `positions` are the samples' places in the step's *global* batch; tasks key
    their per-sample randomness by them (see trainer.randomness).
    """

    images: torch.Tensor  # (N, C, H, W) in [-1, 1]
    labels: torch.Tensor  # (N,) int64; -1 when unlabelled
    indices: torch.Tensor  # (N,) dataset indices
    positions: list[int]
    valid: torch.Tensor | None = None  # (N,) 1.0 for loaded samples, 0.0 for unreadable ones


class Task:
    """A generative model made of named parts.

    Subclasses set `ModelConfig` (the pydantic schema of `model.*`) and
    implement `build_parts`, `loss` and `sample`. Each part gets its own
    optimizer, LR schedule, loss scaler, EMA and step counter from the loop;
    `parts_to_step` says which parts take an optimizer step at a given step
    (all of them for DDPM; alternating generator/discriminator for a GAN).
    """

    ModelConfig: ClassVar[type[BaseModel]]

    def __init__(self, model_cfg: Mapping[str, Any], image_size: int, channels: int, seed: int):
        self.cfg = self.ModelConfig.model_validate(dict(model_cfg))
        self.image_size = image_size
        self.channels = channels
        self.seed = seed

    def build_parts(self) -> dict[str, nn.Module]:
        raise NotImplementedError

    def parts_to_step(self, step: int) -> list[str]:
        return list(self.part_names)

    @property
    def part_names(self) -> list[str]:
        raise NotImplementedError

    def loss(
        self, part: str, modules: Mapping[str, nn.Module], batch: Batch, step: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-sample losses (N,) for `part`, plus named per-sample terms to log."""
        raise NotImplementedError

    @torch.no_grad()
    def sample(
        self, modules: Mapping[str, nn.Module], num: int, seed: int, device: torch.device, **kwargs: Any
    ) -> torch.Tensor:
        """`num` images in [0, 1], shape (num, C, H, W), on CPU."""
        raise NotImplementedError
