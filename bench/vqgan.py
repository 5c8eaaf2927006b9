"""VQ-GAN step benchmark: gentrain's two-phase step (generator, then discriminator) vs the same two
forward/backward passes in a hand-written loop.

Both use the digits-vqgan model (VQ autoencoder + PatchGAN), batch 64, the
adaptive adversarial weight, both optimizers with clipping and the
discriminator from step 0 (so every step has both phases); the gradient
penalty and the EMA are off in both. Runs are interleaved (A B A B ...) and
each variant's figure is the median iteration (see bench/loop_overhead.py
for why medians). Prints one JSON object; target: gentrain/hand >= 0.95.

Usage: python bench/vqgan.py [--steps 15] [--rounds 3]
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

from trainer.data.datasets import DigitsDataset
from trainer.elastic import DistEnv
from trainer.loop import Trainer
from trainer.models.gan import adaptive_weight, hinge_d
from trainer.optim import build_lr_schedule, build_optimizer
from trainer.registry import load_config, task_class
from trainer.tasks.base import TaskContext

COMMON = [
    "ema.enabled=false",
    "model.disc_start_step=0",
    "model.grad_penalty_every=0",
    "model.dead_code_threshold=0",
    "checkpoint.every_steps=0",
    "sample.every_steps=0",
    "train.val_every_steps=0",
    "train.log_every_steps=1000000",
    "data.val_fraction=0",
]


def gentrain_iterations(steps: int, workdir: str) -> list[float]:
    cfg = load_config("digits-vqgan", [*COMMON, f"train.max_steps={steps}", f"run.dir={workdir}"], environ={})
    trainer = Trainer(cfg, DistEnv())
    stamps: list[float] = []
    run = trainer.step_runner.run

    def timed(batch, step):  # instrumentation only
        stamps.append(time.perf_counter())
        return run(batch, step)

    trainer.step_runner.run = timed
    assert trainer.fit() == 0
    return list(np.diff(stamps))


def hand_iterations(steps: int) -> list[float]:
    """The loop a careful user writes: same modules, losses, optimizers and clipping."""
    cfg = load_config("digits-vqgan", [*COMMON, f"train.max_steps={steps}"], environ={})
    m = cfg.model_cfg
    task = task_class(cfg.task)(m, TaskContext(cfg.data.image_size, cfg.data.channels, cfg.seed))
    parts = task.build({})
    gen, disc = parts["generator"], parts["discriminator"]
    opts = {n: build_optimizer(parts[n], cfg, n) for n in parts}
    scheds = {n: build_lr_schedule(opts[n], cfg, n) for n in parts}
    data = DigitsDataset(cfg.data.image_size, cfg.data.channels).images
    rng = np.random.default_rng(0)
    perm, pos, b = rng.permutation(len(data)), 0, cfg.train.batch_size
    stamps: list[float] = []
    for _ in range(steps):
        stamps.append(time.perf_counter())
        if pos + b > len(perm):
            perm, pos = rng.permutation(len(data)), 0
        x = data[torch.from_numpy(perm[pos : pos + b])]
        pos += b
        # generator
        opts["generator"].zero_grad(set_to_none=True)
        disc.requires_grad_(False)
        out = gen(x)
        recon = out["reconstruction"]
        rec = (m.l1_weight * (recon - x).abs() + m.l2_weight * (recon - x).pow(2)).mean()
        adv = -disc(recon).mean()
        w = m.adv_weight * adaptive_weight(rec, adv, gen.last_layer, m.adaptive_weight_max)
        loss = rec + m.commitment_weight * out["commitment"].mean() + w * adv
        loss.backward()
        torch.nn.utils.clip_grad_norm_(gen.parameters(), cfg.train.max_grad_norm)
        opts["generator"].step()
        scheds["generator"].step()
        # discriminator
        disc.requires_grad_(True)
        opts["discriminator"].zero_grad(set_to_none=True)
        d_loss = hinge_d(disc(x), disc(recon.detach())).mean()
        d_loss.backward()
        torch.nn.utils.clip_grad_norm_(disc.parameters(), cfg.train.max_grad_norm)
        opts["discriminator"].step()
        scheds["discriminator"].step()
    return list(np.diff(stamps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    samples: dict[str, list[float]] = {"hand": [], "gentrain": []}
    with tempfile.TemporaryDirectory() as tmp:
        hand_iterations(3)  # warm-up
        for r in range(args.rounds):
            samples["hand"] += hand_iterations(args.steps)[2:]
            samples["gentrain"] += gentrain_iterations(args.steps, os.path.join(tmp, f"g{r}"))[2:]
    med = {k: statistics.median(v) for k, v in samples.items()}
    q = {k: [round(x, 4) for x in statistics.quantiles(v, n=4, method="inclusive")] for k, v in samples.items()}
    print(
        json.dumps(
            {
                "benchmark": "vqgan_step",
                "device": "cpu",
                "torch_threads": torch.get_num_threads(),
                "batch_size": 64,
                "iterations_per_variant": {k: len(v) for k, v in samples.items()},
                "median_step_seconds": {k: round(v, 4) for k, v in med.items()},
                "quartiles_step_seconds": q,
                "gentrain_over_hand": round(med["hand"] / med["gentrain"], 4),
                "target_min": 0.95,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
