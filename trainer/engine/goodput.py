"""Goodput: every second of a run accounted for, and checkpoint intervals chosen from measured costs.

The ledger (`TimeLedger`). Each process splits its wall time, from its start (`process_start_time`) to now,
into the kinds of `KINDS`. It is a stopwatch with one hand: the training thread names the kind it is in
(`switch`, `phase`), and every second between two switches goes to the kind that was current, so the kinds add
up to the wall time by construction, whatever the loop does (a new piece of work that nobody named lands in
`idle`, never nowhere). Time the training thread spends inside a step waiting on a save (a part's fence, see
CheckpointManager.fence) is moved from the step to `checkpoint_stall` once its length is known (`move`), and so
is the compile time of the first compiled step (dynamo's timers, trainer.engine.compile.CompileStats).

Across restarts. The run's totals (every process's seconds, how many processes, how many failures, whether
the newest checkpoint was written by a process that was stopping cleanly) travel in trainer.json's progress
(`TrainProgress.goodput`), like the tracker ids, so a resumed process continues the sums from its checkpoint.
What a crashed process did after its last checkpoint is not in them (it was never saved); the steps it trained
are trained again, and that time is counted as `redone`: steps up to the newest step the job had reached
(the memory tier's reached.json, or the step attempts.json records for the crash) are redone, not trained.
A process that resumes from a checkpoint not written while stopping cleanly (a final or emergency save)
counts one failure (or the crash count attempts.json holds for that resume point, if larger).

Intervals (`SaveSchedule`). `checkpoint.every_steps: auto` and `checkpoint.memory_every_steps: auto` take the
Young/Daly optimum, interval = sqrt(2 * C * MTBF), with C the stall one save (or snapshot) cost the training
thread in this run, and MTBF from `elastic.mtbf_hours` (default: `PER_GPU_MTBF_HOURS` / world size) updated by
the failures the run saw (`run_mtbf_hours`), converted to steps with the measured step time; the durable one
bounded by `checkpoint.max_interval_minutes`. Rank 0 decides at steps every rank knows (`decides_at`) and
broadcasts the decision, so every rank saves at the same steps. Where a save lands never changes what is
trained, so exact resume is unaffected.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("gentrain")

# The kinds, in table order. `train` is the only productive one: goodput = train / wall.
KINDS = (
    "train",
    "redone",
    "startup",
    "compile",
    "restore",
    "data_wait",
    "checkpoint_stall",
    "eval",
    "idle",
)
DESCRIPTIONS = {
    "train": "training steps (first time)",
    "redone": "steps trained again after a failure",
    "startup": "imports, process group, build, data loader",
    "compile": "torch.compile before the steps could run",
    "restore": "finding, fetching, verifying and loading the checkpoint",
    "data_wait": "waiting for the next batch",
    "checkpoint_stall": "the step thread waiting on a save or snapshot",
    "eval": "validation, evaluation (FID/KID) and previews",
    "idle": "everything else (FLOP counting, calibration, uploads, closing)",
}

# Published failure rate: Kokolis et al., "Revisiting Reliability in Large-Scale ML Research Clusters" (Meta,
# 2024) measured a mean time to failure of 7.9 hours for 1,024-GPU jobs: 7.9 h * 1024 = 8,090 GPU-hours
# between failures per GPU (their projection for 16,384 GPUs, 1.8 h, is within 10% of 8,090 / 16,384 h).
PER_GPU_MTBF_HOURS = 7.9 * 1024

# Until a save has been measured, `auto` saves durably every this many steps (the fixed default) and snapshots
# to the memory tier every step (which measures the snapshot at once); both bounded like measured intervals.
DEFAULT_AUTO_EVERY_STEPS = 500
DEFAULT_AUTO_MEMORY_EVERY_STEPS = 1
_REDECIDE_EVERY = 256  # steps between decisions once the first ones (at 1, 2, 4, ... steps in) are made


def default_mtbf_hours(world_size: int) -> float:
    """The job's mean time between failures from the published per-GPU rate: failures of its processes add."""
    return PER_GPU_MTBF_HOURS / max(1, world_size)


