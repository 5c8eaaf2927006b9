"""Test-only: the cascade task plus an exact kill point, named by import path (`cascade_probe:KillableCascadeTask`).

`PROBE_TASK_KILL=RANK:STEP` makes that rank SIGKILL itself in the middle of
global step STEP (after stage 1's backward, inside stage 2's loss) on the
first attempt, so the test kills at a known point instead of racing the job.
"""

from __future__ import annotations

import os
import signal

from trainer.tasks.base import Batch, Loss, Phase, StepInfo, TaskContext
from trainer.tasks.cascade import CascadeTask


class KillableCascadeTask(CascadeTask):
    def __init__(self, model_cfg, ctx: TaskContext):
        super().__init__(model_cfg, ctx)
        kill = os.environ.get("PROBE_TASK_KILL")
        self._kill = tuple(int(v) for v in kill.split(":")) if kill else None

    def loss(self, phase: Phase, modules, batch: Batch, outputs, info: StepInfo) -> Loss:
        if phase.part == "stage2" and self._kill and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
            rank, at = self._kill
            if int(os.environ.get("RANK", "0")) == rank and info.step == at:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().loss(phase, modules, batch, outputs, info)
