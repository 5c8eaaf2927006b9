"""Training progress: the global step, the data position, the skipped samples and the steps not applied (their
loss or gradient norm was not finite), saved with every checkpoint."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainer.engine.goodput import TimeLedger, parse_record
from trainer.errors import ConfigError
from trainer.randomness import CURRENT_STREAM, STREAM_PER_SAMPLE_CPU, STREAMS, set_stream_version

# The skip limit acts only from this many skipped samples on: fewer cannot tell a data set that is
# mostly unreadable from a healthy one that met a bad file or two early (one bad file in the first
# batch of 8 is 12% of what was consumed). With a true bad rate of half the limit, 32 skips where
# about 16 are expected is a 1-in-10,000 chance, so a run under its limit is practically never
# stopped; a data set that is all unreadable is stopped after 32 samples of nothing.
MIN_SKIPPED_TO_STOP = 32
# How many skipped files (the first ones, each with its reason) are remembered and named in the stop message.
MAX_SKIPPED_FILES = 5
# Of a streak of non-finite steps, the first this many and then every this many-th are logged one by one.
_NONFINITE_LOG_FIRST = 3
_NONFINITE_LOG_EVERY = 100
# A tracker run id as W&B and MLflow write them (hex, letters, digits, - and _); the checkpoint is not trusted.
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


class TrainProgress:
    """Step count, global data cursor (samples consumed) and skipped-sample count, all over every rank.

    The cursor is the whole data position (see trainer.data.sampler): it moves
    only when an optimizer step completes, so prefetched batches never count.
    `skipped_samples` counts the samples of the whole job that could not be
    read (every rank adds the same total: see `job_skips`), and
    `skipped_files` keeps the first few of them with their reasons, so the
    stop message still names them after a resume.

    `max_skipped_fraction` (`data.max_skipped_fraction`) stops a run training
    on nothing: see `check_skipped`.

    `nonfinite_steps` counts the steps that were not applied because their
    loss or a gradient norm was inf or NaN (trainer.engine.step), and
    `nonfinite_streak` those in a row up to the newest step read, the first
    of them `nonfinite_first`: `max_nonfinite_steps` in a row stop the run
    (`check_nonfinite`). Each step's verdict stays on the device until it is
    read (`post_verdict`, `settle_verdicts`): at the reporter's reads, every
    `max_nonfinite_steps` steps, and before a checkpoint saves the counts.
    """

    def __init__(
        self,
        batch_size: int,
        epoch_size: int,
        world_size: int,
        seed: int,
        order: Mapping[str, Any] | None = None,
        max_skipped_fraction: float = 1.0,
        max_nonfinite_steps: int = 8,
    ):
        self.batch_size = batch_size
        # The config keys the sample order is a function of (besides the cursor): a resume under other
        # values would continue another order mid-epoch, repeating and skipping samples.
        self.order = dict(order or {"seed": seed})
        self.epoch_size = epoch_size
        self.world_size = world_size
        self.seed = seed
        self.max_skipped_fraction = max_skipped_fraction
        self.step = 0
        self.cursor = 0
        self.skipped_samples = 0
        self.skipped_files: list[str] = []
        self.max_nonfinite_steps = max_nonfinite_steps
        self.nonfinite_steps = 0
        self.nonfinite_streak = 0
        self.nonfinite_first: int | None = None
        self._verdicts: list[tuple[int, torch.Tensor]] = []  # (step, 0-d flag on the device), not yet read
        # (step, how many in a row there) of the steps found non-finite, not yet reported (see `take_nonfinite`)
        self._nonfinite_news: list[tuple[int, int]] = []
        self.saved_world_size: int | None = None
        self.saved_time: float | None = None
        # The tracker runs this run logs into (W&B and MLflow run ids, see Reporter.start_trackers).
        self.trackers: dict[str, str] = {}
        # FLOPs of one sample's training step, counted on a run's first step (trainer.engine.throughput): a
        # resumed process takes it from here instead of counting again, so a compiled run's resumed steps stay
        # compiled (counting runs a step eagerly) and every step of a run reports against one count.
        self.flops_per_sample: float | None = None
        # The per-sample draw stream (trainer.randomness): a fresh run takes the current one, a resumed run
        # the one its checkpoint was trained on, so it draws what the uninterrupted run would have.
        self.rng_stream = CURRENT_STREAM
        set_stream_version(self.rng_stream)
        # The run's time accounting (trainer.engine.goodput): saved as the ledger's record at each save, and
        # the record of the checkpoint resumed from, which the ledger continues.
        self.ledger: TimeLedger | None = None
        self.saved_goodput: dict[str, Any] | None = None

    @property
    def epoch(self) -> int:
        return self.cursor // self.epoch_size

    @property
    def wants_skipped_files(self) -> bool:
        """Whether the names of newly skipped samples are still worth gathering (the list is not full)."""
        return len(self.skipped_files) < MAX_SKIPPED_FILES

    def advance(self, skipped: int = 0, skipped_files: Sequence[str] = ()) -> None:
        """One optimizer step done (its skips, when known now: see `add_skipped`)."""
        self.step += 1
        self.cursor += self.batch_size
        self.add_skipped(skipped, skipped_files)

    def add_skipped(self, skipped: int, skipped_files: Sequence[str] = ()) -> None:
        """`skipped` samples of one of the job's steps were unreadable (`skipped_files` why); see JobAgreement."""
        self.skipped_samples += skipped
        for name in skipped_files:
            if self.wants_skipped_files and name not in self.skipped_files:
                self.skipped_files.append(name)

    def check_skipped(self) -> None:
        """Stop (ConfigError: exit 2, never retried) when the run is training on unreadable data.

        The rule: more than `max_skipped_fraction` of the samples consumed so
        far (`cursor`, since the first step, across resumes) were skipped, and
        at least `MIN_SKIPPED_TO_STOP` were (too few to tell bad data from bad
        luck otherwise). 0 stops at the first skipped sample; 1 never stops.
        Every rank holds the same counts, so every rank stops at the same step.
        """
        limit = self.max_skipped_fraction
        if self.skipped_samples <= limit * self.cursor:
            return
        if limit > 0 and self.skipped_samples < MIN_SKIPPED_TO_STOP:
            return
        first = "; ".join(self.skipped_files) or "(not recorded)"
        raise ConfigError(
            f"data.max_skipped_fraction={limit}: {self.skipped_samples} of the {self.cursor} samples consumed by "
            f"step {self.step} ({self.skipped_samples / max(self.cursor, 1):.1%}) could not be read, more than the "
            f"limit allows, so the run is training on little or nothing; the first unreadable ones: {first}. Fix "
            "or remove those files and resume, or raise data.max_skipped_fraction (1 = never stop)"
        )

    # ---- steps not applied (non-finite loss or gradient norm)
    def post_verdict(self, step: int, flag: torch.Tensor) -> None:
        """Step `step`'s verdict (1.0: not applied), a tensor on the device, kept unread until `settle_verdicts`.
        Every `max_nonfinite_steps` steps the older ones are read (on CUDA all but this step's, which the device
        may still be computing: the host then waits for work queued before this step, never for this step)."""
        self._verdicts.append((step, flag.detach()))
        every = self.max_nonfinite_steps
        if every and step % every == 0:
            self.settle_verdicts(len(self._verdicts) - (1 if flag.is_cuda else 0))

    def settle_verdicts(self, count: int | None = None) -> None:
        """Read the first `count` pending verdicts (all by default) in one transfer and count them. Every rank
        holds the same verdicts (see StepRunner.nonfinite_verdict) and settles at the same steps."""
        count = len(self._verdicts) if count is None else max(count, 0)
        due, self._verdicts = self._verdicts[:count], self._verdicts[count:]
        if not due:
            return
        flags = torch.stack([f.to(due[0][1].device).float().reshape(()) for _, f in due]).tolist()
        for (step, _), flag in zip(due, flags, strict=True):
            if flag:
                self.nonfinite_steps += 1
                self.nonfinite_streak += 1
                if self.nonfinite_streak == 1:
                    self.nonfinite_first = step
                n = self.nonfinite_streak
                if n <= _NONFINITE_LOG_FIRST or n % _NONFINITE_LOG_EVERY == 0:
                    self._nonfinite_news.append((step, n))
            else:
                self.nonfinite_streak = 0
                self.nonfinite_first = None

    def take_nonfinite(self) -> tuple[int, list[tuple[int, int]]]:
        """(steps not applied in all, (step, in a row) of those to log since the last call): the reporter's."""
        news, self._nonfinite_news = self._nonfinite_news, []
        return self.nonfinite_steps, news

    def check_nonfinite(self) -> None:
        """Stop (ConfigError: exit 2, never retried) after `max_nonfinite_steps` steps in a row that were not
        applied: the run is not training, and restarting it would repeat the same steps. None of those steps
        touched the weights, so the last checkpoint is as good as any later one. 0 never stops."""
        limit = self.max_nonfinite_steps
        if not limit or self.nonfinite_streak < limit:
            return
        raise ConfigError(
            f"train.max_nonfinite_steps={limit}: the last {self.nonfinite_streak} steps (from step "
            f"{self.nonfinite_first} on) had a loss or gradient norm that was inf or NaN, so none of them was "
            f"applied and the run is not training ({self.nonfinite_steps} such steps in this run). Likely causes: "
            "a learning rate too high for the model (the run diverged: lower train.lr or lengthen "
            "train.warmup_steps), a corrupt sample or input producing inf/NaN (check the data from that step's "
            "cursor on), fp16 overflow (train.precision=fp16: use bf16). Fix it and resume from the last "
            "checkpoint (no step of the streak changed its weights), or raise train.max_nonfinite_steps (0 = never "
            "stop)"
        )

    def state_dict(self) -> dict[str, Any]:
        self.settle_verdicts()  # the counts saved hold every step of the checkpoint
        return {
            "step": self.step,
            "cursor": self.cursor,
            "epoch": self.epoch,
            "skipped_samples": self.skipped_samples,
            "skipped_files": list(self.skipped_files),
            "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_streak": self.nonfinite_streak,
            "nonfinite_first": self.nonfinite_first,
            "world_size": self.world_size,
            "seed": self.seed,
            "order": self.order,
            "time_unix": time.time(),
            "trackers": dict(self.trackers),
            "flops_per_sample": self.flops_per_sample,
            "rng_stream": self.rng_stream,
            **({"goodput": self.ledger.record()} if self.ledger is not None else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("order")  # absent in checkpoints written before it was recorded
        if saved is not None:
            differ = [k for k, v in saved.items() if self.order.get(k, v) != v]
            changed = [f"{k}={self.order.get(k)!r} (the checkpoint's: {saved[k]!r})" for k in differ]
            if changed:
                raise ConfigError(
                    "the data order changed since the checkpoint, so resuming would repeat and skip samples of "
                    f"this epoch: {', '.join(changed)}; set the checkpoint's values to resume, or start a new "
                    "run (another run.dir or checkpoint.url)"
                )
        self.step = int(state["step"])
        self.cursor = int(state["cursor"])
        self.skipped_samples = int(state.get("skipped_samples", 0))
        # Only informative (named in the stop message): absent in older checkpoints, and anything but a
        # list of strings is dropped rather than trusted.
        files = state.get("skipped_files")
        files = files if isinstance(files, list) else []
        self.skipped_files = [f for f in files if isinstance(f, str)][:MAX_SKIPPED_FILES]
        # Absent before they were counted; validity.py types them, anything else from an older file is 0/None.
        self.nonfinite_steps = _count(state.get("nonfinite_steps"))
        self.nonfinite_streak = min(_count(state.get("nonfinite_streak")), self.nonfinite_steps)
        first = state.get("nonfinite_first")
        self.nonfinite_first = first if self.nonfinite_streak and _count(first) == first else None
        if self.nonfinite_first is None:
            self.nonfinite_streak = 0
        self._verdicts, self._nonfinite_news = [], []
        # The tracker runs to continue ({"wandb": id, "mlflow": run id}): ids only, anything else is dropped.
        trackers = state.get("trackers")
        trackers = trackers if isinstance(trackers, dict) else {}
        self.trackers = {k: v for k, v in trackers.items() if k in ("wandb", "mlflow") and _RUN_ID.fullmatch(str(v))}
        flops = state.get("flops_per_sample")  # informative: anything but a positive finite number is dropped
        ok = isinstance(flops, (int, float)) and not isinstance(flops, bool) and 0 < flops < float("inf")
        self.flops_per_sample = float(flops) if ok else None
        # Checkpoints written before streams were versioned drew from stream 1.
        stream = state.get("rng_stream")
        stream = STREAM_PER_SAMPLE_CPU if stream is None else stream
        if stream not in STREAMS:
            raise ConfigError(
                f"the checkpoint was trained on per-sample draw stream {stream!r}, which this gentrain does not know "
                f"(it knows {', '.join(map(str, STREAMS))}); resume it with the gentrain version that wrote it"
            )
        self.rng_stream = stream
        set_stream_version(stream)
        self.saved_world_size = state.get("world_size")
        self.saved_time = state.get("time_unix")
        self.saved_goodput = parse_record(state.get("goodput"))  # informative: a malformed one is dropped


def _count(value: Any) -> int:
    """A non-negative int from a checkpoint, else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


class JobAgreement:
    """What every rank must agree on after each step: whether any rank was asked to stop, and how many
    samples the job skipped (the names of the first few when the progress still wants them).

    One all-reduce of two ints per step, piggybacking the stop flag on the skip count (they were two
    collectives). On CUDA its result is read `lag` steps later, after the later steps' work is queued, so the
    host never waits for the step it just queued and the GPU's queue stays full; every rank reads the same
    step's result at the same step, so all ranks still stop at the same step, and `drain` settles everything
    before a checkpoint, so a saved progress holds every skip of its steps. One process: no collective, no lag.
    """

    def __init__(self, device: torch.device, lag: int | None = None):
        self.device = device
        self.distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.lag = (1 if device.type == "cuda" else 0) if lag is None else lag
        self._pending: list[tuple[torch.Tensor, list[str]]] = []

    def post(self, stop: bool, batch: Mapping[str, Any]) -> list[tuple[bool, int, list[str]]]:
        """This step's local facts in; the settled (stop, skipped, skipped files) of every step now due out."""
        files = list(batch.get("skipped_files", ()))[:MAX_SKIPPED_FILES]
        if not self.distributed:
            return [(stop, int(batch["skipped"]), files)]
        t = torch.tensor([1 if stop else 0, int(batch["skipped"])], dtype=torch.int64, device=self.device)
        dist.all_reduce(t)
        self._pending.append((t, files))
        return self._settle(len(self._pending) - self.lag)

    def drain(self) -> list[tuple[bool, int, list[str]]]:
        """Everything still pending (before a checkpoint, a stop or the end)."""
        return self._settle(len(self._pending))

    def _settle(self, count: int) -> list[tuple[bool, int, list[str]]]:
        out = []
        for t, files in self._pending[: max(count, 0)]:
            stop, skipped = (int(v) for v in t.tolist())
            names: list[str] = []
            if skipped:  # the same on every rank, so every rank enters the same gather
                gathered: list[Any] = [None] * dist.get_world_size()
                dist.all_gather_object(gathered, files)
                names = [name for names in gathered for name in names]
            out.append((stop > 0, skipped, names))
        self._pending = self._pending[max(count, 0) :]
        return out
