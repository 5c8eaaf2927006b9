"""Recovery benchmark: SIGKILL of a torchrun worker -> first completed step after resume, by part.

Launches `torchrun --nproc-per-node=2 --max-restarts=3 -m trainer train` on
127.0.0.1 (digits-ddpm model by default), measures the cold start (launch ->
first step), waits for a checkpoint, SIGKILLs rank 1, and reads the
restarted rank 0's startup timings (logged by the Trainer) to split the
recovery into:

  restart        kill -> new worker process started (agent notices, tears down, re-rendezvous, spawns)
  imports        Python imports (torch, diffusers, accelerate)
  process_group  torch.distributed init (rendezvous of the workers)
  build          datasets, model, optimizer
  resume         checkpoint discovery (LATEST + listing) and sha256-verified load
  first_step     the first optimizer step after resume

Prints one JSON object with the ratio recovery / cold start.
Usage: python bench/recovery.py [--preset digits-ddpm] [extra key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

TIMINGS = re.compile(r"startup timings \(s\): (\{.*\})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(path: str, pattern: str, count: int, proc: subprocess.Popen, timeout: float = 300) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = open(path).read()
        found = re.findall(pattern, text)
        if len(found) >= count:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun exited {proc.returncode}:\n{text[-3000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"{pattern!r} not seen {count}x within {timeout}s:\n{open(path).read()[-4000:]}")


def rank1_worker(agent: int) -> int:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid != agent:
                continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if b"\0RANK=1\0" in b"\0" + f.read():
                    return int(entry)
        except OSError:
            continue
    raise RuntimeError("rank 1 worker not found")


def kill_tagged(tag: str) -> None:
    """SIGKILL the agent we started and its workers (which run in sessions of their own): every
    process whose environment carries our unique tag."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if f"RECOVERY_BENCH_TAG={tag}".encode() in f.read():
                        os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="digits-ddpm")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "torchrun.log")
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node=2",
            "--max-restarts=3",
            "--monitor-interval=0.1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            "-m",
            "trainer",
            "train",
            args.preset,
            f"run.dir={tmp}/run",
            "train.max_steps=1000000",
            "checkpoint.every_steps=20",
            "train.log_every_steps=10",
            "sample.every_steps=0",
            "train.val_every_steps=0",
            *args.overrides,
        ]
        tag = os.urandom(8).hex()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RECOVERY_BENCH_TAG": tag}
        launched = time.time()
        proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            cold = json.loads(wait_for(log, TIMINGS.pattern, 1, proc)[0])
            wait_for(log, r"checkpoint committed \S+step-000000020", 1, proc)
            victim = rank1_worker(proc.pid)
            killed = time.time()
            os.kill(victim, signal.SIGKILL)
            warm = json.loads(wait_for(log, TIMINGS.pattern, 2, proc)[1])
            resumed = re.findall(r"restart=(\d+) .*resumed_from=(\S+)", open(log).read())
        finally:
            kill_tagged(tag)
            proc.wait(timeout=30)

    parts = {
        "restart": round(warm["process_start_unix"] - killed, 3),
        **{k: warm[k] for k in ("imports", "process_group", "build", "resume", "first_step")},
    }
    recovery = round(warm["first_step_unix"] - killed, 3)
    cold_total = round(cold["first_step_unix"] - launched, 3)
    cold_parts = {
        "launch_to_worker_start": round(cold["process_start_unix"] - launched, 3),
        **{k: cold[k] for k in ("imports", "process_group", "build", "resume", "first_step")},
    }
    print(
        json.dumps(
            {
                "benchmark": "recovery",
                "preset": args.preset,
                "world_size": 2,
                "recovery_seconds": recovery,
                "recovery_parts": parts,
                "cold_start_seconds": cold_total,
                "cold_start_parts": cold_parts,
                "recovery_over_cold_start": round(recovery / cold_total, 3),
                "resumed_from": resumed[-1][1] if resumed else None,
                "restart_count": int(resumed[-1][0]) if resumed else None,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
