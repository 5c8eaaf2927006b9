"""Peak host memory of a training step with activation checkpointing off, per block and selective; the
optimizer state of AdamW against torchao's AdamW8bit (train.optimizer=adamw8bit).

For a DiT-sized and a UNet-sized denoiser (gentrain's backbones, trainer.diffusion.build_backbone), each
variant in a process of its own: the model is built, its gradients and AdamW state allocated (one step on
zero gradients), then the peak RSS is reset (`/proc/self/clear_refs`, Linux) and one training step runs
(forward, backward, optimizer step). Printed as JSON: the resident memory before the step, the peak during
it and their difference (what the step added: activations and temporaries), and the seconds the step
took; per model, the ratio of the step's added memory with checkpointing to without.

`--optimizers adamw adamw8bit`: per model and optimizer, again a process each, gentrain's own optimizer
(trainer.optim.build_optimizer, weight decay groups included) after one step: the bytes of its state as held
(`state_bytes`: float32 averages, or 8-bit codes with their block scales and code maps), the resident memory
its first step added (taken on zero gradients before any forward, so freed activations cannot hide it: the
state and, for adamw8bit, torch.compile's code), the first step's seconds (adamw8bit compiles there; a later
process finds inductor's on-disk cache) and the medians of 5 training steps (forward, backward, optimizer)
and of their optimizer steps.

Usage: python bench/memory.py [--batch 8] [--models dit unet] [--modes none blocks selective]
       python bench/memory.py --modes --optimizers adamw adamw8bit
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time

import torch

from trainer.diffusion import build_backbone
from trainer.engine.remat import checkpoint_blocks

MODELS = {
    # DiT-S/2 on 32x32x4 latents (a 256-pixel image through the SD VAE): 12 blocks of width 384, 256 tokens
    "dit": (
        {"kind": "dit", "num_layers": 12, "num_attention_heads": 6, "attention_head_dim": 64, "patch_size": 2},
        32,
        4,
    ),
    # a pixel UNet at 64x64 (ddpm's UNet2DModel, attention in the lowest resolution)
    "unet": ({"kind": "unet", "block_out_channels": [64, 128, 256, 256], "norm_num_groups": 32}, 64, 3),
}


def _rss_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def child(model: str, mode: str, batch: int) -> dict:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg, size, channels = MODELS[model]
    backbone = build_backbone(cfg, size, channels, num_classes=10)
    net = backbone.model
    blocks = len(checkpoint_blocks(net, mode))
    params = sum(p.numel() for p in net.parameters())
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.0)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # allocates the AdamW state (zero gradients: the weights do not move)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    net.train()
    gc.collect()
    before = _rss_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak RSS, to the current RSS
    start = time.perf_counter()
    loss = (backbone(x, t, {"labels": labels}) - x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    seconds = time.perf_counter() - start
    peak = _rss_mb("VmHWM")
    return {
        "model": model,
        "mode": mode,
        "params_m": round(params / 1e6, 2),
        "blocks": blocks,
        "rss_before_mb": round(before, 1),
        "peak_mb": round(peak, 1),
        "step_added_mb": round(peak - before, 1),
        "step_s": round(seconds, 2),
    }


def optim_child(model: str, name: str, batch: int) -> dict:
    # only the optimizer variants need the config machinery (the activation variants build bare backbones)
    from trainer.optim import build_optimizer, state_bytes
    from trainer.registry import load_config

    torch.set_num_threads(1)
    torch.manual_seed(0)
    spec, size, channels = MODELS[model]
    backbone = build_backbone(spec, size, channels, num_classes=10)
    net = backbone.model
    cfg = load_config(None, [f"train.optimizer={name}", "train.weight_decay=0.01"], environ={})
    opt = build_optimizer(net, cfg)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    net.train()

    def backward() -> None:
        opt.zero_grad(set_to_none=False)
        (backbone(x, t, {"labels": labels}) - x).square().mean().backward()

    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    gc.collect()
    # Before any forward: memory a backward freed would be reused by the state and hide it from RSS.
    before = _rss_mb("VmRSS")
    start = time.perf_counter()
    opt.step()  # allocates the state on zero gradients (adamw8bit: compiles its step, a graph per shape)
    first = time.perf_counter() - start
    gc.collect()
    added = _rss_mb("VmRSS") - before
    opt_times, step_times = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        opt_times.append(t2 - t1)
        step_times.append(t2 - t0)
    params = sum(p.numel() for p in net.parameters())
    return {
        "model": model,
        "optimizer": name,
        "params_m": round(params / 1e6, 2),
        "state_mb": round(state_bytes(opt) / 2**20, 2),
        "state_bytes_per_param": round(state_bytes(opt) / params, 3),
        "rss_added_by_first_step_mb": round(added, 1),
        "first_step_s": round(first, 2),
        "optimizer_step_s": round(sorted(opt_times)[2], 3),
        "train_step_s": round(sorted(step_times)[2], 3),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--modes", nargs="*", default=["none", "blocks", "selective"])
    p.add_argument("--optimizers", nargs="*", default=[], choices=["adamw", "adamw8bit"])
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--optim-child", nargs=2, metavar=("MODEL", "OPTIMIZER"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.batch)))
        return
    if args.optim_child:
        print(json.dumps(optim_child(*args.optim_child, args.batch)))
        return
    out: dict = {"batch": args.batch}
    if args.modes:
        out["results"] = activations(args)
    if args.optimizers:
        out["optimizer_state"] = optimizer_state(args)
    print(json.dumps(out, indent=1))


def optimizer_state(args: argparse.Namespace) -> dict:
    results = {}
    for model in args.models:
        rows = {}
        for name in args.optimizers:
            cmd = [sys.executable, __file__, "--batch", str(args.batch), "--optim-child", model, name]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode:
                raise SystemExit(run.stderr[-3000:])
            rows[name] = json.loads(run.stdout.strip().splitlines()[-1])
        if "adamw" in rows:
            for row in rows.values():
                row["state_vs_adamw"] = round(row["state_mb"] / rows["adamw"]["state_mb"], 3)
                row["train_step_vs_adamw"] = round(row["train_step_s"] / rows["adamw"]["train_step_s"], 3)
        results[model] = rows
    return results


def activations(args: argparse.Namespace) -> dict:
    results = {}
    for model in args.models:
        rows = {}
        for mode in args.modes:  # a process each: the peak of one cannot hide in another's
            cmd = [sys.executable, __file__, "--batch", str(args.batch), "--child", model, mode]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows[mode] = json.loads(out.strip().splitlines()[-1])
        if "none" in rows:
            base = rows["none"]["step_added_mb"]
            for row in rows.values():
                row["added_vs_none"] = round(row["step_added_mb"] / base, 3) if base else None
                row["time_vs_none"] = round(row["step_s"] / rows["none"]["step_s"], 3)
        results[model] = rows
    return results


if __name__ == "__main__":
    main()
