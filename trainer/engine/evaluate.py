"""Periodic FID/KID during training (`eval.every_steps`): all ranks generate and extract, statistics gathered."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from trainer.config import Config
from trainer.elastic import StopRequest
from trainer.engine.parts import FrozenPart, Part, bare_modules, ema_swapped, eval_mode
from trainer.eval.features import load_features
from trainer.eval.fid import FidKid, check_share, evaluate, sample_options, write_result
from trainer.tasks.base import Task

if TYPE_CHECKING:
    from trainer.engine.runtime import Runtime

log = logging.getLogger("gentrain")


class Evaluator:
    """Every `eval.every_steps` (and at the end) computes FID/KID against the held-out split.

    The feature network loads on first use (exit 2 when it is missing);
    real-image statistics are computed once and kept. Rank 0 writes
    `eval-<step>.json` beside the checkpoints and reports the values.
    """

    def __init__(
        self,
        task: Task,
        parts: Mapping[str, Part],
        frozen: Mapping[str, FrozenPart],
        real_set,
        *,
        runtime: Runtime,
        cfg: Config,
        report: Callable[[int, dict[str, float]], None],
        stop: StopRequest | None = None,
    ):
        self.task = task
        self.parts = parts
        self.modules = bare_modules(parts, frozen)
        self.cfg = cfg
        self.real_set = real_set
        self.rank = runtime.rank
        self.world_size = runtime.world_size
        self.device = runtime.device
        self.report = report
        self.stop = stop  # cuts an evaluation short (see trainer.eval.fid.evaluate)
        self._metric = None
        self._about: dict = {}

    @property
    def enabled(self) -> bool:
        return self.cfg.eval.every_steps > 0 and self.real_set is not None

    def prepare(self) -> None:
        """Load the feature network now, so a missing one fails before training starts."""
        if self.enabled and self._metric is None:
            e = self.cfg.eval
            check_share(min(e.num, len(self.real_set)), self.world_size)
            net, self._about = load_features(e.features, e.features_url, self.cfg.checkpoint.storage_options)
            self._metric = FidKid(net, e.kid_subset_size, self.device)

    def maybe_run(self, step: int, last: bool = False) -> dict[str, float] | None:
        if not self.enabled or (not last and step % self.cfg.eval.every_steps):
            return None
        return self.run(step)

    def run(self, step: int) -> dict[str, float]:
        self.prepare()
        t0 = time.perf_counter()
        with ema_swapped(self.parts, self.cfg.sample.use_ema), eval_mode(self.modules):
            values = evaluate(
                self.task,
                self.modules,
                metric=self._metric,
                real_set=self.real_set,
                num=self.cfg.eval.num,
                seed=self.cfg.seed,
                sample_options=sample_options(self.cfg),
                rank=self.rank,
                world_size=self.world_size,
                device=self.device,
                stop=self.stop,
                work=f"evaluation at step {step}",
            )
        if self.rank == 0:
            seconds = round(time.perf_counter() - t0, 3)
            result = {"step": step, "world_size": self.world_size, **values, **self._about, "seconds": seconds}
            write_result(self.cfg.checkpoint_url, self.cfg.checkpoint.storage_options, step, result)
        self.report(step, values)
        return values
