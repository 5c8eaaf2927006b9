"""One optimizer step: split the rank's batch into chunks, run the task's forward once per chunk,
each phase's loss and backward, then step every part that learned.

Why the details are the way they are:
- Each phase's per-sample losses are summed and divided by the rank batch, so
  DDP's mean over ranks is the mean over the global batch however the step is
  split into accumulation and micro chunks.
- Gradient all-reduce happens on the last chunk only (`no_sync` before it).
- A part outside the current phase is called bare with `requires_grad=False`:
  no all-reduce of its gradients and no unused parameters in DDP.
- The global RNG (dropout, any library draw) is reseeded per chunk from
  (seed, step, rank, chunk), so a resumed run draws what the uninterrupted
  one drew, whatever else consumed random numbers before (data loader
  iterators, sampling, validation). Per-sample draws that must not depend on
  the world size use trainer.randomness.sample_generators instead.
- A step whose loss or gradient norm is not finite is not applied (`nonfinite_verdict`), decided
  on the device so the host never waits: one bad batch or a divergence spike costs a step, never
  the weights. TrainProgress counts these steps and stops a run that has nothing but them.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, nullcontext
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer.config import Config
from trainer.engine.parts import FrozenPart, ModuleView, Part, nonfinite
from trainer.engine.runtime import Runtime
from trainer.engine.shard import is_fsdp
from trainer.engine.throughput import StepFlops
from trainer.errors import ConfigError
from trainer.randomness import Stream, stream_seed
from trainer.tasks.base import Batch, Phase, StepInfo, Task

log = logging.getLogger(__name__)

# The key of a step's logs holding its verdict: 1.0 when the step was not applied (its loss or a gradient norm
# was not finite). The reporter hands it to TrainProgress, which counts; it is not logged as a value.
NONFINITE = "step/nonfinite"


def autocast(device: torch.device, precision: str):
    if precision == "no":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.float16 if precision == "fp16" else torch.bfloat16)


def check_batch_split(batch_size: int, world_size: int, grad_accum: int) -> int:
    """Samples per forward chunk before micro-batching; a clear error when the split is uneven."""
    if batch_size % (world_size * grad_accum):
        ok = [w for w in range(1, 65) if batch_size % (w * grad_accum) == 0]
        raise ConfigError(
            f"train.batch_size={batch_size} cannot be split evenly over world size {world_size} x "
            f"train.grad_accum={grad_accum}. The global batch stays fixed across restarts so that no "
            f"sample is seen twice; choose a batch size divisible by {world_size * grad_accum}, or run "
            f"at a world size in {ok[:12]}."
        )
    return batch_size // (world_size * grad_accum)


def reseed_global_rng(seed: int, step: int, rank: int, chunk: int) -> None:
    """Counter-based global RNG: torch (CPU and CUDA), numpy and random as a function of the position."""
    s = stream_seed(seed, Stream.STEP_GLOBAL, step, rank, chunk)
    # The generators a step can draw from: the CPU's and, on CUDA, this process's device's. Not
    # torch.manual_seed, which also walks every CUDA device and other backends (0.6 ms of host time per
    # chunk); the states it sets on the generators used here are the same.
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.default_generators[torch.cuda.current_device()].manual_seed(s)
    if chunk == 0:
        np.random.seed(s % (1 << 32))
        random.seed(s)


def detach_tree(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, Mapping):
        return {k: detach_tree(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(detach_tree(v) for v in x)
    return x


def to_device(batch: dict, s: int, e: int, device: torch.device) -> Batch:
    return Batch(
        images=batch["images"][s:e].to(device, non_blocking=True),
        labels=batch["labels"][s:e].to(device, non_blocking=True),
        indices=batch["indices"][s:e],
        positions=batch["positions"][s:e],
        valid=batch["valid"][s:e].to(device, dtype=torch.float32, non_blocking=True),
        extras={k: v[s:e].to(device, non_blocking=True) for k, v in batch.get("extras", {}).items()},
        captions=batch["captions"][s:e] if "captions" in batch else None,
    )


class StepRunner:
    """Runs the phases of one optimizer step over this rank's chunks and steps the parts."""

    def __init__(
        self,
        *,
        task: Task,
        parts: Mapping[str, Part],
        frozen: Mapping[str, FrozenPart],
        cfg: Config,
        runtime: Runtime,
        no_sync: Any,
    ):
        self.task = task
        self.parts = parts
        self.frozen = frozen
        self.cfg = cfg
        self.rank = runtime.rank
        self.world_size = world_size = runtime.world_size
        self.device = runtime.device
        self.no_sync = no_sync
        t = cfg.train
        self.chunk_size = check_batch_split(t.batch_size, world_size, t.grad_accum)
        self.rank_batch = t.batch_size // world_size
        self.micro = t.micro_batch_size or self.chunk_size
        if not task.micro_batch_invariant and self.micro < self.chunk_size:
            raise ConfigError(
                f"train.micro_batch_size={t.micro_batch_size}: task {cfg.task!r} computes a loss term from a "
                f"whole chunk's gradients (e.g. an adaptive GAN weight), so splitting chunks of {self.chunk_size} "
                "would change the update. Remove train.micro_batch_size, or lower train.batch_size / raise "
                "train.grad_accum to save memory."
            )
        self._trainable: set[str] | None = None

    def chunks(self, batch: dict, device: torch.device | None = None) -> Iterator[Batch]:
        """This rank's share of the step: accumulation chunks, each split into micro-batches."""
        n = len(batch["positions"])
        for start in range(0, n, self.chunk_size):
            stop = min(start + self.chunk_size, n)
            for s in range(start, stop, self.micro):
                yield to_device(batch, s, min(s + self.micro, stop), device or self.device)

    def _set_trainable(self, names: set[str]) -> None:
        if names == self._trainable:
            return
        for name, part in self.parts.items():
            part.set_learning(name in names)
        self._trainable = names

    def accumulate(
        self, batch: dict, step: int, phases: list[Phase], fake_on: torch.device | None = None
    ) -> dict[str, torch.Tensor]:
        """Forward and backward over every chunk; gradients end up in the parts. Returns loss sums.

        `fake_on` (`count_flops`, inside a FakeTensorMode): the same forwards, losses and backwards on shapes
        only, the chunks on that device, the parts unwrapped (no DDP hooks or collectives), no reseeding of the
        global RNG, and gradients taken with `torch.autograd.grad` so no `.grad` of a real parameter is set."""
        learning = {ph.part for ph in phases}
        if len(learning) != len(phases):
            raise RuntimeError(f"two phases optimize the same part: {phases}")
        fake = fake_on is not None
        sums: dict[str, torch.Tensor] = {}
        chunks = list(self.chunks(batch, fake_on))
        precision = self.cfg.train.precision
        for i, chunk in enumerate(chunks):
            if not fake:
                reseed_global_rng(self.cfg.seed, step, self.rank, i)
            with ExitStack() as stack:
                if not fake and i < len(chunks) - 1 and self.world_size > 1:
                    for name in learning:
                        stack.enter_context(self.no_sync(self.parts[name].wrapped))
                self._set_trainable(learning)
                with autocast(self.device, precision):
                    outputs = self.task.forward(
                        ModuleView(self.parts, self.frozen, set() if fake else learning), chunk, step
                    )
                for j, phase in enumerate(phases):
                    part = self.parts[phase.part]
                    self._set_trainable({phase.part})
                    view = ModuleView(self.parts, self.frozen, set() if fake else {phase.part})
                    shared = outputs if j == 0 else detach_tree(outputs)
                    with autocast(self.device, precision):
                        out = self.task.loss(phase, view, chunk, shared, StepInfo(step, part.step))
                        loss = (out.per_sample.float() * chunk.valid).sum() / self.rank_batch
                    if fake:
                        params = [p for p in part.params if p.requires_grad]
                        if loss.requires_grad and params:
                            torch.autograd.grad(loss, params, allow_unused=True)
                        continue
                    part.scaler.scale(loss).backward()
                    self._add(sums, f"{phase.name}/loss", loss.detach())
                    for term, value in out.terms.items():
                        value = value.detach().float()
                        share = (value * chunk.valid).sum() if value.ndim else value * chunk.valid.sum()
                        self._add(sums, f"{phase.name}/{term}", share / self.rank_batch)
        self._set_trainable(set(self.parts))
        return sums

    @staticmethod
    def _add(sums: dict[str, torch.Tensor], key: str, value: torch.Tensor) -> None:
        sums[key] = sums[key] + value if key in sums else value

    def count_flops(self, batch: dict, step: int) -> int | None:
        """The FLOPs of the step `run(batch, step)` would take: `accumulate` itself, run on fake tensors (torch's
        FakeTensorMode), so nothing is computed or allocated and no weight, gradient, buffer or random state
        changes. A compiled run's peak memory is then its compiled step's, not an eager step's. None where shapes
        alone cannot say (sharded parts gather over the process group; a task that reads a value back, e.g. to
        tokenize captions): the caller then counts the real first step."""
        if any(is_fsdp(p.module) for p in self.parts.values()) or any(is_fsdp(f.module) for f in self.frozen.values()):
            return None
        phases = [ph for ph in self.task.phases(step, {n: p.step for n, p in self.parts.items()})]
        phases = [ph for ph in phases if self.parts[ph.part].learns_now()]
        if not phases:
            return 0
        counter = StepFlops()
        # Fake tensors insist on one device object: the parameters' (accelerate names the CPU `cpu:0` under
        # several processes, which real tensors treat as `cpu`; a library that then moves a table it keeps
        # to the input's device would keep a fake copy).
        params = [p for part in self.parts.values() for p in part.module.parameters()]
        device = params[0].device if params else self.device
        try:
            with FakeTensorMode(allow_non_fake_inputs=True), torch.compiler.set_stance("force_eager"), counter:
                self.accumulate(batch, step, phases, fake_on=device)
        except Exception as e:  # noqa: BLE001 - any op shapes cannot run: count the real step instead
            log.info("throughput: FLOPs not countable on fake tensors (%s); counting the first step", type(e).__name__)
            return None
        finally:
            self._set_trainable(set(self.parts))
        return counter.total

    def run(self, batch: dict, step: int) -> dict[str, torch.Tensor]:
        """One optimizer step of every part the task trains now; returns this rank's logs as 0-d tensors on
        the device. Nothing here waits for the device: the reporter reads the values at its cadence.
        `logs[NONFINITE]` is 1.0 when the step was not applied (`nonfinite_verdict`).

        Phases of parts this run does not train (outside `train.stages`) or that reached their own
        `optim.<part>.max_steps` are dropped: those parts are not touched at all."""
        phases = self.task.phases(step, {n: p.step for n, p in self.parts.items()})
        phases = [ph for ph in phases if self.parts[ph.part].learns_now()]
        if not phases:
            return {}
        for phase in phases:
            self.parts[phase.part].optimizer.zero_grad(set_to_none=True)
        logs = self.accumulate(batch, step, phases)
        for phase in phases:
            logs[f"{phase.name}/grad_norm"] = self.parts[phase.part].clip_gradients()
        skip = self.nonfinite_verdict(logs, phases)
        for phase in phases:
            self.parts[phase.part].apply_step(skip)
        logs[NONFINITE] = skip
        return logs

    def nonfinite_verdict(self, logs: Mapping[str, torch.Tensor], phases: list[Phase]) -> torch.Tensor:
        """1.0 (float32, on the device) when this step must not be applied: a phase's loss or a part's gradient
        norm is inf or NaN. One verdict for the whole step, so no part takes a step its partner skipped.

        Decided on the device; the host never waits for it (the reporter reads it later, see
        TrainProgress.post_verdict). The norms are the same on every rank (DDP all-reduces the gradients,
        FSDP the norm); a loss is this rank's, so under several processes the verdict is all-reduced (max,
        one scalar): every rank skips the same steps and the replicas never drift apart."""
        values = [logs[f"{ph.name}/loss"] for ph in phases] + [logs[f"{ph.name}/grad_norm"] for ph in phases]
        skip = nonfinite(*(v.to(self.device, non_blocking=True) for v in values))
        if self.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(skip, op=dist.ReduceOp.MAX)
        return skip
