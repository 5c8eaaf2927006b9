"""Training progress: the global step, the data position and the skipped samples, saved with every checkpoint."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainer.errors import ConfigError

# The skip limit acts only from this many skipped samples on: fewer cannot tell a data set that is
# mostly unreadable from a healthy one that met a bad file or two early (one bad file in the first
# batch of 8 is 12% of what was consumed). With a true bad rate of half the limit, 32 skips where
# about 16 are expected is a 1-in-10,000 chance, so a run under its limit is practically never
# stopped; a data set that is all unreadable is stopped after 32 samples of nothing.
MIN_SKIPPED_TO_STOP = 32
# How many skipped files (the first ones, each with its reason) are remembered and named in the stop message.
MAX_SKIPPED_FILES = 5
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
    """

    def __init__(
        self,
        batch_size: int,
        epoch_size: int,
        world_size: int,
        seed: int,
        order: Mapping[str, Any] | None = None,
        max_skipped_fraction: float = 1.0,
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
        self.saved_world_size: int | None = None
        self.saved_time: float | None = None
        # The tracker runs this run logs into (W&B and MLflow run ids, see Reporter.start_trackers).
        self.trackers: dict[str, str] = {}
        # FLOPs of one sample's training step, counted on a run's first step (trainer.engine.throughput): a
        # resumed process takes it from here instead of counting again, so a compiled run's resumed steps stay
        # compiled (counting runs a step eagerly) and every step of a run reports against one count.
        self.flops_per_sample: float | None = None

    @property
    def epoch(self) -> int:
        return self.cursor // self.epoch_size

    @property
    def wants_skipped_files(self) -> bool:
        """Whether the names of newly skipped samples are still worth gathering (the list is not full)."""
        return len(self.skipped_files) < MAX_SKIPPED_FILES

    def advance(self, skipped: int, skipped_files: Sequence[str] = ()) -> None:
        """One optimizer step done: `skipped` samples of the job's batch were unreadable (`skipped_files` why)."""
        self.step += 1
        self.cursor += self.batch_size
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

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursor": self.cursor,
            "epoch": self.epoch,
            "skipped_samples": self.skipped_samples,
            "skipped_files": list(self.skipped_files),
            "world_size": self.world_size,
            "seed": self.seed,
            "order": self.order,
            "time_unix": time.time(),
            "trackers": dict(self.trackers),
            "flops_per_sample": self.flops_per_sample,
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
        # The tracker runs to continue ({"wandb": id, "mlflow": run id}): ids only, anything else is dropped.
        trackers = state.get("trackers")
        trackers = trackers if isinstance(trackers, dict) else {}
        self.trackers = {k: v for k, v in trackers.items() if k in ("wandb", "mlflow") and _RUN_ID.fullmatch(str(v))}
        flops = state.get("flops_per_sample")  # informative: anything but a positive finite number is dropped
        ok = isinstance(flops, (int, float)) and not isinstance(flops, bool) and 0 < flops < float("inf")
        self.flops_per_sample = float(flops) if ok else None
        self.saved_world_size = state.get("world_size")
        self.saved_time = state.get("time_unix")


def job_skips(batch: Mapping[str, Any], progress: TrainProgress, device: torch.device) -> tuple[int, list[str]]:
    """(skipped samples of this step over every rank, the names of the new ones when still wanted).

    One all-reduce of an int per step; the names are all-gathered only at a
    step where some rank skipped and the progress still records names. Both
    conditions are the same on every rank (the total and the list are), so
    every rank enters the same collectives. One process: no collective.
    """
    skipped = int(batch["skipped"])
    files = list(batch.get("skipped_files", ()))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return skipped, files
    total = torch.tensor([skipped], dtype=torch.int64, device=device)
    dist.all_reduce(total)
    skipped = int(total.item())
    if skipped == 0 or not progress.wants_skipped_files:
        return skipped, []
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, files[:MAX_SKIPPED_FILES])
    return skipped, [name for names in gathered for name in names]