def run_mtbf_hours(prior_hours: float, observed_hours: float, failures: int) -> float:
    """The MTBF to plan with: the prior (`elastic.mtbf_hours` or the published rate) counted as one failure in
    `prior_hours`, plus what this run saw (`failures` in `observed_hours` of wall time, across restarts): the
    mean of a gamma posterior, so a run without failures drifts up from the prior and one that fails often
    comes down to its own rate."""
    return (prior_hours + max(0.0, observed_hours)) / (1 + max(0, failures))


def young_daly_seconds(cost_seconds: float, mtbf_seconds: float) -> float:
    """Young's (1974) and Daly's (2006) first-order optimum interval between checkpoints: sqrt(2 * C * MTBF),
    with C what one checkpoint costs the training and MTBF the mean time between failures."""
    return math.sqrt(2.0 * max(0.0, cost_seconds) * max(0.0, mtbf_seconds))


def interval_steps(
    cost_seconds: float, mtbf_hours: float, step_seconds: float, max_minutes: float | None = None
) -> tuple[int, bool]:
    """(steps between saves, whether `max_minutes` bounded it): the Young/Daly interval in steps of
    `step_seconds`, at least 1, and at most `max_minutes` of steps (at least 1) when given."""
    step_seconds = max(step_seconds, 1e-9)
    steps = max(1, round(young_daly_seconds(cost_seconds, mtbf_hours * 3600.0) / step_seconds))
    if max_minutes is not None:
        bound = max(1, math.floor(max_minutes * 60.0 / step_seconds + 1e-6))
        if steps > bound:
            return bound, True
    return steps, False


# ---------------------------------------------------------------------------------------------- the ledger


def _empty() -> dict[str, float]:
    return dict.fromkeys(KINDS, 0.0)


