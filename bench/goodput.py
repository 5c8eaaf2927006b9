"""Goodput of a gentrain run at scale: a failure simulator fed with gentrain's measured costs (issue 49, deliver 4).

What fraction of a job's wall time trained the model, at 64, 1,024 and 16,384 GPUs, for three levers:
(a) durable checkpoints only, (b) + the memory tier, (c) + the memory tier + the run's compile cache.

The model. A job of N GPUs (8 per node) trains steps of `--step-s` seconds. Failures arrive as a Poisson
process at a per-GPU-hour rate (`RATES`; or a trace file of a user's own failures, `--trace`), each of a kind:
  process  a worker crashes, its node stays: the same node restarts (local inductor cache warm, memory tier kept);
  node     a node is lost and a replacement joins (empty local caches; its memory snapshot lives on its buddy);
  job      a failure the memory tier cannot recover from (several nodes at once, e.g. a network switch):
           every node resumes from the durable store.
After a failure the job spends `detection` (loss -> the survivors' new workers start: the agents notice, tear
down, re-rendezvous, a replacement agent joins), then every worker pays `startup` (imports, process group,
build), `compile` (cold on a replacement node, from the run's cache with lever (c), from the warm local cache
on a node that stayed) and `restore` (from the memory tier or the store), and trains again from the newest
checkpoint that was complete when the failure hit: a durable save `--save-write-s` after its step, a memory
snapshot `--snapshot-write-s` after its step (written and copied to the buddy). Every save stalls the step
thread `--save-stall-s` (snapshot: `--snapshot-stall-s`), plus the rest of the previous write when the interval
is shorter than a write (one save in flight at a time: the next waits for it). A failure during a restart
starts the restart again. The simulation is exact for its inputs (event by event, no averages), seeded.

Lost time, in the categories of Google's goodput library and Meta's ETTR, and with the names of gentrain's
in-run ledger (trainer/engine/goodput.py `KINDS`): `train` (steps kept: the goodput), `redone` (lost progress:
work after the checkpoint resumed from, done again), `startup`, `compile`, `restore`, `checkpoint_stall`,
`detection` (no process of the job runs: the ledger cannot see it, the model can), `idle` (the partial step
at the end of the horizon). They add up to the wall time.

Intervals: Young/Daly, interval = sqrt(2 * C * MTBF) with C the save's stall and MTBF the mean time between the
failures that checkpoint tier has to recover (durable without the memory tier: every failure; with it: only
`job` failures; the memory tier: `process` and `node`), bounded by `--max-interval-minutes`, in whole steps;
`--durable-every-s` / `--memory-every-s` fix them instead.

Every input's default, its unit and where it was measured are in `inputs()` (printed in the JSON); each is
overridable by its flag. `--calibrate` runs a failure schedule for real (two torchrun agents on 127.0.0.1,
CPU) and compares the lost time measured with the model's prediction for the same schedule (see `calibrate`).

Usage:
  python bench/goodput.py [--json OUT]                            the table: levers x scales x published rates
  python bench/goodput.py --gpus 1024 --trace failures.csv        replay your own failures (CSV or JSON)
  python bench/goodput.py --calibrate [--json OUT]                predicted vs measured lost time, 2 agents
                         [--calibrate-levers durable,memory,memory+compile_cache]
Trace: CSV with a header `time_s,node,kind`, or JSON {"failures": [{"time_s": .., "node": .., "kind": ..}],
"duration_s": optional}; time_s is seconds since the job's launch, kind one of process, node, job.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

KINDS = ("process", "node", "job")
CATEGORIES = ("train", "redone", "startup", "compile", "restore", "checkpoint_stall", "detection", "idle")
SCALES = (64, 1024, 16384)
LEVERS = {
    "durable": "(a) durable checkpoints only",
    "memory": "(b) + the memory tier",
    "memory+compile_cache": "(c) + the memory tier + the run's compile cache",
}
TARGETS = {1024: 0.97, 16384: 0.93}  # issue 49: with all levers, on paper

# Failures per GPU-hour, from the published figures. The default is the most pessimistic per GPU.
RATES = {
    "meta-1024": {
        "per_gpu_hour": 1 / (7.9 * 1024),
        "source": "Kokolis et al. 2024 (Meta research clusters): MTTF 7.9 h for 1,024-GPU jobs -> 1/(7.9 h x 1024)",
    },
    "meta-16384": {
        "per_gpu_hour": 1 / (1.8 * 16384),
        "source": "Kokolis et al. 2024: MTTF projected 1.8 h at 16,384 GPUs -> 1/(1.8 h x 16384)",
    },
    "llama3": {
        "per_gpu_hour": 419 / (54 * 24 * 16384),
        "source": "Llama 3 (Meta 2024): 419 unexpected interruptions in 54 days on 16,384 H100s -> 419/(54 x 24 h x 16384)",
    },
}
DEFAULT_RATE = "meta-1024"  # as trainer/engine/goodput.py PER_GPU_MTBF_HOURS (7.9 h x 1024)

BENCH = "docs/benchmarks.md"


@dataclass(frozen=True)
class Costs:
    """gentrain's measured costs, seconds (the defaults: `inputs()` says where each was measured)."""

    step_s: float = 1.0
    startup_s: float = 3.56
    compile_cold_s: float = 11.9
    compile_cached_s: float = 2.1
    compile_warm_s: float = 2.1
    restore_store_s: float = 1.06
    restore_memory_s: float = 0.36
    save_stall_s: float = 0.24
    save_write_s: float = 0.78
    snapshot_stall_s: float = 0.17
    snapshot_write_s: float = 0.55
    detect_process_s: float = 1.13
    detect_node_s: float = 29.7
    first_start_s: float | None = None  # the very first start's start-up (default: startup_s)
    state_gb_per_gpu: float = 1.2
    store_gbps: float = math.inf  # the durable store's aggregate bandwidth, GB/s


