"""Loop overhead benchmark: gentrain's training loop vs a hand-written minimal PyTorch loop.

Same UNet, batch, data, optimizer and loss on CPU, in the same process, runs
interleaved (A B C A B C ...) so machine noise hits all variants alike. Each
loop iteration is timed from the start of one optimizer step to the start of
the next (for gentrain: batch fetch, forward/backward, step, bookkeeping,
stop agreement, metrics), and each variant's figure is the *median*
iteration over all rounds: robust to the multi-100-ms stalls these VMs show,
which made totals of whole runs swing by more than the effect measured.

Variants: minimal loop; gentrain with metrics off; gentrain with the
Prometheus exporter on (the metrics cost). Prints one JSON object.

Usage: python bench/loop_overhead.py [--steps 25] [--rounds 4]
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

from trainer.elastic import DistEnv
from trainer.hostmem import keep_freed_memory
from trainer.metrics import configure_multiprocess_dir

# The exporter's multiprocess dir must be chosen before prometheus_client is imported.
configure_multiprocess_dir(DistEnv(), True)
# Every variant runs in this one process, so all of them get the allocator settings the
# Trainer applies (bench/vs_diffusers.py compares whole processes, where that differs).
keep_freed_memory()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from trainer.data.datasets import DigitsDataset  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.optim import build_lr_schedule, build_optimizer  # noqa: E402
from trainer.registry import load_config, task_class  # noqa: E402
from trainer.tasks.base import TaskContext  # noqa: E402

COMMON = [
    "ema.enabled=false",  # the minimal loop has no EMA either
    "checkpoint.every_steps=0",
    "sample.every_steps=0",
    "sample.num=4",
    "sample.inference_steps=2",
    "train.val_every_steps=0",
    "train.log_every_steps=1000000",
    "data.val_fraction=0",
]


def gentrain_iterations(steps: int, workdir: str, extra: list[str]) -> list[float]:
    """Seconds of each full iteration of Trainer.fit's loop (timestamps at each train_step call)."""
    cfg = load_config(None, [*COMMON, f"train.max_steps={steps}", f"run.dir={workdir}", *extra], environ={})
    trainer = Trainer(cfg, DistEnv())
    stamps: list[float] = []
    run = trainer.step_runner.run

    def timed(batch, step):  # instrumentation only: records when each iteration reaches its step
        stamps.append(time.perf_counter())
        return run(batch, step)

    trainer.step_runner.run = timed
    assert trainer.fit() == 0
    return list(np.diff(stamps))


def minimal_iterations(steps: int) -> list[float]:
    """What a careful user writes by hand: the same model, data, optimizer, schedule, loss and clipping."""
    stamps: list[float] = []
    cfg = load_config(None, [*COMMON, f"train.max_steps={steps}"], environ={})
    task = task_class(cfg.task)(cfg.model_cfg, TaskContext(cfg.data.image_size, cfg.data.channels, cfg.seed))
    unet = task.build({})["unet"]
    opt = build_optimizer(unet, cfg)
    sched = build_lr_schedule(opt, cfg)
    data = DigitsDataset(cfg.data.image_size).images
    noise_sched = task.objective.train_scheduler
    g = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    perm, pos = rng.permutation(len(data)), 0
    b = cfg.train.batch_size
    for _ in range(steps):
        stamps.append(time.perf_counter())
        if pos + b > len(perm):
            perm, pos = rng.permutation(len(data)), 0
        x0 = data[torch.from_numpy(perm[pos : pos + b])]
        pos += b
        noise = torch.randn(x0.shape, generator=g)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (b,), generator=g)
        pred = unet(noise_sched.add_noise(x0, noise, t), t).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), cfg.train.max_grad_norm)
        opt.step()
        sched.step()
    return list(np.diff(stamps))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=25, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    threads = torch.get_num_threads()

    variants = {
        "minimal": lambda d: minimal_iterations(args.steps),
        "gentrain": lambda d: gentrain_iterations(args.steps, d, []),
        "gentrain_metrics": lambda d: gentrain_iterations(
            args.steps, d, [f"metrics.port={free_port()}", "metrics.host=127.0.0.1"]
        ),
    }
    samples: dict[str, list[float]] = {k: [] for k in variants}
    with tempfile.TemporaryDirectory() as tmp:
        minimal_iterations(3)  # warm-up: first-call allocations and kernels
        for r in range(args.rounds):
            for name, fn in variants.items():
                # The first iterations of a run still allocate; keep the steady state.
                samples[name] += fn(os.path.join(tmp, f"{name}-{r}"))[2:]
    med = {k: statistics.median(v) for k, v in samples.items()}
    q = {k: [round(x, 4) for x in statistics.quantiles(v, n=4, method="inclusive")] for k, v in samples.items()}
    print(
        json.dumps(
            {
                "benchmark": "loop_overhead",
                "device": "cpu",
                "torch_threads": threads,
                "batch_size": 64,
                "iterations_per_variant": {k: len(v) for k, v in samples.items()},
                "median_step_seconds": {k: round(v, 4) for k, v in med.items()},
                "quartiles_step_seconds": q,
                "steps_per_second": {k: round(1 / v, 3) for k, v in med.items()},
                "gentrain_over_minimal": round(med["minimal"] / med["gentrain"], 4),
                "metrics_on_over_off": round(med["gentrain"] / med["gentrain_metrics"], 4),
                "targets": {"gentrain_over_minimal_min": 0.97, "metrics_on_over_off_min": 0.99},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