def parse_record(doc: Any) -> dict[str, Any] | None:
    """The goodput record of a trainer.json (data from a store: anything but numbers where numbers belong is
    dropped), or None when there is none. Form: {"seconds": {kind: s}, "processes": n, "failures": n,
    "clean_stop": bool}."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("seconds"), Mapping):
        return None
    seconds = _empty()
    for kind, value in doc["seconds"].items():
        if kind in seconds and _nonneg(value):
            seconds[kind] = float(value)
    processes = doc.get("processes")
    failures = doc.get("failures")
    return {
        "seconds": seconds,
        "processes": processes if _count(processes) else 0,
        "failures": failures if _count(failures) else 0,
        "clean_stop": doc.get("clean_stop") is True,
    }


def _nonneg(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class TimeLedger:
    """This process's wall time by kind, since the process started, plus the run's totals before it.

    Only the thread that made it (the training thread) switches kinds; other threads' calls are ignored (a
    writer thread's fence is not the training thread waiting)."""

    def __init__(self, process_start_unix: float):
        now = time.monotonic()
        # The process started before this object: that time is start-up (imports).
        self._t = now - max(0.0, time.time() - process_start_unix)
        self._start = self._t
        self._kind = "startup"
        self._entered = now  # when the current kind began (a `move` brings the count up to now, not this)
        self._thread = threading.get_ident()
        self.seconds = _empty()
        self.base: dict[str, Any] = {"seconds": _empty(), "processes": 0, "failures": 0, "clean_stop": False}
        self.failed_before = False  # this process resumed after a failure (counted in `failures`)
        self.redo_until = 0  # steps up to this one are trained again (see the module doc)
        self.clean_stop = False  # set before a final or emergency save: the next process is no failure

    # ---- switching
    def switch(self, kind: str) -> str:
        """From now on, time goes to `kind`; returns the kind it went to before."""
        if threading.get_ident() != self._thread:
            return kind
        now = time.monotonic()
        self.seconds[self._kind] += now - self._t
        if kind != self._kind:
            self._entered = now
        self._t, previous, self._kind = now, self._kind, kind
        return previous

    def current(self) -> tuple[str, float]:
        """(the kind the training thread is in, the time.monotonic() it entered it), safe from any thread: the
        step watchdog (trainer.elastic.StepWatchdog) reads it to tell a step that hangs from a save or an
        evaluation that takes long."""
        while True:
            entered, kind = self._entered, self._kind
            if entered == self._entered:  # not torn by a switch in between
                return kind, entered

    def move(self, src: str, dst: str, seconds: float) -> None:
        """`seconds` counted as `src` (the current kind included) were `dst`'s."""
        if threading.get_ident() != self._thread or seconds <= 0:
            return
        if src == self._kind:
            self.switch(src)  # bring `src` up to now
        seconds = min(seconds, self.seconds[src])
        self.seconds[src] -= seconds
        self.seconds[dst] += seconds

    def take(self, dst: str, seconds: float) -> None:
        """`seconds` of the current kind (ending now) were `dst`'s (a fence's wait inside a step)."""
        self.move(self._kind, dst, seconds)

    def step_kind(self, step: int) -> str:
        """The kind of the step that takes the run from `step` to `step + 1`."""
        return "redone" if step < self.redo_until else "train"

    # ---- reading
    def process_seconds(self) -> dict[str, float]:
        """This process's seconds by kind up to now (without switching: safe from any thread)."""
        out = dict(self.seconds)
        out[self._kind] += time.monotonic() - self._t
        return out

    def run_seconds(self) -> dict[str, float]:
        """The run's seconds by kind: every earlier process's (from the checkpoint) and this one's."""
        mine = self.process_seconds()
        return {k: self.base["seconds"][k] + mine[k] for k in KINDS}

    def record(self) -> dict[str, Any]:
        """What trainer.json keeps (see `parse_record`)."""
        return {
            "seconds": {k: round(v, 6) for k, v in self.run_seconds().items()},
            "processes": self.base["processes"] + 1,
            "failures": self.base["failures"] + (1 if self.failed_before else 0),
            "clean_stop": self.clean_stop,
        }

    # ---- across restarts
    def continue_from(self, saved: Mapping[str, Any] | None, resumed: bool, crashes: int) -> None:
        """Continue the run's totals of the checkpoint this process resumed from (`saved`: its parsed record,
        None for a fresh start or a checkpoint written before goodput was kept). A resume from a checkpoint
        not written while stopping cleanly follows a failure: `crashes` of them when attempts.json counted that
        many from this resume point, else one."""
        if saved is not None:
            self.base = {**saved, "seconds": dict(saved["seconds"])}
        if resumed and not (saved is not None and saved["clean_stop"]):
            self.failed_before = True
            self.base["failures"] += max(1, crashes) - 1  # the +1 is `failed_before`

    @property
    def failures(self) -> int:
        return self.base["failures"] + (1 if self.failed_before else 0)


def goodput(seconds: Mapping[str, float]) -> float:
    wall = sum(seconds.values())
    return seconds.get("train", 0.0) / wall if wall > 0 else 0.0


def table(seconds: Mapping[str, float], processes: int | None = None, failures: int | None = None) -> str:
    """The accounting as a text table: one row per kind (seconds, share of the wall time), then the wall time
    and goodput."""
    wall = sum(seconds.values())
    rows = [f"{'kind':<18} {'seconds':>12} {'share':>7}  what"]
    for kind in KINDS:
        s = seconds.get(kind, 0.0)
        rows.append(f"{kind:<18} {s:>12.2f} {s / wall if wall else 0:>7.1%}  {DESCRIPTIONS[kind]}")
    rows.append(f"{'wall':<18} {wall:>12.2f} {1 if wall else 0:>7.1%}  the sum of the above")
    extra = ""
    if processes is not None:
        extra = f" over {processes} process{'es' if processes != 1 else ''}, {failures or 0} failure(s)"
    rows.append(f"goodput {goodput(seconds):.4f}{extra}")
    return "\n".join(rows)