def at_scale(c: Costs, gpus: int) -> Costs:
    """The costs of a job of `gpus` GPUs: a durable save is written, and a restore from the store read, by every
    rank at once, so neither is faster than the store's aggregate bandwidth allows."""
    if not math.isfinite(c.store_gbps):
        return c
    through_store = gpus * c.state_gb_per_gpu / c.store_gbps
    return replace(
        c, save_write_s=max(c.save_write_s, through_store), restore_store_s=max(c.restore_store_s, through_store)
    )


SOURCES = {
    "step_s": "assumed (a training step at scale); with the memory tier the progress lost is 1-2 steps, so it scales with this",
    "startup_s": "bench/results/startup-2026-11-27-night.json this/torchrun first_step median (a torchrun worker's "
    f"start to its first step, CPU; {BENCH} 'Start-up'). GPU start-up at scale (CUDA, NCCL init over N ranks) is not measured here",
    "compile_cold_s": "bench/results/compile-cache-h200-2026-11-28.json rounds[0].cold.compile_s (DiT-XL/2, bf16, "
    "H200, empty inductor cache: a replacement node)",
    "compile_cached_s": "bench/results/compile-cache-h200-2026-11-28.json rounds[0].restored.compile_s (the run's "
    "compile cache: 0.176x cold; CPU 0.111-0.118x, compile-cache-cpu-2026-11-28.json)",
    "compile_warm_s": "assumed equal to compile_cached_s (a node that stayed has its local inductor cache; on CPU the "
    "issue measured 2.4 s warm local against 12-23 s cold)",
    "restore_store_s": f"derived: 1.2 GB per rank read at the disk's measured 1.53 GB/s (dd) + blake3 at 4.6 GB/s "
    f"({BENCH} 'Checkpoints'); discovery 0.1 s is inside the rounding",
    "restore_memory_s": f"derived: 1.2 GB per rank, copy 0.10 s + blake3 0.26 s from tmpfs ({BENCH} 'Memory tier', "
    "parts of one snapshot measured alone)",
    "save_stall_s": f"{BENCH} 'Checkpoints': async save stall 0.40 x sync save 0.59 s (1.2 GB, run 2 medians)",
    "save_write_s": f"{BENCH} 'Checkpoints': sync save 0.78 s (1.2 GB, run 1 median): when an async save is durable",
    "snapshot_stall_s": f"{BENCH} 'Memory tier': one overlapped 1.2 GB snapshot costs 0.17 s",
    "snapshot_write_s": f"{BENCH} 'Memory tier': copy to written 0.55 s (1.2 GB)",
    "detect_process_s": f"{BENCH} 'Recovery after a worker is SIGKILLed': kill -> new worker process 1.13 s (c10d)",
    "detect_node_s": "bench/results/detection-2026-11-28b.json (bench/detection.py, docs/goodput.md 'Detection'): a "
    "silent node (SIGSTOPped or partitioned) to the survivor's new worker, 28.6-29.7 s under c10d and etcd-v2 at the "
    "defaults (step watchdog 25 s + gentrain launch's last call 2 s), the slowest taken; a killed node 14.3-16.2 s. "
    "At torch's own rendezvous defaults (last call 30 s) 56.2-56.7 s (detection-2026-11-28.json); a fixed-size job "
    f"whose fresh agent joins at once: 13.5 s ({BENCH} 'Memory tier')",
    "first_start_s": "startup_s unless given",
    "state_gb_per_gpu": f"the state the save figures were measured with ({BENCH} 'Checkpoints': 100M parameters + "
    "AdamW, 1.21 GB; about DiT-XL/2 with AdamW sharded over one 8-GPU node)",
    "store_gbps": "unbounded unless given: each node writes and reads at its own disk's measured rate; give your "
    "store's aggregate bandwidth (GB/s) to bound saves and restores by gpus x state / bandwidth",
}


@dataclass(frozen=True)
class Policy:
    """One lever's settings and its checkpoint intervals, in steps."""

    memory: bool
    compile_cache: bool
    durable_every: int
    memory_every: int  # 0 without the memory tier


@dataclass(frozen=True)
class Failure:
    time_s: float
    node: int
    kind: str


@dataclass
class Outcome:
    seconds: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    replayed: list = field(default_factory=list)  # per failure: time, node, kind, phase hit, resumed_from, steps redone

    @property
    def goodput(self) -> float:
        total = sum(self.seconds.values())
        return self.seconds["train"] / total if total else 0.0


