"""Sharded checkpoint benchmark: 2 ranks each writing their own shards vs one writer, same state, same run.

Prints one JSON object. Two processes (gloo on 127.0.0.1) hold a model of
`--params` float32 parameters sharded with FSDP2 and its AdamW state. Each
repeat times, alternately:

- sharded: every rank writes its slices (safetensors + blake3, fsync), reports
  to rank 0, rank 0 writes the index and commits the manifest (the training
  code path, `trainer.checkpoint.sharded.write_sharded`);
- single: rank 0 writes the same state gathered whole (one file per kind),
  as a DDP checkpoint is written (`CheckpointStore.write`); the gather is not
  timed.

Reported: median/min/max seconds of each, the time ratio single/sharded
(>1: sharding is faster), throughput, and blake3's one-thread GB/s here.

Usage: python bench/sharded_checkpoint.py [--params 20e6] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _state(num_params: int):
    from torch.distributed.fsdp import fully_shard

    width = 1024
    layers = max(1, round(num_params / (width * width + width)))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    return model, opt


def _worker(rank: int, world: int, port: int, args, out_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.new_group(backend="gloo")
    # in the spawned worker, after its process group exists (the parent only times and compares)
    from trainer.checkpoint.format import split_tensors
    from trainer.checkpoint.sharded import local_slices, write_sharded
    from trainer.checkpoint.store import CheckpointStore

    model, opt = _state(int(args.params))
    opt_tensors, _ = split_tensors(opt.state_dict())
    groups = {"net.model": model.state_dict(), "net.optimizer": opt_tensors}
    files, index = {}, {}
    for name, tensors in groups.items():
        f, i = local_slices(name, tensors, rank)
        files.update(f)
        index.update(i)
    whole = {
        f"{name}.safetensors": {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in t.items()}
        for name, t in groups.items()
    }
    total = sum(t.numel() * t.element_size() for g in whole.values() for t in g.values())
    root = os.path.join(args.dir, "ckpt")
    sharded, single = [], []
    for r in range(args.repeats):
        for mode in ("sharded", "single"):
            store = CheckpointStore(os.path.join(root, f"{mode}-{r}"))
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "sharded":
                write_sharded(store, 1, files, index, {"world_size": world}, rank, world, group)
            elif rank == 0:
                store.write(1, whole, {"world_size": 1})
            dist.barrier()
            (sharded if mode == "sharded" else single).append(time.perf_counter() - t0)
            if rank == 0:
                shutil.rmtree(store.root)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"bytes": total, "sharded": sharded, "single": single}, f)
    dist.destroy_process_group()


def blake3_gbps() -> float:
    import blake3

    data = os.urandom(256 << 20)
    t0 = time.perf_counter()
    blake3.blake3(data).hexdigest()
    return len(data) / (time.perf_counter() - t0) / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=20e6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    tmp = tempfile.mkdtemp(dir=args.dir, prefix="gentrain-bench-")
    args.dir = tmp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tmp, "result.json")
    try:
        mp.spawn(_worker, args=(2, port, args, out), nprocs=2, join=True)
        with open(out) as f:
            r = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def summary(xs: list[float]) -> dict[str, float]:
        return {"median_s": round(statistics.median(xs), 3), "min_s": round(min(xs), 3), "max_s": round(max(xs), 3)}

    sharded, single = statistics.median(r["sharded"]), statistics.median(r["single"])
    print(
        json.dumps(
            {
                "params": int(args.params),
                "state_bytes": r["bytes"],
                "repeats": args.repeats,
                "sharded_2_ranks": {**summary(r["sharded"]), "gb_per_s": round(r["bytes"] / sharded / 1e9, 3)},
                "single_writer": {**summary(r["single"]), "gb_per_s": round(r["bytes"] / single / 1e9, 3)},
                "time_ratio_single_over_sharded": round(single / sharded, 3),
                "blake3_one_thread_gbps": round(blake3_gbps(), 3),
                "cpus": os.cpu_count(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
