"""Checkpoint benchmark: training stall per save (async vs sync) and write throughput vs dd.

Prints one JSON object. Everything is measured in the same run on the same
disk, so the ratios hold on a noisy machine even when absolute numbers move:

- stall: seconds the training thread is blocked per save. Sync = the whole
  write; async = snapshot into reused CPU buffers (the first async save also
  allocates them, so it is reported separately and the steady state is the
  median of later saves).
- throughput: sync save bytes/s (serialize + blake3 + write + fsync + commit;
  old checkpoints are pruned on a helper thread, as in training runs) against
  `dd bs=16M conv=fsync` copying the same bytes (staged in /dev/shm) right
  before it (paired: the shared disk's speed swings several-fold; `dd` of
  /dev/zero is reported too, a virtual disk may write zeros faster), and against a raw
  write of the same tensor bytes from this process (the floor any serializer
  in Python can reach here). Median, min and max over `--saves` pairs.

Usage: python bench/checkpoint.py [--params 100e6] [--dir DIR] [--saves 5]
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

from trainer.checkpoint import CheckpointStore, split_tensors
from trainer.checkpoint.writer import Checkpointer


def build_state(num_params: int) -> dict:
    """A model of `num_params` float32 parameters plus its AdamW state (about 12 bytes/param)."""
    width = 4096
    layers = max(1, round(num_params / (width * width + width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=True) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt_tensors, opt_skeleton = split_tensors(opt.state_dict())
    return {
        "model.safetensors": model.state_dict(),
        "optimizer.safetensors": opt_tensors,
        "optimizer.json": json.dumps(opt_skeleton).encode(),
    }


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
    from trainer.checkpoint.format import new_digest

    data = os.urandom(256 << 20)
    t0 = time.perf_counter()
    new_digest(algorithm, threads=1).update(data)
    return len(data) / (time.perf_counter() - t0) / 1e9


def spread(values: list[float], digits: int = 3) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo's disk)")
    ap.add_argument("--saves", type=int, default=5)
    args = ap.parse_args()

    base = args.dir or tempfile.mkdtemp(prefix="gentrain-bench-", dir=os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(base, exist_ok=True)
    files = build_state(int(args.params))
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
                "async_stall_seconds_first": round(async_stalls[0], 3),
                "async_stall_seconds": spread(async_stalls[1:]),
                "async_stall_over_sync": round(async_steady / sync_med, 4),
                "blake3_one_thread_gbps": round(digest_gbps("blake3"), 3),
                "sha256_one_thread_gbps": round(digest_gbps("sha256"), 3),
                "targets": {"async_stall_over_sync_max": 0.10, "sync_over_dd_min": 0.80},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
