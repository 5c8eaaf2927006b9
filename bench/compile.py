"""Compiled (train.compile: per-block torch.compile, trainer.engine.compile) vs eager training steps on CPU.

For a DiT-sized and a UNet-sized denoiser (the models of bench/memory.py), each variant runs in a process of
its own: the model is built (its blocks compiled for `compiled`), `--warmup` steps run (the first compiles:
its time is reported as `first_step_s`, with dynamo's own compile seconds, graphs and graph breaks), then
`--steps` timed steps (forward, backward, AdamW). Eager and compiled processes alternate `--pairs` times, and
each pair gives a ratio eager/compiled of median step times (> 1: compiled is faster); the median ratio and
its interquartile range are printed as JSON with every process's figures, and the same ratio of each
process's fastest step (less moved by other load on a shared machine).

The inductor cache (TORCHINDUCTOR_CACHE_DIR, by default under /tmp) is warm after the first compiled process,
so later processes' `first_step_s` is the cached compile; the first one's is a cold compile.

Usage: python bench/compile.py [--models dit unet] [--pairs 3] [--steps 10] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from trainer.diffusion import build_backbone
from trainer.engine.compile import CompileStats, compile_blocks

MODELS = {
    # DiT-S/2 on 32x32x4 latents: 12 blocks of width 384, 256 tokens
    "dit": (
        {"kind": "dit", "num_layers": 12, "num_attention_heads": 6, "attention_head_dim": 64, "patch_size": 2},
        32,
        4,
    ),
    # the digits UNet's shape at 32x32 (ddpm's UNet2DModel, attention in the lowest resolution)
    "unet": ({"kind": "unet", "block_out_channels": [32, 64, 64], "norm_num_groups": 8}, 32, 1),
}


def child(model: str, variant: str, batch: int, warmup: int, steps: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg, size, channels = MODELS[model]
    backbone = build_backbone(cfg, size, channels, num_classes=10)
    net = backbone.model
    blocks = len(compile_blocks(net)) if variant == "compiled" else 0
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, channels, size, size, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g)
    labels = torch.randint(0, 10, (batch,), generator=g)
    net.train()

    def step() -> float:
        start = time.perf_counter()
        loss = (backbone(x, t, {"labels": labels}) - x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    first = step()
    for _ in range(warmup - 1):
        step()
    times = [step() for _ in range(steps)]
    out = {
        "model": model,
        "variant": variant,
        "blocks_compiled": blocks,
        "first_step_s": round(first, 3),
        "step_s_median": round(statistics.median(times), 4),
        "step_s_min": round(min(times), 4),
    }
    if variant == "compiled":
        stats = CompileStats.now()
        out |= {
            "compile_s": round(stats.seconds, 2),
            "graphs": stats.graphs,
            "graph_breaks": stats.graph_breaks,
            "recompiles": stats.recompiles,
        }
    return out


def _quartiles(values: list[float]) -> list[float]:
    if len(values) < 2:
        return [values[0], values[0]]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return [round(q[0], 3), round(q[2], 3)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--child", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.batch, args.warmup, args.steps, args.threads)))
        return
    results = {}
    for model in args.models:
        runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
        ratios, best = [], []
        for _ in range(args.pairs):
            for variant in ("eager", "compiled"):  # a process each, alternating: drift hits both alike
                cmd = [sys.executable, __file__, "--child", model, variant]
                cmd += ["--batch", str(args.batch), "--warmup", str(args.warmup), "--steps", str(args.steps)]
                cmd += ["--threads", str(args.threads)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            ratios.append(runs["eager"][-1]["step_s_median"] / runs["compiled"][-1]["step_s_median"])
            best.append(runs["eager"][-1]["step_s_min"] / runs["compiled"][-1]["step_s_min"])
        results[model] = {
            "eager_over_compiled": round(statistics.median(ratios), 3),
            "iqr": _quartiles(ratios),
            # the fastest step of each process: less moved by other load on a shared machine than the median
            "eager_over_compiled_best_steps": round(statistics.median(best), 3),
            "best_steps_iqr": _quartiles(best),
            "runs": runs,
        }
    meta = {"batch": args.batch, "threads": args.threads, "steps": args.steps, "pairs": args.pairs}
    print(json.dumps({**meta, "torch": torch.__version__, "results": results}, indent=1))


if __name__ == "__main__":
    main()