class TraceError(ValueError):
    """A trace file that cannot be read as failures (exit 2)."""


# ------------------------------------------------------------------ the simulation


def _stall(p: Policy, c: Costs) -> tuple[float, float]:
    """Stall per durable save and per snapshot: the save's own, plus the previous write's remainder when the
    interval is shorter than a write (one save in flight at a time)."""
    durable = c.save_stall_s + max(0.0, c.save_write_s - p.durable_every * c.step_s)
    memory = c.snapshot_stall_s + max(0.0, c.snapshot_write_s - p.memory_every * c.step_s) if p.memory else 0.0
    return durable, memory


def simulate(c: Costs, p: Policy, failures: list[Failure], horizon_s: float) -> Outcome:
    """Replay `failures` (sorted by time) over `horizon_s` seconds of a job's wall time; every second lands in
    exactly one category. Steps are numbered from 0 (the start); saves land at multiples of the intervals."""
    out = Outcome()
    sec = out.seconds
    s = c.step_s
    cd, cm = _stall(p, c)

    def stalls(a: int, b: int) -> float:  # stall time of the saves after steps a+1..b
        t = cd * (b // p.durable_every - a // p.durable_every)
        return t + (cm * (b // p.memory_every - a // p.memory_every) if p.memory else 0.0)

    def done_at(t0: float, p0: int, j: int) -> float:  # when step j (and its saves) is done, from p0 at t0
        return t0 + (j - p0) * s + stalls(p0, j)

    def last_step(t0: float, p0: int, until: float) -> int:  # the newest step done by `until`
        lo, hi = p0, p0 + int((until - t0) / s) + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if done_at(t0, p0, mid) <= until:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def newest_save(t0: float, p0: int, reached: int, every: int, write: float, until: float) -> int:
        """The newest save (multiple of `every`) after p0 whose write was complete by `until`; p0 if none."""
        j = reached // every * every
        while j > p0 and done_at(t0, p0, j) + write > until:
            j -= every
        return max(j, p0)

    t, durable, memory = 0.0, 0, None  # memory: the newest snapshot's step, None when there is none
    resumed = 0  # the step the job trains from
    first, replaced, detect = True, True, 0.0  # the first start is a cold start
    i = 0
    while t < horizon_s:
        # The (re)start: detection, start-up, compile, restore; a failure during it begins it again.
        from_memory = p.memory and memory is not None and memory >= durable
        start = c.first_start_s if (first and c.first_start_s is not None) else c.startup_s
        if first:  # nothing compiled yet anywhere
            compile_s = c.compile_cold_s
        elif replaced:  # a replacement node's local cache is empty
            compile_s = c.compile_cached_s if p.compile_cache else c.compile_cold_s
        else:
            compile_s = c.compile_warm_s
        restore = 0.0 if first else (c.restore_memory_s if from_memory else c.restore_store_s)
        phases = [("detection", detect), ("startup", start), ("compile", compile_s), ("restore", restore)]
        hit = None
        for cat, length in phases:
            end = min(t + length, horizon_s)
            if i < len(failures) and failures[i].time_s < end:
                sec[cat] += max(0.0, failures[i].time_s - t)
                t = max(t, failures[i].time_s)
                hit = cat
                break
            sec[cat] += end - t
            t = end
        if t >= horizon_s and hit is None:
            break
        if hit is not None:
            f = failures[i]
            i += 1
            if f.kind == "job":
                memory = None
            replaced = replaced or f.kind in ("node", "job")
            detect = c.detect_process_s if f.kind == "process" else c.detect_node_s
            out.replayed.append({**asdict(f), "phase": hit, "resumed_from": resumed, "steps_redone": 0})
            continue
        first = False
        resumed = memory if from_memory else durable
        # Training from `resumed` until the next failure or the horizon.
        t0, p0 = t, resumed
        next_failure = failures[i].time_s if i < len(failures) else math.inf
        until = min(next_failure, horizon_s)
        reached = last_step(t0, p0, until)
        if next_failure >= horizon_s:
            sec["train"] += (reached - p0) * s
            sec["checkpoint_stall"] += stalls(p0, reached)
            sec["idle"] += horizon_s - done_at(t0, p0, reached)
            t = horizon_s
            break
        f = failures[i]
        i += 1
        durable = max(durable, newest_save(t0, p0, reached, p.durable_every, c.save_write_s, until))
        if p.memory:
            snap = newest_save(t0, p0, reached, p.memory_every, c.snapshot_write_s, until)
            # the step resumed from stays in memory until a newer snapshot replaces it
            memory = None if f.kind == "job" else max(snap, memory if memory is not None else 0)
        back_to = max(durable, memory if memory is not None else -1)
        kept = max(back_to, p0)
        sec["train"] += (kept - p0) * s
        sec["checkpoint_stall"] += stalls(p0, kept)
        sec["redone"] += (until - t0) - (kept - p0) * s - stalls(p0, kept)
        if back_to < p0:  # a job failure took the snapshot trained from: steps kept before are lost too
            moved = (p0 - back_to) * s
            sec["train"] -= moved
            sec["checkpoint_stall"] -= stalls(back_to, p0)
            sec["redone"] += moved + stalls(back_to, p0)
        out.replayed.append(
            {
                **asdict(f),
                "phase": "train",
                "reached": reached,
                "resumed_from": back_to,
                "steps_redone": reached - back_to,
            }
        )
        t = until
        replaced = f.kind in ("node", "job")
        detect = c.detect_process_s if f.kind == "process" else c.detect_node_s
    return out


# ------------------------------------------------------------------ failures and intervals


def poisson_failures(
    rate_per_gpu_hour: float, gpus: int, gpus_per_node: int, horizon_s: float, mix: dict[str, float], seed: int
) -> list[Failure]:
    """Failures of a job of `gpus` GPUs: a Poisson process at gpus x rate, each on a node drawn uniformly and
    of a kind drawn from `mix`."""
    rng = np.random.default_rng(seed)
    per_s = rate_per_gpu_hour * gpus / 3600.0
    n = rng.poisson(per_s * horizon_s)
    times = np.sort(rng.uniform(0.0, horizon_s, n))
    nodes = rng.integers(0, max(1, gpus // gpus_per_node), n)
    kinds = rng.choice(list(mix), size=n, p=np.array(list(mix.values())) / sum(mix.values()))
    return [Failure(float(t), int(nd), str(k)) for t, nd, k in zip(times, nodes, kinds, strict=True)]


def young_daly_s(stall_s: float, mtbf_s: float) -> float:
    """Young (1974) / Daly (2006): the interval that minimizes stall/interval + (interval/2)/MTBF."""
    return math.sqrt(2.0 * stall_s * mtbf_s)


def policy(
    lever: str,
    c: Costs,
    mtbf_s: float,
    mix: dict[str, float],
    max_interval_s: float,
    durable_every_s: float | None = None,
    memory_every_s: float | None = None,
) -> tuple[Policy, dict]:
    """The lever's intervals: fixed where given, else Young/Daly for the failures each tier recovers."""
    memory = lever != "durable"
    total = sum(mix.values())
    share_job = mix.get("job", 0.0) / total
    durable_mtbf = mtbf_s / share_job if memory and share_job > 0 else (math.inf if memory else mtbf_s)
    how = {}

    def steps(fixed: float | None, stall: float, tier_mtbf: float, name: str) -> int:
        if fixed is not None:
            seconds, how[name] = fixed, "fixed"
        else:
            seconds = min(young_daly_s(stall, tier_mtbf), max_interval_s)
            how[name] = "young-daly" + (" (bounded by --max-interval-minutes)" if seconds == max_interval_s else "")
        how[f"{name}_mtbf_s"] = round(tier_mtbf, 1) if math.isfinite(tier_mtbf) else None
        if fixed is None and seconds < write:  # one save in flight at a time: a shorter interval only waits
            seconds, how[name] = write, "the write's length (Young/Daly's was shorter)"
        return max(1, round(seconds / c.step_s))

    write = c.save_write_s
    durable_every = steps(durable_every_s, c.save_stall_s, durable_mtbf, "durable")
    write = c.snapshot_write_s
    memory_every = (
        steps(memory_every_s, c.snapshot_stall_s, mtbf_s / max(1e-12, 1 - share_job), "memory") if memory else 0
    )
    p = Policy(memory, lever == "memory+compile_cache", durable_every, memory_every)
    how.update(durable_every_steps=durable_every, memory_every_steps=memory_every or None)
    return p, how


def read_trace(path: str, nodes: int | None = None) -> tuple[list[Failure], float | None]:
    """Failures from a CSV (`time_s,node,kind`) or JSON ({"failures": [...], "duration_s": ...}) file;
    TraceError naming the file, the row and the fix for anything else."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceError(f"cannot read {path}: {e}") from None
    duration = None
    if path.endswith(".json"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise TraceError(
                f'{path} is not JSON ({e}); write {{"failures": [{{"time_s": 3600, "node": 0, "kind": "node"}}]}}'
            ) from None
        if not isinstance(doc, dict) or not isinstance(doc.get("failures"), list):
            raise TraceError(f'{path}: expected an object with a "failures" list, got {type(doc).__name__}')
        rows, duration = doc["failures"], doc.get("duration_s")
    else:
        reader = csv.DictReader(text.splitlines())
        if reader.fieldnames is None or [f.strip() for f in reader.fieldnames] != ["time_s", "node", "kind"]:
            raise TraceError(f"{path}: the first line must be the header time_s,node,kind (got {reader.fieldnames})")
        rows = list(reader)
    failures = []
    for n, row in enumerate(rows, start=1):
        try:
            time_s, node, kind = float(row["time_s"]), int(row["node"]), str(row["kind"]).strip()
        except (KeyError, TypeError, ValueError) as e:
            raise TraceError(
                f"{path}: failure {n} ({row!r}) needs time_s (seconds), node (integer), kind: {e}"
            ) from None
        if not math.isfinite(time_s) or time_s < 0:
            raise TraceError(f"{path}: failure {n} has time_s={row['time_s']!r}; a time is seconds >= 0 since launch")
        if kind not in KINDS:
            raise TraceError(f"{path}: failure {n} has kind={kind!r}; use one of {', '.join(KINDS)}")
        if node < 0 or (nodes is not None and node >= nodes):
            raise TraceError(f"{path}: failure {n} has node={node}; the job has nodes 0..{(nodes or 1) - 1}")
        failures.append(Failure(time_s, node, kind))
    if duration is not None and (not isinstance(duration, int | float) or duration <= 0):
        raise TraceError(f"{path}: duration_s={duration!r}; give the job's length in seconds (> 0) or leave it out")
    return sorted(failures, key=lambda f: f.time_s), duration


# ------------------------------------------------------------------ calibration: the same failures, for real

# The calibration job is of fixed size (--nnodes=2): its lost node's replacement agent joins at once, so its
# detection is that case's, not the elastic silent node's of `detect_node_s`.
CALIBRATION_DETECT_NODE_S = 13.5
# A restart's compile from the run's compile cache, as a share of the cold compile: CPU, 2-block DiT, the median
# of bench/results/compile-cache-cpu-2026-11-28.json (0.111-0.118x).
CALIBRATION_CACHED_RATIO = 0.114
COMPILED_DIT = "{kind: dit, num_layers: 2, num_attention_heads: 2, attention_head_dim: 8}"
CALIBRATION_DETECT_NODE_SOURCE = (
    f"{BENCH} 'Memory tier': node loss, kill -> rank 0's new process 13-14 s (c10d, --nnodes=2, a fresh agent "
    "joining at once: the calibration job's own case)"
)


def _calibration_run(memory: bool, every: int, schedule: tuple[float, float, float], compiled: bool = False) -> dict:
    """Two torchrun agents on 127.0.0.1 as two nodes (bench/memory_tier.py's Job: FSDP, c10d hosted by agent a,
    a small UNet, one thread), launched at t = 0; a `process` failure (agent a's worker SIGKILLed) at the first
    schedule time (or 3 s after the first step, if later), a `node` failure (agent b and its worker SIGKILLed,
    its memory folder deleted, a fresh agent started) at the second (or 5 s after the job trains again), and the
    end at the third (or 15 s after it trains again). Step lines are timed as they arrive (polled every 20 ms).
    `compiled`: train.compile=true with the run's compile cache (GENTRAIN_COMPILE_CACHE_KEY), each agent with a
    local inductor cache of its own, so the fresh agent starts with an empty one, as a replacement node does."""
    import os
    import shutil
    import signal
    import tempfile
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import memory_tier as mt  # noqa: PLC0415 (the two-agent job and its kill helpers)

    with tempfile.TemporaryDirectory(prefix="gentrain-goodput-") as tmp:
        job = mt.Job(
            Path(tmp),
            memory,
            every,
            [
                "checkpoint.memory_every_steps=1",
                # a hang bound; compiling ranks wait for each other in the first step's collectives
                f"elastic.collective_timeout_seconds={600 if compiled else 120}",
                # compiled: the model whose cache ratio was measured (bench/compile_cache.py's 2-block DiT)
                *(["train.compile=true", f"model.backbone={COMPILED_DIT}"] if compiled else []),
            ],
        )
        if compiled:
            job.node_env = {
                node: {"TORCHINDUCTOR_CACHE_DIR": f"{tmp}/inductor-{node}", "GENTRAIN_COMPILE_CACHE_KEY": "calibration"}
                for node in ("a", "b", "b2")
            }
        offsets: dict[Path, int] = {}
        lines: list[tuple[float, int]] = []  # (arrival, step) of rank 0's step lines, in arrival order
        starts: list[tuple[float, int]] = []  # (arrival, resumed step) of each start at world size 2

        def poll() -> None:
            now = time.time() - launched
            for log in list(job.logs):
                if not log.exists():
                    continue
                with open(log, errors="replace") as f:
                    f.seek(offsets.get(log, 0))
                    text = f.read()
                cut = text.rfind("\n") + 1
                offsets[log] = offsets.get(log, 0) + len(text[:cut].encode())
                for line in text[:cut].splitlines():
                    m = mt.STEP.match(line)
                    if m:
                        lines.append((now, int(m.group(1))))
                    m = mt.START.match(line)
                    if m and m.group(1) == "2":
                        starts.append((now, int(m.group(3))))

        def wait(what: str, done, deadline_s: float = 900.0 if compiled else 240.0) -> None:  # a hang bound
            end = time.time() + deadline_s
            while not done():
                for node, proc in job.procs.items():
                    if proc.poll() is not None and node not in job.lost:
                        raise RuntimeError(f"agent {node} exited {proc.returncode}:\n{job.texts()[-1][-3000:]}")
                if time.time() > end:
                    raise TimeoutError(
                        f"{what} not seen within {deadline_s} s:\n" + "\n".join(t[-2000:] for t in job.texts())
                    )
                time.sleep(0.02)
                poll()

        def current() -> int:
            return lines[-1][1] if lines else 0

        def trains_again(n_starts: int):
            return lambda: len(starts) > n_starts and lines and lines[-1][0] > starts[n_starts][0]

        kills: list[dict] = []

        def fail(kind: str, at: float) -> None:
            wait(f"t={at:.1f}", lambda: time.time() - launched >= at)
            reached, n = current(), len(starts)
            t = time.time() - launched
            if kind == "process":
                os.kill(mt.worker_of(job.procs["a"]), signal.SIGKILL)
            else:
                job.lost.add("b")
                mt.kill_tree(job.procs["b"])
                shutil.rmtree(job.shm("b"), ignore_errors=True)
                job.start("b2")
            wait(f"training after the {kind} failure", trains_again(n))
            first = next(a for a, _ in lines if a > starts[n][0])
            kills.append(
                {
                    "time_s": round(t, 3),
                    "node": 0 if kind == "process" else 1,
                    "kind": kind,
                    "reached": reached,
                    "resumed_from": starts[n][1],
                    "steps_redone": reached - starts[n][1],
                    "recovery_s": round(first - t, 3),
                }
            )

        launched = time.time()
        try:
            job.start("a")
            time.sleep(1.0)  # a hosts the rendezvous: let it start first (as memory_tier.py does)
            job.start("b")
            wait("the first steps", lambda: current() >= 5)
            first_step = lines[0][0]
            timings = [json.loads(t) for text in job.texts() for t in mt.TIMINGS.findall(text)]
            fail("process", max(schedule[0], lines[-1][0] + 3))
            fail("node", max(schedule[1], time.time() - launched + 5))
            end = max(schedule[2], time.time() - launched + 15)
            wait("the end", lambda: time.time() - launched >= end)
            poll()
            final_step = current()
            texts = job.texts()
        finally:
            job.close()
    # The pace: every step's gap but those across a (re)start (first step after a start, or a step redone).
    gaps, prev = [], None
    for a, st in lines:
        if prev is not None and st == prev[1] + 1 and not any(prev[0] < b <= a for b, _ in starts):
            gaps.append(a - prev[0])
        prev = (a, st)
    step_s = float(np.mean(gaps))
    ordered = sorted(timings, key=lambda t: t["first_step_unix"])
    cold = ordered[0]
    compile_cold = float(cold.get("compile", 0.0))  # inside the first step: counted apart from the start-up
    startup = cold["first_step_unix"] - cold["process_start_unix"] - cold.get("resume", 0.0) - step_s - compile_cold
    after = sorted(
        (json.loads(t) for text in texts for t in mt.TIMINGS.findall(text)), key=lambda t: t["first_step_unix"]
    )
    for k, t in zip(kills, after[1:], strict=False):  # kill -> the restarted rank 0's process (about 1 s high: /proc)
        k["restart_s"] = round(t["process_start_unix"] - launched - k["time_s"], 3)
        k["rank0_compile_s"] = t.get("compile", 0.0)
    return {
        "memory": memory,
        "compile_cache": compiled,
        "compile_cold_s": round(compile_cold, 3),
        "durable_every_steps": every,
        "duration_s": round(end, 3),
        "first_step_s": round(first_step, 3),
        "final_step": final_step,
        "step_s": round(step_s, 4),
        "worker_startup_s": round(startup, 3),
        "failures": kills,
    }


def calibrate(args) -> dict:
    """Run the failure schedule for real, once per lever of `--calibrate-levers` (durable tier only; memory tier on;
    memory tier and compile cache with train.compile=true), and replay it through the model. Inputs: the run's pace (the mean gap between consecutive steps, saves and snapshots included, gaps
    across a restart left out), its failure-free cold start (launch to the first step; a worker's start to its
    first step), restore of this small state 0.25 s (docs/benchmarks.md 'Memory tier'), and detection two ways:
    `docs`, the quiet-machine figures of docs/benchmarks.md (`--detect-process-s`, `--detect-node-s`), and
    `in_run`, the agents' restart measured in this run (kill -> the restarted rank 0's process). What the model
    predicts from them: where each failure finds the job, the steps redone, the restarts' start-up and restore.
    Lost time = wall time - the steps the job holds at the end x the pace."""
    every = 20
    runs, rows = {}, []
    for name in args.calibrate_levers.split(","):
        if name not in LEVERS:
            raise SystemExit(f"goodput: --calibrate-levers: {name!r} is none of {', '.join(LEVERS)}")
        memory, compiled = name != "durable", name == "memory+compile_cache"
        r = _calibration_run(memory, every, (12.0, 30.0, 60.0), compiled)
        # With the compile cache the restarts compile from a cache: their compile is the cold one's measured
        # ratio (bench/compile_cache.py on CPU), never the restarts' own figures, which the model predicts.
        cached = r["compile_cold_s"] * CALIBRATION_CACHED_RATIO
        trace = [Failure(k["time_s"], k["node"], k["kind"]) for k in r["failures"]]
        measured = r["duration_s"] - r["final_step"] * r["step_s"]
        runs[name] = {**r, "predicted": {}}
        row = {"lever": name, "duration_s": r["duration_s"], "lost_measured_s": round(measured, 2)}
        in_run = {k["kind"]: k.get("restart_s") for k in r["failures"]}
        for way, detect in (
            ("docs", (args.detect_process_s, CALIBRATION_DETECT_NODE_S)),
            ("in_run", (in_run["process"], in_run["node"])),
        ):
            c = Costs(
                step_s=r["step_s"],  # saves and snapshots included: their stall is inside the pace
                first_start_s=r["first_step_s"] - r["step_s"] - r["compile_cold_s"],
                startup_s=r["worker_startup_s"],
                compile_cold_s=r["compile_cold_s"],  # 0 with train.compile off
                compile_cached_s=cached,
                compile_warm_s=cached,  # a node that stayed: its warm local cache, as the model assumes
                restore_store_s=0.25,
                restore_memory_s=0.25,
                save_stall_s=0.0,
                save_write_s=r["step_s"],
                snapshot_stall_s=0.0,
                snapshot_write_s=r["step_s"],
                detect_process_s=detect[0],
                detect_node_s=detect[1],
            )
            o = simulate(c, Policy(memory, compiled, every, 1 if memory else 0), trace, r["duration_s"])
            predicted = r["duration_s"] - o.seconds["train"]
            runs[name]["predicted"][way] = {
                "detection_s": {"process": detect[0], "node": detect[1]},
                "seconds": {k: round(v, 3) for k, v in o.seconds.items()},
                "steps_redone": [m["steps_redone"] for m in o.replayed],
            }
            row[f"lost_predicted_{way}_s"] = round(predicted, 2)
            row[f"predicted_{way}_over_measured"] = round(predicted / measured, 3)
        rows.append(row)
    return {
        "bench": "goodput.calibrate",
        "setup": "2 torchrun agents on 127.0.0.1 as 2 nodes (bench/memory_tier.py Job: FSDP, c10d, digits-ddpm small "
        "UNet, 1 thread), durable every 20 steps, memory tier every step when on; failures: a worker SIGKILLed "
        "(process), then agent b with its worker SIGKILLed and its memory folder deleted, a fresh agent joining (node); "
        "memory+compile_cache: train.compile=true on bench/compile_cache.py's 2-block DiT, the run's signed compile cache, a local inductor cache per agent "
        f"(the fresh agent's empty); a restart's compile predicted as {CALIBRATION_CACHED_RATIO} x the cold one's",
        "detection_inputs_s": {
            "process": args.detect_process_s,
            "node": CALIBRATION_DETECT_NODE_S,
            "source": [SOURCES["detect_process_s"], CALIBRATION_DETECT_NODE_SOURCE],
        },
        "calibration": rows,
        "within_20_percent": {
            way: all(abs(r[f"predicted_{way}_over_measured"] - 1) <= 0.2 for r in rows) for way in ("docs", "in_run")
        },
        "runs": runs,
    }


# ------------------------------------------------------------------ the table


def inputs(c: Costs, mix: dict[str, float], max_interval_s: float) -> dict:
    units = {"state_gb_per_gpu": "GB", "store_gbps": "GB/s"}
    out = {
        name: {
            "value": value if value is None or math.isfinite(value) else None,
            "unit": units.get(name, "s"),
            "source": SOURCES[name],
        }
        for name, value in asdict(c).items()
    }
    out["failure_mix"] = {
        "value": mix,
        "source": "Llama 3's 419 interruptions by cause: process = software bugs 54 + NCCL watchdog 7 + dependencies 2 "
        "(63/419); job = network switch/cable 35/419, assumed to take a node with its memory-tier buddy; node = the rest "
        "(hardware: GPU, HBM3, host)",
    }
    out["max_interval_s"] = {
        "value": max_interval_s,
        "unit": "s",
        "source": "assumed bound (checkpoint.max_interval_minutes)",
    }
    return out


def model_row(c: Costs, lever: str, gpus: int, rate: float, args, mix: dict[str, float]) -> dict:
    c = at_scale(c, gpus)
    mtbf_s = 3600.0 / (rate * gpus)
    horizon = max(args.min_failures * mtbf_s, 86400.0)
    p, how = policy(lever, c, mtbf_s, mix, args.max_interval_minutes * 60, args.durable_every_s, args.memory_every_s)
    fails = poisson_failures(rate, gpus, args.gpus_per_node, horizon, mix, args.seed)
    o = simulate(c, p, fails, horizon)
    total = sum(o.seconds.values())
    return {
        "goodput": round(o.goodput, 4),
        "mtbf_hours": round(mtbf_s / 3600, 3),
        "failures": len(fails),
        "simulated_days": round(horizon / 86400, 1),
        "intervals": how,
        "lost_share": {k: round(v / total, 5) for k, v in o.seconds.items() if k != "train"},
        "seconds_per_failure": {k: round(v / max(1, len(fails)), 2) for k, v in o.seconds.items() if k != "train"},
        "save_write_s": round(c.save_write_s, 2),
        "restore_store_s": round(c.restore_store_s, 2),
    }


def table(c: Costs, args, mix: dict[str, float]) -> dict:
    rates = (
        {args.rate: RATES[args.rate]}
        if args.rate_per_gpu_hour is None
        else {"given": {"per_gpu_hour": args.rate_per_gpu_hour, "source": "--rate-per-gpu-hour"}}
    )
    if args.rate_per_gpu_hour is None and args.all_rates:
        rates = {args.rate: RATES[args.rate], **{k: v for k, v in RATES.items() if k != args.rate}}
    results: dict = {}
    for name, r in rates.items():
        results[name] = {
            str(g): {lever: model_row(c, lever, g, r["per_gpu_hour"], args, mix) for lever in LEVERS}
            for g in args.scales
        }
    default = next(iter(rates))
    met = {
        str(g): {"target": t, "goodput": results[default][str(g)]["memory+compile_cache"]["goodput"]}
        for g, t in TARGETS.items()
        if str(g) in results[default]
    }
    for v in met.values():
        v["met"] = v["goodput"] >= v["target"]
    return {
        "bench": "goodput",
        "model": "bench/goodput.py: event-by-event failure replay, Young/Daly intervals unless fixed",
        "levers": LEVERS,
        "rates": {
            k: {**v, "mtbf_hours": {str(g): round(1 / (v["per_gpu_hour"] * g), 2) for g in SCALES}}
            for k, v in rates.items()
        },
        "default_rate": default,
        "seed": args.seed,
        "gpus_per_node": args.gpus_per_node,
        "inputs": inputs(c, mix, args.max_interval_minutes * 60),
        "results": results,
        "targets": met,
    }


def replay(c: Costs, args, mix: dict[str, float]) -> dict:
    nodes = max(1, args.gpus // args.gpus_per_node)
    failures, duration = read_trace(args.trace, nodes)
    c = at_scale(c, args.gpus)
    horizon = args.hours * 3600 if args.hours else duration or ((failures[-1].time_s if failures else 0.0) + 3600.0)
    observed = len([f for f in failures if f.time_s < horizon])
    mtbf_s = horizon / observed if observed else math.inf
    results = {}
    for lever in LEVERS:
        p, how = policy(
            lever,
            c,
            mtbf_s if math.isfinite(mtbf_s) else 1e12,
            mix,
            args.max_interval_minutes * 60,
            args.durable_every_s,
            args.memory_every_s,
        )
        o = simulate(c, p, failures, horizon)
        results[lever] = {
            "goodput": round(o.goodput, 4),
            "intervals": how,
            "seconds": {k: round(v, 3) for k, v in o.seconds.items()},
            "failures": o.replayed,
        }
    return {
        "bench": "goodput.replay",
        "trace": args.trace,
        "gpus": args.gpus,
        "duration_s": horizon,
        "failures_in_trace": len(failures),
        "mtbf_s_of_trace": round(mtbf_s, 1) if math.isfinite(mtbf_s) else None,
        "inputs": inputs(c, mix, args.max_interval_minutes * 60),
        "results": results,
    }


def parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for part in text.split(","):
        kind, _, share = part.partition("=")
        if kind.strip() not in KINDS:
            raise SystemExit(
                f"goodput: --mix: unknown kind {kind.strip()!r}; use {', '.join(KINDS)} (e.g. process=0.15,node=0.77,job=0.08)"
            )
        try:
            mix[kind.strip()] = float(share)
        except ValueError:
            raise SystemExit(f"goodput: --mix: {part!r} needs kind=share") from None
    if sum(mix.values()) <= 0 or any(v < 0 for v in mix.values()):
        raise SystemExit(f"goodput: --mix={text!r}: shares must be >= 0 and not all 0")
    return mix


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--scales", type=int, nargs="+", default=list(SCALES), help="GPU counts of the table")
    ap.add_argument("--rate", choices=list(RATES), default=DEFAULT_RATE, help="the published failure rate")
    ap.add_argument("--rate-per-gpu-hour", type=float, help="a failure rate of your own")
    ap.add_argument("--no-other-rates", dest="all_rates", action="store_false", help="only the chosen rate")
    ap.add_argument("--mix", default="process=0.150,node=0.766,job=0.084", help="failure kinds' shares")
    ap.add_argument("--min-failures", type=int, default=2000, help="simulate this many MTBFs (at least a day)")
    ap.add_argument("--max-interval-minutes", type=float, default=60.0)
    ap.add_argument("--durable-every-s", type=float, help="fixed durable interval (default: Young/Daly)")
    ap.add_argument("--memory-every-s", type=float, help="fixed snapshot interval (default: Young/Daly)")
    ap.add_argument("--trace", help="replay this CSV/JSON file of failures instead of Poisson")
    ap.add_argument("--gpus", type=int, default=1024, help="with --trace: the job's GPUs")
    ap.add_argument("--hours", type=float, help="with --trace: the job's length (default: the trace's duration_s)")
    ap.add_argument("--calibrate", action="store_true", help="run the failure schedule for real and compare")
    ap.add_argument(
        "--calibrate-levers",
        default="durable,memory,memory+compile_cache",
        help="with --calibrate: the levers run for real (memory+compile_cache: train.compile=true)",
    )
    for name, value in asdict(Costs()).items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=value, help=SOURCES[name])
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    c = Costs(**{k: getattr(args, k) for k in asdict(Costs())})
    mix = parse_mix(args.mix)
    if args.calibrate:
        result = calibrate(args)
    elif args.trace:
        try:
            result = replay(c, args, mix)
        except TraceError as e:
            print(f"goodput: trace error: {e}", file=sys.stderr)
            return 2
    else:
        result = table(c, args, mix)
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
