"""Training progress: the global step and the data position, saved with every checkpoint."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from trainer.config import ConfigError


class TrainProgress:
    """Step count, global data cursor (samples consumed) and skipped-sample count.

    The cursor is the whole data position (see trainer.data.sampler): it moves
    only when an optimizer step completes, so prefetched batches never count.
    """

    def __init__(
        self, batch_size: int, epoch_size: int, world_size: int, seed: int, order: Mapping[str, Any] | None = None
    ):
        self.batch_size = batch_size
        # The config keys the sample order is a function of (besides the cursor): a resume under other
        # values would continue another order mid-epoch, repeating and skipping samples.
        self.order = dict(order or {"seed": seed})
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
            "order": self.order,
            "time_unix": time.time(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("order")  # absent in checkpoints written before it was recorded
        if saved is not None:
            changed = [f"{k}={self.order.get(k)!r} (the checkpoint's: {v!r})" for k, v in saved.items()
                       if self.order.get(k, v) != v]  # fmt: skip
            if changed:
                raise ConfigError(
                    "the data order changed since the checkpoint, so resuming would repeat and skip samples of "
                    f"this epoch: {', '.join(changed)}; set the checkpoint's values to resume, or start a new "
                    "run (another run.dir or checkpoint.url)"
                )
        self.step = int(state["step"])
        self.cursor = int(state["cursor"])
        self.skipped_samples = int(state.get("skipped_samples", 0))
        self.saved_world_size = state.get("world_size")
        self.saved_time = state.get("time_unix")
