"""Memory-tier benchmark: steps lost and recovery time per failure, and what a snapshot costs a step.

Three measurements, each its own sub-command printing one JSON object (`all` runs the three and
prints one object holding them):

node-loss   Two torchrun agents on 127.0.0.1 are two nodes (`--nnodes=2 --nproc-per-node=1`, FSDP,
            c10d rendezvous hosted by agent a, each agent its own memory folder through
            GENTRAIN_CHECKPOINT__MEMORY_DIR), training the digits-ddpm preset with a small UNet,
            durable checkpoints every `--every` steps. Per run, two failures:
              1. a worker crash: rank-agnostic SIGKILL of agent a's worker at a step drawn in
                 (every, 2*every), once the first durable checkpoint is committed; torchrun restarts
                 the workers of both agents;
              2. a node loss: agent b and its worker SIGKILLed at once, b's memory folder deleted, a
                 fresh agent started in its place, at a step drawn `every`..2*`every` steps after the
                 step the first failure resumed from.
            Steps lost = the newest step rank 0 logged before the kill (either agent; rank 0 logs
            every step) minus the step the next start resumed from (rank 0's start line). Recovery =
            kill -> the first step of the restarted job (rank 0's startup timings). Each repeat runs
            the memory tier on (`checkpoint.memory=true`) and off (durable tier only) with the same
            drawn kill steps, in alternating order. Goal (issue): at most 1 step lost with the memory
            tier, against up to `every` without.
overhead    One process, the digits-ddpm preset as it is (its model, `train.threads` default), no durable
            saves but the final one: processes with a memory snapshot every `--memory-every` steps (1
            and 10) alternate with processes without, the same seed and steps; a step's time is the wall time between
            consecutive step lines as this script sees them arrive (so it includes the snapshot's
            `save` call, its fence waits, and the writer threads competing for the cores).
            Goal (issue): at most 3% slower.
big         bench/checkpoint.py's state (100M float32 parameters + fused AdamW, about 1.2 GB) in one
            process: the training step of bench/checkpoint.py with gentrain's own MemoryTier and
            Checkpointer (what CheckpointManager.save_to_memory does on one rank) saving into a tmpfs
            folder. Windows of steps with a snapshot every k steps alternate with windows without;
            overhead = time with / time without - 1, for k = 1 and for the smallest k at which one
            snapshot's cost (a window of one snapshot and the steps its write takes, against the same
            steps without) is within 3% of k steps (then measured: k steps with one snapshot against k
            steps without). Parts of one snapshot, measured
            alone: the copy of the state, blake3 of its bytes (one thread), the write into tmpfs.

Usage: python bench/memory_tier.py {node-loss,overhead,big,all} [--repeats N] [--seed S] ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^\S+ INFO (?:\[rank \d+\] )?step=(\d+)/", re.M)
START = re.compile(
    r"^\S+ INFO (?:\[rank \d+\] )?gentrain \S+ .*world_size=(\d+) restart=\d+ .*resumed_from=(\S+) step=(\d+)(?: steps_lost=(\d+))?",
    re.M,
)
TIMINGS = re.compile(r"startup timings \(s\): (\{.*\})")
SMALL_UNET = ["model.block_out_channels=[16,32]", "model.norm_num_groups=8", "train.batch_size=16"]
QUIET = ["train.log_every_steps=1", "train.val_every_steps=0", "sample.every_steps=0"]


def spread(values: list[float], digits: int = 3) -> dict:
    # inclusive: with a few values the quartiles stay between min and max
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "quartiles": [round(q[0], digits), round(q[2], digits)],
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENTRAIN_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO), **extra)
    return env


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc; torchrun's workers run in sessions of their own)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parents.items() if pp == p]
        out += kids
        todo += kids
    return out


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the agent and everything below it at once (the node is gone), by the PIDs found under it."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


# ------------------------------------------------------------------ node loss and recovery


class Job:
    """Two torchrun agents as two nodes; agent a hosts the c10d rendezvous, b is the one lost."""

    def __init__(self, tmp: Path, memory: bool, every: int, extra: list[str]):
        self.tmp, self.memory, self.every, self.extra = tmp, memory, every, extra
        port = free_port()
        self.torchrun = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--max-restarts=5",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id=bench-{port}",
            "--rdzv-conf=join_timeout=300,last_call_timeout=1",
            "--monitor-interval=0.1",
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list[Path] = []
        self.lost: set[str] = set()  # agents killed on purpose
        self.node_env: dict[str, dict[str, str]] = {}  # a node's own environment (bench/goodput.py's compile run)

    def shm(self, node: str) -> Path:
        return self.tmp / f"shm-{node}"

    def start(self, node: str) -> subprocess.Popen:
        log = self.tmp / f"{node}.log"
        args = [
            "digits-ddpm",
            *SMALL_UNET,
            *QUIET,
            "train.parallel=fsdp",
            "train.threads=1",
            "train.max_steps=1000000",
            f"run.dir={self.tmp}/run-{node}",
            f"checkpoint.url={self.tmp}/checkpoints",
            f"checkpoint.every_steps={self.every}",
            f"checkpoint.memory={'true' if self.memory else 'false'}",
            "elastic.collective_timeout_seconds=120",  # a hang bound only (at least 2 x lease + 60: the lease check)
            *self.extra,
        ]
        cmd = [sys.executable, "-m", "torch.distributed.run", *self.torchrun, "-m", "trainer", "train", *args]
        env = clean_env(
            OMP_NUM_THREADS="1",
            GENTRAIN_CHECKPOINT__MEMORY_DIR=str(self.shm(node)),
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # a fresh store per round, as `gentrain launch` sets
            **self.node_env.get(node, {}),
        )
        proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[node] = proc
        self.logs.append(log)
        return proc

    def texts(self) -> list[str]:
        return [log.read_text(errors="replace") if log.exists() else "" for log in self.logs]

    def starts(self) -> list[tuple[str, int, int | None]]:
        """(resumed_from, step, steps lost as the trainer counted them) of every start at world size 2, in the order they happened (by the lines'
        time stamps: restarts are seconds apart)."""
        found = [
            (m.group(0)[:19], m.group(2), int(m.group(3)), int(m.group(4)) if m.group(4) else None)
            for text in self.texts()
            for m in START.finditer(text)
            if m.group(1) == "2"
        ]
        return [start[1:] for start in sorted(found)]

    def newest_step(self) -> int:
        """The newest step rank 0 logged, on any agent (rank 0 logs every step)."""
        return max((int(s) for text in self.texts() for s in STEP.findall(text)), default=0)

    def timings(self) -> list[dict]:
        """Rank 0's startup timings of every (re)start, in order."""
        found = [json.loads(t) for text in self.texts() for t in TIMINGS.findall(text)]
        return sorted(found, key=lambda t: t["first_step_unix"])

    def wait(self, what: str, done, timeout: float = 600):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = done()
            if value:
                return value
            for node, proc in self.procs.items():
                if proc.poll() is not None and node not in self.lost:
                    raise RuntimeError(f"agent {node} exited {proc.returncode}:\n{self.texts()[-1][-4000:]}")
            time.sleep(0.02)
        raise TimeoutError(f"{what} not seen within {timeout}s:\n" + "\n".join(t[-3000:] for t in self.texts()))

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_tree(proc)


