"""How far the digits presets' steps are from this CPU's limit: the MFU each logs (achieved FLOP/s over a
float32 matmul timed at start-up on the run's threads, trainer/engine/throughput.py).

Each preset trains `--steps` steps in a process of its own (`gentrain train <preset>`, its own model and
batch, log every step, no checkpoints, samples or validation) with `--threads` threads; the first
`--skip` steps are dropped (start-up, allocator warm-up) and the median of the rest is reported with its
interquartile range, next to the FLOPs per step and the peak the run measured. The latent presets need
their autoencoder's run (runs/digits-autoencoder, `gentrain train digits-autoencoder`) and maskgit its
VQ-GAN's (runs/digits-vqgan); a preset whose frozen part is missing is reported as skipped.

Usage: python bench/mfu.py [--presets digits-ddpm ...] [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

PRESETS = [
    "digits-ddpm",
    "digits-cfg",
    "digits-autoencoder",
    "digits-vqgan",
    "digits-latent-dit",
    "digits-latent-mmdit",
]
NEEDS = {"digits-latent-dit": "runs/digits-autoencoder", "digits-latent-mmdit": "runs/digits-autoencoder"}

_STEP = re.compile(r"step=(\d+)/\d+ .* mfu=([\d.]+)")
_FLOPS = re.compile(r"throughput: ([\d.e+]+) GFLOP per step on this process; peak ([\d.e+]+) TFLOP/s \(([^)]*)\)")


def run(preset: str, steps: int, threads: int, skip: int) -> dict:
    if preset in NEEDS and not Path(NEEDS[preset]).is_dir():
        return {"skipped": f"needs {NEEDS[preset]} (train its preset first)"}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "trainer", "train", preset, f"run.dir={tmp}/run", f"train.max_steps={steps}"]
        cmd += ["train.log_every_steps=1", "train.val_every_steps=0", "sample.every_steps=0", "sample.num=1"]
        cmd += ["checkpoint.every_steps=0", "eval.every_steps=0", f"train.threads={threads}"]
        r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        return {"failed": r.returncode, "stderr": r.stderr[-1500:]}
    mfus = [float(m.group(2)) for m in _STEP.finditer(r.stderr) if int(m.group(1)) > skip]
    flops = _FLOPS.search(r.stderr)
    q = statistics.quantiles(mfus, n=4, method="inclusive") if len(mfus) > 1 else [mfus[0]] * 3
    return {
        "mfu_median": round(statistics.median(mfus), 4),
        "mfu_iqr": [round(q[0], 4), round(q[2], 4)],
        "steps_measured": len(mfus),
        "gflop_per_step": float(flops.group(1)) if flops else None,
        "peak_tflops": float(flops.group(2)) if flops else None,
        "peak_source": flops.group(3) if flops else None,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=PRESETS)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    results = {preset: run(preset, args.steps, args.threads, args.skip) for preset in args.presets}
    print(json.dumps({"steps": args.steps, "threads": args.threads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
