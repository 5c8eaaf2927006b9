"""Checkpoint benchmark: training stall per save (async vs sync) and write throughput vs dd.

Prints one JSON object. Everything is measured in the same run on the same
disk, so the ratios hold on a noisy machine even when absolute numbers move.
The state is a model of `--params` float32 parameters (Linear 4096x4096
layers) with its fused AdamW state, held by gentrain's own `Part`, and saved
through gentrain's own `snapshot_files` and `Checkpointer`:

- stall in the training loop (the figure that counts): the bench model trains
  (forward, backward, `Part.optimizer_step`, which waits on the fence) for
  `--loop-steps` steps per window; a window that starts with an async save is
  paired with a window without one in the same repeat, and
  stall = (loop time with the save) - (loop time without it), which counts
  everything the save costs the loop: the snapshot of buffers on the training
  thread, the fence's wait for the background copy, and the writer threads
  competing for cores and memory bandwidth. The background copy of
  parameters and optimizer state overlaps the next forward/backward
  ("overlap", what training does); "copy_all" copies everything on the
  training thread before `save` returns (the previous design), in the same loop.
  The training thread's own CPU time and run-queue wait (Linux schedstat)
  split the stall into work that got slower (memory bandwidth and caches
  shared with the writer) and time waiting for a core (CPU contention).
- snapshot-only stall: `save` alone, copying every tensor on the calling
  thread (the figure earlier versions reported; the first async save also
  allocates the reused buffers and is reported separately).
- throughput: sync save bytes/s (serialize + blake3 + write + fsync + commit;
  old checkpoints are pruned on a helper thread, as in training runs) against
  `dd bs=16M conv=fsync` copying the same bytes (staged in /dev/shm) right
  before it (paired: the shared disk's speed swings several-fold; `dd` of
  /dev/zero is reported too, a virtual disk may write zeros faster), and against a raw
  write of the same tensor bytes from this process (the floor any serializer
  in Python can reach here). Median, min and max over `--saves` pairs.

Usage: python bench/checkpoint.py [--params 100e6] [--dir DIR] [--saves 5] [--repeats 15]
       [--threads 1] [--batch 16] [--loop-steps 4] [--write-nice 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from trainer.checkpoint import CheckpointStore
from trainer.checkpoint.format import new_digest
from trainer.checkpoint.state import capture_rank_state, snapshot_files, updated_only_in_steps
from trainer.checkpoint.writer import BACKGROUND_WRITE_NICE, Checkpointer
from trainer.engine.parts import Part
from trainer.engine.progress import TrainProgress
from trainer.optim import OptimSettings

WIDTH = 4096


def build_part(num_params: int) -> Part:
    """A gentrain Part: `num_params` float32 parameters (Linear layers) and fused AdamW (about 12 bytes/param
    in all), no EMA, no clipping: the loop's own optimizer step (unscale, norm, step, schedule)."""
    layers = max(1, round(num_params / (WIDTH * WIDTH + WIDTH)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=True) for _ in range(layers)])
    settings = OptimSettings(
        lr=1e-4,
        betas=(0.9, 0.999),
        weight_decay=0.0,
        eps=1e-8,
        warmup_steps=0,
        lr_schedule="constant",
        lr_num_cycles=1,
        lr_power=1.0,
        max_grad_norm=None,
        max_steps=1 << 30,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, fused=True)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return Part("net", model, model, opt, schedule, scaler, None, settings)


def train_step(part: Part, x: torch.Tensor) -> None:
    part.optimizer.zero_grad(set_to_none=True)
    part.module(x).pow(2).mean().backward()
    part.optimizer_step()


def checkpoint_files(part: Part, progress: TrainProgress) -> dict:
    """What CheckpointManager.save hands the writer on one rank: every file, live tensors."""
    return snapshot_files(progress, {part.name: part}, [capture_rank_state()], {})


def state_bytes(files: dict) -> int:
    total = 0
    for payload in files.values():
        if isinstance(payload, bytes):
            total += len(payload)
        else:
            total += sum(t.numel() * t.element_size() for t in payload.values())
    return total


