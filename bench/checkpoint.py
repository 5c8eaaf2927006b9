"""Checkpoint benchmark: training stall per save (async vs sync) and write throughput vs dd.

Prints one JSON object. Everything is measured in the same run on the same
disk, so the ratios hold on a noisy machine even when absolute numbers move:

- stall: seconds the training thread is blocked per save. Sync = the whole
  write; async = snapshot into reused CPU buffers (the first async save also
  allocates them, so it is reported separately and the steady state is the
  median of later saves).
- throughput: sync save bytes/s (serialize + sha256 + write + fsync) against
  `dd bs=16M conv=fsync` writing the same number of bytes, and against a raw
  write of the same tensor bytes from this process (the floor any serializer
  in Python can reach here).

Usage: python bench/checkpoint.py [--params 100e6] [--dir DIR] [--saves 3]
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


def dd_seconds(path: str, nbytes: int) -> float:
    count = max(1, round(nbytes / (16 << 20)))
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={path}", "bs=16M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt * nbytes / (count * (16 << 20))


def raw_write_seconds(path: str, files: dict) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for payload in files.values():
            if isinstance(payload, bytes):
                f.write(payload)
                continue
            for t in payload.values():
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(path)
    return dt


def sha256_gbps() -> float:
    """One core's sha256 speed here: the ceiling of any save that must hash each file."""
    import hashlib

    data = os.urandom(256 << 20)
    t0 = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    return len(data) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir under the repo's disk)")
    ap.add_argument("--saves", type=int, default=3)
    args = ap.parse_args()

    base = args.dir or tempfile.mkdtemp(prefix="gentrain-bench-", dir=os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(base, exist_ok=True)
    files = build_state(int(args.params))
    nbytes = state_bytes(files)
    meta = {"world_size": 1}
    try:
        sync_store = CheckpointStore(os.path.join(base, "sync"), keep=1)
        sync_ckpt = Checkpointer(sync_store, async_save=False)
        sync_stalls = []
        for i in range(args.saves):
            stall, _ = sync_ckpt.save(i + 1, files, meta)
            sync_stalls.append(stall)

        async_store = CheckpointStore(os.path.join(base, "async"), keep=1)
        async_ckpt = Checkpointer(async_store, async_save=True)
        async_stalls = []
        for i in range(args.saves + 1):
            async_ckpt.wait()  # a training run saves every N steps: the previous save is done by then
            stall, _ = async_ckpt.save(i + 1, files, meta)
            async_stalls.append(stall)
        async_ckpt.close()
        assert async_ckpt.take_failure() is None

        raw = statistics.median(raw_write_seconds(os.path.join(base, "raw.bin"), files) for _ in range(2))
        dd = statistics.median(dd_seconds(os.path.join(base, "dd.bin"), nbytes) for _ in range(2))
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)

    sync_s = statistics.median(sync_stalls)
    async_steady = statistics.median(async_stalls[1:])
    gbps = lambda s: round(nbytes / s / 1e9, 3)  # noqa: E731
    print(
        json.dumps(
            {
                "benchmark": "checkpoint",
                "params": int(args.params),
                "state_bytes": nbytes,
                "sync_save_seconds": round(sync_s, 3),
                "async_stall_seconds_first": round(async_stalls[0], 3),
                "async_stall_seconds": round(async_steady, 3),
                "async_stall_over_sync": round(async_steady / sync_s, 4),
                "sync_write_gbps": gbps(sync_s),
                "dd_write_gbps": gbps(dd),
                "raw_python_write_gbps": gbps(raw),
                "sync_over_dd": round(dd / sync_s, 3),
                "sync_over_raw_python": round(raw / sync_s, 3),
                "sha256_one_core_gbps": round(sha256_gbps(), 3),
                "targets": {"async_stall_over_sync_max": 0.10, "sync_over_dd_min": 0.70},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
