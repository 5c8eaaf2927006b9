"""CheckpointManager: when to save, what to resume from, the emergency save, failure accounting."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from trainer import __version__
from trainer.checkpoint.state import Stateful, capture_rank_state, read_frozen_records, restore, snapshot_files
from trainer.checkpoint.store import CheckpointCorrupt, CheckpointStore
from trainer.checkpoint.writer import Checkpointer
from trainer.config import Config
from trainer.elastic import EXIT_PREEMPTED, DistEnv, StopRequest, broadcast_object, gather_objects
from trainer.metrics import TrainingMetrics

log = logging.getLogger("gentrain")


class CheckpointManager:
    """Owns the store and the writer; decides for itself when a step is saved.

    Saves are collective (every rank's RNG state is gathered) and written by
    rank 0, in the background with `checkpoint.async`. A failed save never
    stops training: it is counted, logged, and the next save retries; only
    the final save raises (so the job is retried rather than losing it).
    """

    def __init__(self, cfg: Config, env: DistEnv, metrics: TrainingMetrics):
        c = cfg.checkpoint
        self.cfg = cfg
        self.env = env
        self.metrics = metrics
        self.store = CheckpointStore(cfg.checkpoint_url, c.storage_options, c.keep, c.keep_every_steps)
        self.writer = Checkpointer(self.store, c.async_, on_done=metrics.on_checkpoint_done) if env.is_main else None
        self.every_steps = c.every_steps
        self.failures = 0
        self.resumed_from: str | None = None
        self.progress: Stateful | None = None
        self.parts: Mapping[str, Stateful] = {}
        self.frozen: Mapping[str, dict[str, Any]] = {}

    def attach(self, progress: Stateful, parts: Mapping[str, Stateful], frozen: Mapping[str, dict[str, Any]]) -> None:
        """The state a checkpoint holds: progress, trainable parts, and frozen parts' source records."""
        self.progress, self.parts, self.frozen = progress, parts, frozen

    # ---------------------------------------------------------------- resume

    def pinned_frozen_sources(self) -> dict[str, dict[str, Any]] | None:
        """Frozen-part records of the checkpoint a resume would start from (None on a fresh start)."""
        if not self.cfg.checkpoint.resume:
            return None
        records = None
        if self.env.is_main:
            info = self.store.latest_valid()
            if info is not None:
                try:
                    records = read_frozen_records(self.store, info)
                except CheckpointCorrupt as e:
                    log.warning("checkpoint %s: %s", info.url, e)
        return broadcast_object(records)

    def resume(self) -> str | None:
        """Load the newest valid checkpoint: rank 0 picks (digest-verified), every rank loads that step."""
        if not self.cfg.checkpoint.resume:
            return None
        chosen: int | None = None
        if self.env.is_main:
            for info in self.store.valid_candidates():
                try:
                    self._restore(info)
                    chosen = info.step
                    break
                except (CheckpointCorrupt, KeyError, ValueError, RuntimeError) as e:
                    log.warning("checkpoint %s cannot be loaded (%s); trying the previous one", info.url, e)
        chosen = broadcast_object(chosen)
        if chosen is None:
            return None
        if not self.env.is_main:
            self._restore(self.store.check(chosen))
        self.resumed_from = self.store.url_for(chosen)
        return self.resumed_from

    def _restore(self, info) -> None:
        doc = restore(self.store, info, self.progress, self.parts, self.env.rank)
        recorded = doc.get("frozen", {})
        if {k: v["digest"] for k, v in recorded.items()} != {k: v["digest"] for k, v in self.frozen.items()}:
            raise ValueError(f"its frozen parts {recorded} differ from the ones loaded now {self.frozen}")

    # ---------------------------------------------------------------- save

    def maybe_save(self, step: int) -> None:
        if self.every_steps and step % self.every_steps == 0:
            self.save(step)

    def save(self, step: int, sync: bool = False, final: bool = False) -> bool:
        """Collective: every rank contributes its own state; rank 0 writes. False if it failed."""
        t0 = time.perf_counter()
        rank_states = gather_objects(capture_rank_state())
        if not self.env.is_main:
            self.metrics.on_checkpoint_stall(time.perf_counter() - t0)
            return True
        files = snapshot_files(self.progress, self.parts, rank_states, self.frozen)
        meta = {
            "world_size": self.env.world_size,
            "gentrain_version": __version__,
            "torch_version": torch.__version__,
            "task": self.cfg.task,
            "config": self.cfg.to_dict(),
            "frozen": dict(self.frozen),
        }
        try:
            # The writer logs the commit and reports it to the metrics itself.
            self.writer.save(step, files, meta, sync=sync)
        except Exception as e:  # storage outage, quota, credentials: training goes on
            self._count_failure(e)
            if final:
                raise  # the final save must not be lost silently: crash, and be retried
            return False
        self.metrics.on_checkpoint_stall(time.perf_counter() - t0)
        return True

    def _count_failure(self, err: BaseException) -> None:
        self.failures += 1
        self.metrics.on_checkpoint_failure()
        log.error(
            "checkpoint save failed (%d so far; training continues, the last committed checkpoint stays valid, "
            "the next save retries): %s",
            self.failures,
            err,
        )

    def report_background_failure(self) -> None:
        if self.writer is not None:
            err = self.writer.take_failure()
            if err is not None:
                self._count_failure(err)

    def emergency_save(self, step: int, stop: StopRequest, grace_seconds: float, flush) -> int:
        """All ranks agreed to stop: write a checkpoint within the grace period, then exit 143."""
        left = stop.seconds_left(grace_seconds)
        log.warning("stop requested: writing an emergency checkpoint at step %d (%.1fs of grace left)", step, left)
        self.metrics.on_preemption()
        done = threading.Event()
        outcome: dict[str, Any] = {}

        def work() -> None:
            try:
                if self.writer is not None:
                    self.writer.wait()
                outcome["ok"] = self.save(step, sync=True)
            except BaseException as e:  # reported below; exit code stays 143
                outcome["error"] = e
            finally:
                done.set()

        threading.Thread(target=work, name="gentrain-emergency-save", daemon=True).start()
        if not done.wait(timeout=max(0.0, stop.seconds_left(grace_seconds))):
            log.error(
                "emergency checkpoint did not finish within elastic.grace_seconds=%.0f; "
                "the previous checkpoint stays valid",
                grace_seconds,
            )
            flush()
            os._exit(EXIT_PREEMPTED)
        if outcome.get("error") or not outcome.get("ok"):
            log.error("emergency checkpoint failed: %s; the previous checkpoint stays valid", outcome.get("error"))
        else:
            log.warning("emergency checkpoint written at step %d; exiting 143", step)
        return EXIT_PREEMPTED

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.report_background_failure()