def one_line(seconds: Mapping[str, float]) -> str:
    return " ".join(f"{k}={seconds.get(k, 0.0):.2f}" for k in KINDS) + f" wall={sum(seconds.values()):.2f}"


# ---------------------------------------------------------------------------------------------- intervals


class SaveSchedule:
    """When the durable and the memory tier save: every N steps as configured (`step % N == 0`, as always), or
    `auto`: N from the measured costs (see the module doc), the next save N steps after the last one.

    Rank 0 measures (step time, stall per save and per snapshot) and decides; `decides_at(step)` names the
    steps where a decision is due, the same on every rank, and the loop broadcasts rank 0's (`apply`)."""

    def __init__(
        self,
        every_steps: int | str,
        memory_every_steps: int | str,
        memory: bool,
        max_interval_minutes: float,
        mtbf_hours: float | None,
        world_size: int,
        is_main: bool,
    ):
        self.auto_durable = every_steps == "auto"
        self.auto_memory = memory and memory_every_steps == "auto"
        self.every_steps = DEFAULT_AUTO_EVERY_STEPS if self.auto_durable else int(every_steps)
        self.memory_every_steps = (
            DEFAULT_AUTO_MEMORY_EVERY_STEPS
            if self.auto_memory
            else int(memory_every_steps if memory_every_steps != "auto" else 1)
        )
        self.memory = memory
        self.max_interval_minutes = max_interval_minutes
        self.prior_mtbf_hours = mtbf_hours if mtbf_hours else default_mtbf_hours(world_size)
        self.prior_source = "elastic.mtbf_hours" if mtbf_hours else f"published rate / {world_size} process(es)"
        self.is_main = is_main
        self.start_step = 0
        self.last_durable = 0
        self.last_memory = 0
        # rank 0's measurements: (sum, count) of step seconds, of durable and memory stalls
        self._step = [0.0, 0]
        self._cost = {"durable": [0.0, 0], "memory": [0.0, 0]}
        self.decision: dict[str, Any] | None = None
        self._measured_logged: set[str] = set()  # tiers whose first decision from a measured cost was logged

    @property
    def auto(self) -> bool:
        return self.auto_durable or self.auto_memory

    def start(self, step: int) -> None:
        self.start_step = self.last_durable = self.last_memory = step

    # ---- due
    def durable_due(self, step: int) -> bool:
        if self.auto_durable:
            return step >= self.last_durable + self.every_steps
        return bool(self.every_steps) and step % self.every_steps == 0

    def memory_due(self, step: int) -> bool:
        if not self.memory:
            return False
        if self.auto_memory:
            return step >= self.last_memory + self.memory_every_steps
        return step % self.memory_every_steps == 0

    def saved(self, step: int, tier: str) -> None:
        if tier == "durable":
            self.last_durable = step
        else:
            self.last_memory = step

    # ---- measurements (rank 0's count)
    def on_step_time(self, seconds: float) -> None:
        self._step[0] += seconds
        self._step[1] += 1

    def on_cost(self, tier: str, seconds: float) -> None:
        self._cost[tier][0] += seconds
        self._cost[tier][1] += 1

    def _mean(self, pair: list) -> float | None:
        return pair[0] / pair[1] if pair[1] else None

    # ---- decisions
    def decides_at(self, step: int, durable_saved: bool) -> bool:
        """Whether every rank takes a decision after `step` (the same answer on every rank)."""
        if not self.auto:
            return False
        n = step - self.start_step
        return durable_saved or n in (1, 2, 4, 8, 16, 32, 64, 128) or (n > 0 and n % _REDECIDE_EVERY == 0)

    def decide(self, run_hours: float, failures: int) -> dict[str, Any] | None:
        """Rank 0: the intervals from what was measured so far, with their inputs; None until a step time is."""
        step_s = self._mean(self._step)
        if step_s is None:
            return None
        mtbf = run_mtbf_hours(self.prior_mtbf_hours, run_hours, failures)
        out: dict[str, Any] = {
            "step_seconds": step_s,
            "mtbf_hours": mtbf,
            "prior_mtbf_hours": self.prior_mtbf_hours,
            "prior": self.prior_source,
            "run_hours": run_hours,
            "failures": failures,
        }
        for tier, auto, default, bound in (
            ("durable", self.auto_durable, DEFAULT_AUTO_EVERY_STEPS, self.max_interval_minutes),
            ("memory", self.auto_memory, DEFAULT_AUTO_MEMORY_EVERY_STEPS, None),
        ):
            if not auto:
                continue
            cost = self._mean(self._cost[tier])
            if cost is None:  # not measured yet: the default, bounded
                steps = default
                bounded = False
                if bound is not None:
                    limit = max(1, math.floor(bound * 60.0 / max(step_s, 1e-9) + 1e-6))
                    steps, bounded = (limit, True) if steps > limit else (steps, False)
            else:
                steps, bounded = interval_steps(cost, mtbf, step_s, bound)
            if tier == "memory":  # never rarer than the durable tier: a snapshot is the cheaper of the two
                durable = out["durable"]["steps"] if "durable" in out else self.every_steps
                if durable and steps > durable:
                    steps, bounded = durable, True
            out[tier] = {"steps": steps, "cost_seconds": cost, "bounded": bounded}
        return out

    def apply(self, decision: dict[str, Any] | None) -> None:
        """Every rank: take rank 0's decision (broadcast); logged by rank 0 when an interval changes, and the
        first time a tier's is computed from a measured cost."""
        if decision is None:
            return
        changed = []
        if "durable" in decision and decision["durable"]["steps"] != self.every_steps:
            self.every_steps = decision["durable"]["steps"]
            changed.append("durable")
        if "memory" in decision and decision["memory"]["steps"] != self.memory_every_steps:
            self.memory_every_steps = decision["memory"]["steps"]
            changed.append("memory")
        first = self.decision is None
        self.decision = decision
        # The first decision from a measured cost is logged even when the interval stays (its inputs are news).
        measured = {t for t in ("durable", "memory") if (decision.get(t) or {}).get("cost_seconds") is not None}
        newly = measured - self._measured_logged
        self._measured_logged |= measured
        if self.is_main and (changed or first or newly):
            log.info("checkpoint interval (auto): %s", describe(decision, self.max_interval_minutes))


def describe(decision: Mapping[str, Any], max_minutes: float) -> str:
    """The decision in one line, with every input it was computed from."""
    parts = []
    for tier, key in (("durable", "checkpoint.every_steps"), ("memory", "checkpoint.memory_every_steps")):
        d = decision.get(tier)
        if d is None:
            continue
        if d["cost_seconds"] is None:
            how = "default until a save is measured"
        else:
            how = f"sqrt(2 * cost {d['cost_seconds']:.6g} s * MTBF {decision['mtbf_hours']:.6g} h)"
        if d["bounded"] and tier == "durable":
            how += f", bounded by checkpoint.max_interval_minutes={max_minutes:g}"
        elif d["bounded"]:
            how += ", bounded by the durable interval"
        parts.append(f"{key}={d['steps']} ({how})")
    parts.append(
        f"step_seconds={decision['step_seconds']:.6g} mtbf_hours={decision['mtbf_hours']:.6g} "
        f"(prior {decision['prior_mtbf_hours']:.6g} h from {decision['prior']}, "
        f"{decision['failures']} failure(s) in {decision['run_hours']:.4g} h of this run)"
    )
    return " ".join(parts)
