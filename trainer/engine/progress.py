"""Training progress: the global step and the data position, saved with every checkpoint."""

from __future__ import annotations

import time
from typing import Any


class TrainProgress:
    """Step count, global data cursor (samples consumed) and skipped-sample count.

    The cursor is the whole data position (see trainer.data.sampler): it moves
    only when an optimizer step completes, so prefetched batches never count.
    """

    def __init__(self, batch_size: int, epoch_size: int, world_size: int, seed: int):
        self.batch_size = batch_size
        self.epoch_size = epoch_size
        self.world_size = world_size
        self.seed = seed
        self.step = 0
        self.cursor = 0
        self.skipped_samples = 0
        self.saved_world_size: int | None = None
        self.saved_time: float | None = None

    @property
    def epoch(self) -> int:
        return self.cursor // self.epoch_size

    def advance(self, skipped: int) -> None:
        self.step += 1
        self.cursor += self.batch_size
        self.skipped_samples += skipped

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "cursor": self.cursor,
            "epoch": self.epoch,
            "skipped_samples": self.skipped_samples,
            "world_size": self.world_size,
            "seed": self.seed,
            "time_unix": time.time(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.cursor = int(state["cursor"])
        self.skipped_samples = int(state.get("skipped_samples", 0))
        self.saved_world_size = state.get("world_size")
        self.saved_time = state.get("time_unix")