def worker_of(agent: subprocess.Popen) -> int:
    """The training worker torchrun started (the agent's child running `-m trainer`)."""
    for pid in descendants(agent.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"trainer" in f.read().split(b"\0"):
                    return pid
        except OSError:
            continue
    raise RuntimeError("worker not found")


def failure(job: Job, kill_at: int, kill) -> dict:
    """Wait for step `kill_at`'s line, fail (kill()), then wait for the job's next start and first step."""
    n_starts, n_timings = len(job.starts()), len(job.timings())
    job.wait(f"step {kill_at}", lambda: job.newest_step() >= kill_at)
    per_log = [len([m for m in START.finditer(t) if m.group(1) == "2"]) for t in job.texts()]
    killed = time.time()
    kill()
    src, resumed, counted = job.wait(
        "the restart", lambda: job.starts()[n_starts] if len(job.starts()) > n_starts else None
    )
    # Steps logged before the restart's start line: a surviving rank 0 may still log the step it was
    # finishing when its peer died, so the files are read once the restart is there.
    reached, texts = 0, job.texts()
    for text, count in zip(texts, per_log + [0] * (len(texts) - len(per_log)), strict=True):  # new logs: 0
        cut = [m.start() for m in START.finditer(text) if m.group(1) == "2"]
        text = text[: cut[count]] if len(cut) > count else text
        reached = max([reached, *(int(s) for s in STEP.findall(text))])
    t = job.wait(
        "the first step after it", lambda: job.timings()[n_timings] if len(job.timings()) > n_timings else None
    )
    return {
        "kill_at": kill_at,
        "reached": reached,
        "resumed": resumed,
        "tier": "memory" if src.startswith("memory:") else "durable",
        "steps_lost": reached - resumed,
        "steps_lost_trainer_counted": counted,  # from the memory tier's reached.json (None without it)
        "recovery_seconds": round(t["first_step_unix"] - killed, 3),
        # as bench/recovery.py splits it: kill -> rank 0's new process, then its own start-up
        "recovery_parts": {
            "restart": round(t["process_start_unix"] - killed, 3),
            **{k: t[k] for k in ("imports", "process_group", "build", "resume", "first_step")},
        },
    }


def one_job(tmp: Path, memory: bool, every: int, kills: tuple[int, int], extra: list[str], logs: str | None) -> dict:
    job = Job(tmp, memory, every, extra)
    try:
        job.start("a")
        time.sleep(1.0)  # a hosts the rendezvous: let it start first
        job.start("b")
        durable = re.compile(rf"checkpoint committed \S+step-{every:09d}")
        job.wait("the first durable checkpoint", lambda: any(durable.search(t) for t in job.texts()))
        crash = failure(
            job, max(kills[0], job.newest_step() + 1), lambda: os.kill(worker_of(job.procs["a"]), signal.SIGKILL)
        )

        def lose_b() -> None:
            job.lost.add("b")
            kill_tree(job.procs["b"])
            shutil.rmtree(job.shm("b"), ignore_errors=True)
            job.start("b2")

        node = failure(job, crash["resumed"] + kills[1], lose_b)
    finally:
        job.close()
        if logs:
            for log in job.logs:
                shutil.copy(log, os.path.join(logs, f"{tmp.name}-{'memory' if memory else 'durable'}-{log.name}"))
    return {"worker_crash": crash, "node_loss": node}


def node_loss(args) -> dict:
    rng = random.Random(args.seed)
    runs: dict[str, list[dict]] = {"memory": [], "durable": []}
    for r in range(args.repeats):
        kills = (rng.randint(args.every + 1, 2 * args.every - 1), rng.randint(args.every, 2 * args.every - 1))
        order = ["memory", "durable"] if r % 2 == 0 else ["durable", "memory"]
        for variant in order:
            with tempfile.TemporaryDirectory(prefix="gentrain-bench-") as tmp:
                runs[variant].append(
                    one_job(Path(tmp), variant == "memory", args.every, kills, args.overrides, args.logs)
                )
            print(f"repeat {r} {variant}: {json.dumps(runs[variant][-1])}", file=sys.stderr, flush=True)
    out: dict = {
        "benchmark": "memory_tier.node_loss",
        "parallel": "fsdp",
        "nodes": "2 torchrun agents on 127.0.0.1, 1 worker each",
        "model": " ".join(SMALL_UNET),
        "durable_every_steps": args.every,
        "repeats": args.repeats,
        "seed": args.seed,
    }
    for failure_kind in ("worker_crash", "node_loss"):
        per: dict = {}
        for variant, jobs in runs.items():
            lost = [j[failure_kind]["steps_lost"] for j in jobs]
            rec = [j[failure_kind]["recovery_seconds"] for j in jobs]
            per[variant] = {
                "steps_lost": lost,
                "steps_lost_median": statistics.median(lost),
                "steps_lost_max": max(lost),
                "recovery_seconds": spread(rec),
                "tiers": [j[failure_kind]["tier"] for j in jobs],
                "runs": [j[failure_kind] for j in jobs],
            }
        pairs = [
            m[failure_kind]["recovery_seconds"] / d[failure_kind]["recovery_seconds"]
            for m, d in zip(runs["memory"], runs["durable"], strict=True)
        ]
        per["recovery_memory_over_durable_paired"] = spread(pairs)
        out[failure_kind] = per
    out["goal"] = {"memory_steps_lost_max": 1, "durable_steps_lost_max": args.every}
    out["goal_met"] = all(out[k]["memory"]["steps_lost_max"] <= 1 for k in ("worker_crash", "node_loss"))
    return out


# ------------------------------------------------------------------ step-time overhead, digits model


def step_times(memory_every: int, steps: int, tmp: Path, extra: list[str]) -> list[float]:
    """One training process (memory tier off where `memory_every` is 0); the wall time between
    consecutive step lines as they arrive here."""
    log = tmp / "train.log"
    args = [
        "digits-ddpm",
        *QUIET,
        f"train.max_steps={steps}",
        f"run.dir={tmp}/run",
        "checkpoint.every_steps=0",
        f"checkpoint.memory={'true' if memory_every else 'false'}",
        f"checkpoint.memory_every_steps={max(1, memory_every)}",
        f"checkpoint.memory_dir={tmp}/shm",
        *extra,
    ]
    env = clean_env()
    env.pop("OMP_NUM_THREADS", None)  # train.threads' default: torch's own choice
    proc = subprocess.Popen(
        [sys.executable, "-m", "trainer", "train", *args],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "w"),
        env=env,
        start_new_session=True,
    )
    seen: dict[int, float] = {}
    try:
        with open(log) as f:
            buf = ""
            while True:
                chunk = f.read()
                now = time.perf_counter()
                if chunk:
                    buf += chunk
                    *lines, buf = buf.split("\n")
                    for line in lines:
                        m = STEP.match(line)
                        if m:
                            seen[int(m.group(1))] = now
                elif proc.poll() is not None:
                    break
                else:
                    time.sleep(0.005)
        if proc.returncode != 0:
            raise RuntimeError(f"training exited {proc.returncode}:\n{log.read_text()[-3000:]}")
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    # The last step is followed by the final durable save, not a snapshot: steps 2..steps-1 are measured.
    return [seen[s] - seen[s - 1] for s in range(2, steps) if s - 1 in seen and s in seen]


