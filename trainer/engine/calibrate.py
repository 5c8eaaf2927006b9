"""Calibration: what a task measures of its weights on a fixed sample of training images before each save.

An autoencoder's latent scaling factor (1 / std of its latents) belongs with the weights it was measured
on: the task keeps it in a buffer of its part, so the checkpoint saves it with them, a resume restores it
exactly and a later run that loads those weights reads it. Every process measures the same images with
the same weights (the first `task.calibration_size()` training images, by dataset index, with the EMA
weights where a part keeps them), so every process holds the same value and no collective is needed;
under FSDP each process takes part in every forward, as the sharded weights require.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import torch

from trainer.data import collate, validation_refs
from trainer.engine.parts import FrozenPart, Part, bare_modules, ema_swapped, eval_mode
from trainer.engine.step import to_device
from trainer.tasks.base import Batch, Task

if TYPE_CHECKING:
    from trainer.engine.runtime import Runtime


class Calibrator:
    """Runs `task.calibrate` before every checkpoint save (`checkpoint.every_steps` and the final one)."""

    def __init__(
        self,
        task: Task,
        parts: Mapping[str, Part],
        frozen: Mapping[str, FrozenPart],
        train_set,
        *,
        runtime: Runtime,
        every_steps: int,
        chunk_size: int,
    ):
        self.task = task
        self.parts = parts
        self.modules = bare_modules(parts, frozen)
        self.train_set = train_set
        self.device = runtime.device
        self.every_steps = every_steps
        self.chunk_size = max(1, chunk_size)
        wanted = task.calibration_size()
        self.size = min(wanted, len(train_set)) if wanted and train_set is not None else 0

    @property
    def enabled(self) -> bool:
        return self.size > 0

    def maybe_run(self, step: int) -> bool:
        """Measure when a checkpoint is due at `step` (the same rule as the checkpoint manager's)."""
        if not self.enabled or not self.every_steps or step % self.every_steps:
            return False
        self.run()
        return True

    def batches(self) -> Iterator[Batch]:
        """The fixed sample in chunks: the first `size` training images, positions 0..size-1."""
        for refs in validation_refs(self.train_set, self.chunk_size, -(-self.size // self.chunk_size), 0, 1):
            refs = [r for r in refs if r.index < self.size]
            yield to_device(collate([self.train_set[r] for r in refs]), 0, len(refs), self.device)

    @torch.no_grad()
    def run(self) -> None:
        if not self.enabled:
            return
        with ema_swapped(self.parts), eval_mode(self.modules):
            self.task.calibrate(self.modules, self.batches())