def dd_seconds(path: str, nbytes: int, source: str = "/dev/zero") -> float:
    count = max(1, round(nbytes / (16 << 20)))
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", f"if={source}", f"of={path}", "bs=16M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt * nbytes / (count * (16 << 20))


def stage_bytes(files: dict) -> str:
    """The state's own bytes in a RAM file (/dev/shm), for dd to copy: the same bytes, not zeros.

    A virtual disk may treat runs of zeros specially, so `dd if=/dev/zero` can
    outrun any write of real tensor bytes.
    """
    fd, path = tempfile.mkstemp(prefix="gentrain-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    with os.fdopen(fd, "wb") as f:
        write_payloads(f, files)
    return path


def write_payloads(f, files: dict) -> None:
    """Every file's bytes, tensors as their raw storage, one after another."""
    for payload in files.values():
        if isinstance(payload, bytes):
            f.write(payload)
            continue
        for t in payload.values():
            f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def raw_write_seconds(path: str, files: dict) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        write_payloads(f, files)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def digest_gbps(algorithm: str) -> float:
    """One thread's digest speed here (blake3 as the writer's hash thread runs it; sha256 for old checkpoints)."""

    data = os.urandom(256 << 20)
    t0 = time.perf_counter()
    new_digest(algorithm, threads=1).update(data)
    return len(data) / (time.perf_counter() - t0) / 1e9


def thread_times() -> tuple[float, float]:
    """This thread's (seconds on a CPU, seconds runnable but waiting for one), from Linux schedstat: what
    splits a slower step into CPU contention (waiting for a core) and the step's own work getting slower
    (memory bandwidth and cache shared with the writer); the rest of the wall time is sleep (a fence, the GIL).
    Zeros where schedstat is missing."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
        return int(on_cpu) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def spread(values: list[float], digits: int = 3) -> dict:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "quartiles": [round(q[0], digits), round(q[2], digits)],
    }


def loop_stalls(part: Part, progress: TrainProgress, base: str, args) -> dict:
    """Per repeat: what a window of training steps that starts with an async save costs beyond the same
    number of steps at this repeat's pace without a save, for both snapshot designs.

    A window with a save keeps stepping until the background write has finished (at least
    `--loop-steps` steps), so the writer's use of cores and memory bandwidth is inside it; its stall is
    its time minus its step count times the mean step of this repeat's window without a save. A second
    window without a save, costed the same way, gives the noise floor (its true stall is 0).
    """
    store = CheckpointStore(os.path.join(base, "loop"), keep=1)
    store.prune_in_background = True
    ckpt = Checkpointer(store, async_save=True, write_nice=args.write_nice)
    waits: list[float] = []

    def fence() -> None:  # what CheckpointManager.fence does, timed
        waits.append(ckpt.fence())

    part.fence = fence
    x = torch.randn(args.batch, WIDTH, generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # warm-up: allocator, kernels
        train_step(part, x)
    save_no = 0

    def save(stable: bool) -> float:
        nonlocal save_no
        save_no += 1
        files = checkpoint_files(part, progress)
        predicate = updated_only_in_steps({part.name: part}) if stable else None
        return ckpt.save(save_no, files, {"world_size": 1}, stable=predicate)[0]

    save(True)  # allocates the reused buffers (first touch is slow here); not measured
    ckpt.wait()
    kinds = ["none", "none_again", "overlap", "copy_all"]
    stalls: dict[str, list[float]] = {k: [] for k in kinds[1:]}
    steps_taken: dict[str, list[int]] = {k: [] for k in kinds[2:]}
    calls: dict[str, list[float]] = {k: [] for k in kinds[2:]}
    fence_waits: dict[str, list[float]] = {k: [] for k in kinds[2:]}
    extra_cpu: dict[str, list[float]] = {k: [] for k in kinds[1:]}
    extra_wait: dict[str, list[float]] = {k: [] for k in kinds[1:]}
    pace: list[float] = []
    for r in range(args.repeats):
        windows: dict[str, tuple[float, list[float], float, float]] = {}
        for kind in kinds[r % 4 :] + kinds[: r % 4]:  # rotate the order: drift does not favour one kind
            ckpt.wait()
            store.wait_pruned()
            waits.clear()
            step_times = []
            cpu0, wait0 = thread_times()
            t0 = time.perf_counter()
            if kind in calls:
                calls[kind].append(save(stable=kind == "overlap"))
            while len(step_times) < args.loop_steps or (ckpt.writing() and len(step_times) < 4 * args.loop_steps):
                t1 = time.perf_counter()
                train_step(part, x)
                step_times.append(time.perf_counter() - t1)
            wall = time.perf_counter() - t0
            cpu1, wait1 = thread_times()
            windows[kind] = (wall, step_times, cpu1 - cpu0, wait1 - wait0)
            if kind in calls:
                fence_waits[kind].append(sum(waits))
                steps_taken[kind].append(len(step_times))
        step = statistics.fmean(windows["none"][1])  # the mean: total - n * mean has expectation 0 without a save
        pace.append(step)
        n_none = len(windows["none"][1])
        cpu_step, wait_step = windows["none"][2] / n_none, windows["none"][3] / n_none
        for kind in stalls:
            total, step_times, cpu, wait = windows[kind]
            n = len(step_times)
            stalls[kind].append(total - n * step)
            extra_cpu[kind].append(cpu - n * cpu_step)
            extra_wait[kind].append(wait - n * wait_step)
    ckpt.close()
    assert ckpt.take_failure() is None
    out = {
        "step_seconds_no_save": spread(pace),
        "noise_floor_seconds": spread(stalls["none_again"]),
        "noise_floor_extra_cpu_seconds": spread(extra_cpu["none_again"]),
        "noise_floor_extra_runqueue_wait_seconds": spread(extra_wait["none_again"]),
    }
    for kind in ("overlap", "copy_all"):
        blocked = [c + f for c, f in zip(calls[kind], fence_waits[kind], strict=True)]
        out[kind] = {
            "stall_seconds": spread(stalls[kind]),
            "save_call_seconds": spread(calls[kind], 4),
            "fence_wait_seconds": spread(fence_waits[kind], 4),
            "training_thread_blocked_seconds": spread(blocked, 4),
            "steps_per_window": spread(steps_taken[kind], 1),
            # the stall split: the training thread's extra CPU time (its work got slower: memory bandwidth,
            # caches, the copy in `save`) and extra time runnable without a core (CPU contention)
            "extra_cpu_seconds": spread(extra_cpu[kind]),
            "extra_runqueue_wait_seconds": spread(extra_wait[kind]),
            "_stalls": stalls[kind],
            "_blocked": blocked,
        }
    out["_noise"] = stalls["none_again"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo's disk)")
    ap.add_argument("--saves", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=15, help="training-loop windows per kind")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training loop")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--loop-steps", type=int, default=4, help="training steps per window (at least)")
    ap.add_argument("--write-nice", type=int, default=BACKGROUND_WRITE_NICE, help="background writer's nice")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    base = args.dir or tempfile.mkdtemp(prefix="gentrain-bench-", dir=os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(base, exist_ok=True)
    part = build_part(int(args.params))
    progress = TrainProgress(args.batch, 1 << 20, 1, 0)
    train_step(part, torch.randn(args.batch, WIDTH))  # optimizer state exists from here on
    files = checkpoint_files(part, progress)
    nbytes = state_bytes(files)
    meta = {"world_size": 1}
    try:
        # Each sync save is paired with a dd of the same bytes right before it: the disk here is shared
        # and its speed swings several-fold within minutes, so only same-moment pairs are comparable.
        sync_store = CheckpointStore(os.path.join(base, "sync"), keep=1)
        sync_store.prune_in_background = True  # as training runs use the store
        sync_ckpt = Checkpointer(sync_store, async_save=False)
        sync_s, dd_s, zeros_s, raw_s = [], [], [], []
        staged = stage_bytes(files)
        try:
            for i in range(args.saves):
                dd_s.append(dd_seconds(os.path.join(base, "dd.bin"), nbytes, staged))
                sync_s.append(sync_ckpt.save(i + 1, files, meta)[0])
                sync_store.wait_pruned()  # not part of the save (a helper thread's work); kept out of the next pair
                raw_s.append(raw_write_seconds(os.path.join(base, "raw.bin"), files))
                zeros_s.append(dd_seconds(os.path.join(base, "dd.bin"), nbytes))
        finally:
            os.remove(staged)
        sync_ckpt.close()

        async_store = CheckpointStore(os.path.join(base, "async"), keep=1)
        async_store.prune_in_background = True
        async_ckpt = Checkpointer(async_store, async_save=True)
        async_stalls = []
        for i in range(args.saves + 1):
            async_ckpt.wait()  # a training run saves every N steps: the previous save is done by then
            async_store.wait_pruned()  # ... and so is its pruning
            stall, _ = async_ckpt.save(i + 1, files, meta)
            async_stalls.append(stall)
        async_ckpt.close()
        assert async_ckpt.take_failure() is None
        del files, async_ckpt  # frees the snapshot-only buffers before the loop allocates its own
        loop = loop_stalls(part, progress, base, args)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    sync_med = statistics.median(sync_s)
    async_steady = statistics.median(async_stalls[1:])
    gbps = [nbytes / s / 1e9 for s in sync_s]
    print(
        json.dumps(
            {
                "benchmark": "checkpoint",
                "params": int(args.params),
                "state_bytes": nbytes,
                "saves": args.saves,
                "sync_save_seconds": spread(sync_s),
                "sync_write_gbps": spread(gbps),
                "dd_write_gbps": spread([nbytes / s / 1e9 for s in dd_s]),
                "dd_zeros_write_gbps": spread([nbytes / s / 1e9 for s in zeros_s]),
                "raw_python_write_gbps": spread([nbytes / s / 1e9 for s in raw_s]),
                "sync_over_dd_paired": spread([d / s for d, s in zip(dd_s, sync_s, strict=True)]),
                "sync_over_raw_python_paired": spread([r / s for r, s in zip(raw_s, sync_s, strict=True)]),
                "loop": {
                    "threads": args.threads,
                    "batch": args.batch,
                    "min_steps_per_window": args.loop_steps,
                    "repeats": args.repeats,
                    "write_nice": args.write_nice,
                    "step_seconds_no_save": loop["step_seconds_no_save"],
                    "noise_floor_seconds": loop["noise_floor_seconds"],
                    "noise_floor_extra_cpu_seconds": loop["noise_floor_extra_cpu_seconds"],
                    "noise_floor_extra_runqueue_wait_seconds": loop["noise_floor_extra_runqueue_wait_seconds"],
                    "noise_floor_over_sync": spread([x / sync_med for x in loop["_noise"]], 4),
                    **{
                        kind: {
                            **{k: v for k, v in loop[kind].items() if not k.startswith("_")},
                            "stall_over_sync": spread([x / sync_med for x in loop[kind]["_stalls"]], 4),
                            "blocked_over_sync": spread([x / sync_med for x in loop[kind]["_blocked"]], 4),
                        }
                        for kind in ("overlap", "copy_all")
                    },
                },
                "async_stall_over_sync": round(statistics.median(loop["overlap"]["_stalls"]) / sync_med, 4),
                "snapshot_only_stall_seconds_first": round(async_stalls[0], 3),
                "snapshot_only_stall_seconds": spread(async_stalls[1:]),
                "snapshot_only_stall_over_sync": round(async_steady / sync_med, 4),
                "blake3_one_thread_gbps": round(digest_gbps("blake3"), 3),
                "sha256_one_thread_gbps": round(digest_gbps("sha256"), 3),
                "targets": {"async_stall_over_sync_max": 0.10, "sync_over_dd_min": 0.80},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