def overhead(args) -> dict:
    """Processes alternate (order rotated per repeat): memory tier off, and on at each interval."""
    variants = [0, *args.memory_every]
    pooled: dict[int, list[float]] = {v: [] for v in variants}
    ratios: dict[int, list[float]] = {v: [] for v in args.memory_every}
    for r in range(args.repeats):
        mean: dict[int, float] = {}
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            with tempfile.TemporaryDirectory(prefix="gentrain-bench-") as tmp:
                t = step_times(v, args.steps, Path(tmp), args.overrides)[args.warmup :]
            pooled[v].extend(t)
            mean[v] = statistics.fmean(t)
        for v in args.memory_every:
            ratios[v].append(mean[v] / mean[0])
        print(f"repeat {r}: mean step {json.dumps(mean)}", file=sys.stderr, flush=True)
    import torch

    given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("train.threads=")]
    return {
        "benchmark": "memory_tier.overhead",
        "preset": "digits-ddpm",
        "overrides": args.overrides,
        "train_threads": int(given[-1]) if given else torch.get_num_threads(),
        "steps_per_process": args.steps,
        "warmup_steps_dropped": args.warmup,
        "repeats": args.repeats,
        "step_seconds_memory_off": spread(pooled[0], 4),
        "memory_every_steps": {
            str(v): {
                "step_seconds": spread(pooled[v], 4),
                "on_over_off_mean_step_paired": spread(ratios[v], 4),
                "on_over_off_median_step_pooled": round(statistics.median(pooled[v]) / statistics.median(pooled[0]), 4),
                "goal_met": statistics.median(ratios[v]) <= 1.03,
            }
            for v in args.memory_every
        },
        "goal_max": 1.03,
    }


