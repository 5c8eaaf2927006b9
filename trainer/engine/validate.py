"""Validation: the task's named metrics over a fixed held-out set, shared by all ranks."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.data import collate, validation_refs
from trainer.elastic import StopRequest, StopRequested, gather_objects
from trainer.engine.parts import FrozenPart, Part, bare_modules, eval_mode
from trainer.engine.step import autocast, reseed_global_rng, to_device
from trainer.tasks.base import Task

if TYPE_CHECKING:
    from trainer.engine.runtime import Runtime

log = logging.getLogger("gentrain")

_VAL_CHUNK = 1 << 30  # validation draws use their own chunk index: never a training chunk's


class Validator:
    """Runs `task.validate` every `train.val_every_steps` and at the end; reports named means.

    Each metric is summed over valid samples and counted on every rank, then
    all-reduced, so the result is the mean over the whole validation set
    whatever the world size (up to float summation order).

    With `stop` (the run's StopRequest) a stop request cuts validation short
    between batches (`StopRequested`, nothing reported), on every rank together:
    each rank checks its own flag between its batches, and all agree before the
    all-reduce (under FSDP every check is an agreement: the forwards are collective).
    """

    def __init__(
        self,
        task: Task,
        parts: Mapping[str, Part],
        frozen: Mapping[str, FrozenPart],
        val_set,
        *,
        runtime: Runtime,
        every_steps: int,
        batches: int,
        chunk_size: int,
        report: Callable[[int, dict[str, float]], None],
        stop: StopRequest | None = None,
    ):
        self.task = task
        self.modules = bare_modules(parts, frozen)
        self.val_set = val_set
        self.every_steps = every_steps
        self.batches = batches
        self.chunk_size = max(1, chunk_size)
        self.precision = runtime.precision
        self.seed = runtime.seed
        self.rank = runtime.rank
        self.world_size = runtime.world_size
        self.device = runtime.device
        self.report = report
        # Sharded parts: every rank must run the same number of forwards (each one gathers parameters).
        self.collective = runtime.sharded
        self.stop = stop

    @property
    def enabled(self) -> bool:
        return self.val_set is not None and self.every_steps > 0

    def maybe_run(self, step: int, last: bool = False) -> dict[str, float] | None:
        if not self.enabled or (not last and step % self.every_steps):
            return None
        return self.run(step)

    @torch.no_grad()
    def run(self, step: int) -> dict[str, float]:
        refs = validation_refs(self.val_set, self.chunk_size, self.batches, self.rank, self.world_size)
        if self.collective:
            most = len(validation_refs(self.val_set, self.chunk_size, self.batches, 0, self.world_size))
            # Padding chunks repeat a sample with weight 0: forwards in step with the other ranks, no effect.
            refs = [(g, True) for g in refs] + [(refs[0] if refs else [_first_ref(self.val_set)], False)] * (
                most - len(refs)
            )
        else:
            refs = [(g, True) for g in refs]
        sums: dict[str, torch.Tensor] = {}
        count = torch.zeros((), dtype=torch.float64, device=self.device)
        reseed_global_rng(self.seed, step, self.rank, _VAL_CHUNK)
        check = None
        if self.stop is not None:
            check = self.stop.checker(f"validation at step {step}", self.device, collective=self.collective)
        with eval_mode(self.modules):
            try:
                for group, counts in refs:
                    if check is not None:
                        check()
                    chunk = to_device(collate([self.val_set[r] for r in group]), 0, len(group), self.device)
                    if not counts:
                        chunk.valid = torch.zeros_like(chunk.valid)
                    with autocast(self.device, self.precision):
                        metrics = self.task.validate(self.modules, chunk)
                    for name, per_sample in metrics.items():
                        value = (per_sample.double() * chunk.valid).sum()
                        sums[name] = sums[name] + value if name in sums else value
                    count += chunk.valid.sum()
            except StopRequested as cut:
                if cut.agreed:
                    raise
        if check is not None and not self.collective:
            check.agree()  # a rank that stopped early must not leave the others in the all-reduce below
        names = sorted(sums)
        # Ranks without validation samples still take part in the all-reduce with zeros.
        names = _agree_on_names(names, self.world_size)
        total = torch.stack(
            [sums.get(n, torch.zeros((), dtype=torch.float64, device=self.device)) for n in names] + [count]
        )
        if self.world_size > 1:
            dist.all_reduce(total)
        n = float(total[-1].clamp(min=1))
        values = {f"val/{name}": float(total[i]) / n for i, name in enumerate(names)}
        self.report(step, values)
        return values


def _first_ref(val_set):
    return validation_refs(val_set, 1, 1, 0, 1)[0][0]


def _agree_on_names(names: list[str], world_size: int) -> list[str]:
    if world_size == 1:
        return names
    return sorted({n for rank_names in gather_objects(names) for n in rank_names})
