"""CPU proxy of the GPU step's host overhead: what a gentrain step costs the host beyond a hand-written loop.

On a GPU a step is fast when the host only queues work: whatever the host does per step beyond launching
kernels (per-sample draws on the CPU, reading logged values back, per-step collectives) either delays the
queue or, when it waits for the device, empties it. With a tiny model at a large batch (a one-block DiT on
8x8 images, batch 256: little arithmetic, many samples), a CPU step is mostly that host work, so the
difference between gentrain's step and a hand-written loop's is gentrain's host overhead per step, measurable
on any machine.

Variants, interleaved in rounds in this one process (A B A B ...): `hand` (the same DiT on a fixed batch
in memory, torch.randn and
randint for the batch, DDPMScheduler.add_noise, MSE, clip_grad_norm_, AdamW, EMA by torch._foreach_lerp_,
loss.item() each step: bench/gpu.py's hand-written loop) and `gentrain` (Trainer.fit of the same config:
loader, per-sample draws, EMA, progress, reporter; logging every 50 steps). Each iteration is timed from one
step's start to the next's; the figure is the median over all rounds (robust to these VMs' stalls), with
quartiles. Also timed alone: one step's per-sample draws (noise, timestep, label dropout) for batch 256 on
draw stream 1 (a CPU generator per sample, older checkpoints) and stream 2 (device blocks, new runs).

Usage: python bench/host_overhead.py [--steps 30] [--rounds 4] [--batch 256]
Target (docs/benchmarks.md): gentrain's median step within 1 ms of the hand-written loop's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from trainer.elastic import DistEnv
from trainer.hostmem import keep_freed_memory

keep_freed_memory()  # the Trainer applies it; every variant runs in this process, so all get it

DIT = "{kind: dit, num_layers: 1, num_attention_heads: 2, attention_head_dim: 8, patch_size: 2}"


def config_args(batch: int, steps: int, workdir: str) -> list[str]:
    return [
        f"model.backbone={DIT}",
        "model.num_classes=10",
        "data.image_size=8",
        f"train.batch_size={batch}",
        f"train.max_steps={steps}",
        "train.log_every_steps=50",
        "train.threads=1",
        "checkpoint.every_steps=0",
        "checkpoint.lease=false",
        "sample.every_steps=0",
        "sample.num=4",
        "sample.inference_steps=1",
        "train.val_every_steps=0",
        "data.val_fraction=0",
        f"run.dir={workdir}",
    ]


def gentrain_iterations(batch: int, steps: int, workdir: str) -> list[float]:
    # Imported here: the draw-stream timing below must also run against older gentrain checkouts.
    from trainer.loop import Trainer
    from trainer.registry import load_config

    args = config_args(batch, steps, workdir)
    try:
        cfg = load_config("digits-ddpm", args, environ={})
    except Exception:  # a gentrain without checkpoint.lease (the code before it, for a before/after figure)
        cfg = load_config("digits-ddpm", [a for a in args if not a.startswith("checkpoint.lease")], environ={})
    trainer = Trainer(cfg, DistEnv())
    stamps: list[float] = []
    waits: list[float] = []
    run, on_step = trainer.step_runner.run, trainer.reporter.on_step

    def timed(batch, step):  # instrumentation only: when each iteration reaches its step
        stamps.append(time.perf_counter())
        return run(batch, step)

    def data_wait(batch, logs, lr, t_data, *rest):  # and how long it waited for its batch
        waits.append(t_data)
        return on_step(batch, logs, lr, t_data, *rest)

    trainer.step_runner.run, trainer.reporter.on_step = timed, data_wait
    assert trainer.fit() == 0
    # The iteration from one step's start to the next, less the wait for the next batch: the hand-written
    # loop's batch is already in memory (as on the GPU: on the device), and gentrain's loader would read it
    # in worker processes there.
    return [d - w for d, w in zip(np.diff(stamps), waits[1:], strict=False)]


def hand_iterations(batch: int, steps: int) -> list[float]:
    from diffusers import DDPMScheduler, DiTTransformer2DModel

    from trainer.data.datasets import DigitsDataset  # the data only (same images as gentrain reads)

    torch.manual_seed(0)
    net = DiTTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=1,
        out_channels=1,
        num_layers=1,
        sample_size=8,
        patch_size=2,
        num_embeds_ada_norm=10,
    )
    data = DigitsDataset(8)
    images, labels = data.images, torch.as_tensor(data.labels)
    sched = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    params = list(net.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4)
    ema = [p.detach().clone() for p in params]
    x0, y = images[:batch], labels[:batch]  # a fixed batch in memory, as bench/gpu.py's is on the device
    stamps = []
    for _ in range(steps):
        stamps.append(time.perf_counter())
        noise = torch.randn_like(x0)
        t = torch.randint(0, 1000, (batch,))
        pred = net(sched.add_noise(x0, noise, t), timestep=t, class_labels=y).sample
        loss = F.mse_loss(pred, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - 0.9999)
        loss.item()
    return list(np.diff(stamps))


def draw_seconds(batch: int, repeats: int = 20) -> dict[str, float]:
    """Median seconds of one step's draws (noise (1, 8, 8), timestep, label dropout) on each stream."""
    try:
        from trainer.randomness import sample_draws, set_stream_version  # absent before draw streams
    except ImportError:  # before draw streams: the per-sample generators only
        return {}
    out = {}
    for version in (1, 2):
        set_stream_version(version)
        times = []
        for step in range(repeats):
            t0 = time.perf_counter()
            d = sample_draws(0, step, range(batch))
            d.randn((1, 8, 8)), d.randint(1000), d.rand()
            times.append(time.perf_counter() - t0)
        out[f"stream{version}_ms"] = round(1000 * statistics.median(times), 3)
    set_stream_version(2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    samples: dict[str, list[float]] = {"hand": [], "gentrain": []}
    with tempfile.TemporaryDirectory() as tmp:
        hand_iterations(args.batch, 3)  # warm-up
        for r in range(args.rounds):
            samples["hand"] += hand_iterations(args.batch, args.steps)[2:]
            samples["gentrain"] += gentrain_iterations(args.batch, args.steps, os.path.join(tmp, str(r)))[2:]
    med = {k: statistics.median(v) for k, v in samples.items()}
    quart = {
        k: [round(1000 * x, 3) for x in statistics.quantiles(v, n=4, method="inclusive")] for k, v in samples.items()
    }
    print(
        json.dumps(
            {
                "benchmark": "host_overhead",
                "device": "cpu",
                "torch_threads": 1,
                "batch_size": args.batch,
                "iterations": {k: len(v) for k, v in samples.items()},
                "median_step_ms": {k: round(1000 * v, 3) for k, v in med.items()},
                "quartiles_step_ms": quart,
                "gentrain_extra_ms": round(1000 * (med["gentrain"] - med["hand"]), 3),
                "hand_over_gentrain": round(med["hand"] / med["gentrain"], 4),
                "draws": draw_seconds(args.batch),
                "target": {"gentrain_extra_ms_max": 1.0},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