# ------------------------------------------------------------------ step-time overhead, 1.2 GB state


def big(args) -> dict:
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from checkpoint import WIDTH, build_part, checkpoint_files, digest_gbps, state_bytes, train_step

    # torch and gentrain only here: the other sub-commands start gentrain in processes of their own.
    from trainer.checkpoint.memory import INDEX, OWNER, MemoryTier
    from trainer.checkpoint.state import updated_only_in_steps
    from trainer.checkpoint.writer import Checkpointer
    from trainer.elastic import DistEnv
    from trainer.engine.progress import TrainProgress

    torch.set_num_threads(args.threads)
    part = build_part(int(args.params))
    progress = TrainProgress(args.batch, 1 << 20, 1, 0)
    x = torch.randn(args.batch, WIDTH, generator=torch.Generator().manual_seed(0))
    train_step(part, x)  # the optimizer state exists from here on
    base = tempfile.mkdtemp(prefix="gentrain-bench-", dir=args.shm)
    try:
        tier = MemoryTier(os.path.join(base, "run"), DistEnv(), False, 60.0, os.path.join(base, "durable"))
        writer = Checkpointer(tier.store, True, write=tier.write)  # as CheckpointManager._memory_tier builds it
        parts = {part.name: part}
        part.fence = writer.fence
        meta = {"world_size": 1, OWNER: 0, INDEX: None}
        step_no = 0

        def snapshot() -> None:  # CheckpointManager.save_to_memory on one rank
            files = checkpoint_files(part, progress)
            writer.save(step_no, files, meta, stable=updated_only_in_steps(parts))

        def window(n: int, every: int) -> float:
            """n training steps, a snapshot after the first and every `every`-th after it (0: none); wall time
            including the end of the last snapshot's write, so each window pays for all the snapshots it started."""
            nonlocal step_no
            writer.wait()
            t0 = time.perf_counter()
            for i in range(n):
                step_no += 1
                tier.mark_reached(step_no)
                train_step(part, x)
                if every and i % every == 0:
                    snapshot()
            writer.wait()
            return time.perf_counter() - t0

        nbytes = state_bytes(checkpoint_files(part, progress))
        # Parts of one snapshot, alone: what the writer does, step by step, with nothing else running.
        snapshot()
        writer.wait()  # the first allocates the reused buffers: not measured
        t0 = time.perf_counter()
        snapshot()
        part.fence()
        copy_s = time.perf_counter() - t0
        writer.wait()
        whole_s = time.perf_counter() - t0
        src = os.path.join(base, "raw.bin")
        files = checkpoint_files(part, progress)
        t0 = time.perf_counter()
        with open(src, "wb") as f:
            for payload in files.values():
                for t in [] if isinstance(payload, bytes) else payload.values():
                    f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        tmpfs_write_s = time.perf_counter() - t0
        os.remove(src)
        blake3 = digest_gbps("blake3")

        window(2, 0)  # warm-up
        pace = statistics.fmean([window(args.window, 0) / args.window for _ in range(2)])
        per_snapshot: list[float] = []
        every_step: list[float] = []
        for r in range(args.repeats):
            # A window of 1 step + a snapshot + as many steps as the write takes, against the same steps without.
            n = max(2, math.ceil(whole_s / pace) + 1)
            order = [0, n] if r % 2 else [n, 0]
            got = {k: window(n, k) for k in order}
            per_snapshot.append(got[n] - got[0])
            got = {k: window(args.window, k) for k in ([1, 0] if r % 2 else [0, 1])}
            every_step.append(got[1] / got[0] - 1)
        cost = statistics.median(per_snapshot)
        k = max(1, math.ceil(cost / (args.goal * pace)))
        checked = []
        for r in range(args.check_repeats):  # k steps with one snapshot against k without: interval k's overhead
            got = {e: window(k, e) for e in ([k, 0] if r % 2 else [0, k])}
            checked.append(got[k] / got[0] - 1)
        writer.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {
        "benchmark": "memory_tier.big",
        "params": int(args.params),
        "state_bytes": nbytes,
        "threads": args.threads,
        "batch": args.batch,
        "tmpfs": args.shm,
        "step_seconds": round(pace, 4),
        "snapshot_alone": {
            "copy_seconds": round(copy_s, 3),
            "copy_to_written_seconds": round(whole_s, 3),
            "serialize_hash_write_seconds": round(whole_s - copy_s, 3),
            "raw_tmpfs_write_seconds": round(tmpfs_write_s, 3),
            "blake3_one_thread_seconds": round(nbytes / blake3 / 1e9, 3),
        },
        "overhead_every_step": spread(every_step, 4),
        "cost_per_snapshot_seconds": spread(per_snapshot),
        "cost_per_snapshot_in_steps": round(cost / pace, 2),
        "goal_max_overhead": args.goal,
        "smallest_interval_within_goal": k,
        "overhead_at_that_interval": spread(checked, 4),
        "repeats": args.repeats,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["node-loss", "overhead", "big", "all"])
    ap.add_argument("--repeats", type=int, default=None, help="paired repeats (node-loss 3, overhead 3, big 3)")
    ap.add_argument("--seed", type=int, default=0, help="node-loss: draws the kill steps")
    ap.add_argument("--every", type=int, default=20, help="node-loss: checkpoint.every_steps (durable tier)")
    ap.add_argument("--steps", type=int, default=80, help="overhead: training steps per process")
    ap.add_argument("--memory-every", type=int, nargs="+", default=[1, 10], help="overhead: memory_every_steps to run")
    ap.add_argument("--warmup", type=int, default=5, help="overhead: first steps not counted")
    ap.add_argument("--params", type=float, default=100e6, help="big: parameters")
    ap.add_argument("--threads", type=int, default=1, help="big: torch intra-op threads (bench/checkpoint.py's)")
    ap.add_argument("--batch", type=int, default=16, help="big: batch")
    ap.add_argument("--window", type=int, default=8, help="big: steps per window for the every-step overhead")
    ap.add_argument("--check-repeats", type=int, default=2, help="big: pairs measuring the interval found")
    ap.add_argument("--goal", type=float, default=0.03, help="big: the overhead the interval must stay within")
    ap.add_argument("--shm", default="/dev/shm", help="big: the tmpfs to write into")
    ap.add_argument("--logs", default=None, help="node-loss: copy every agent's log into this folder")
    ap.add_argument("overrides", nargs="*", help="node-loss, overhead: extra key=value for the training runs")
    args = ap.parse_intermixed_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM still kills the agents started
    defaults = {"node-loss": 3, "overhead": 3, "big": 3}
    benches = {"node-loss": node_loss, "overhead": overhead, "big": big}
    chosen = list(benches) if args.what == "all" else [args.what]
    out = {}
    for name in chosen:
        sub = argparse.Namespace(**{**vars(args), "repeats": args.repeats or defaults[name]})
        out[name] = benches[name](sub)
    print(json.dumps(out if args.what == "all" else out[args.what], indent=1))


if __name__ == "__main__":
    main()
