"""The GPU checks and figures: each variant a `gentrain train` process on the GPU, its logged rates read back.

Variants (pick with --variants; all by default):
- `ddpm-fp32`, `ddpm-bf16`: the digits UNet (`digits-ddpm`), TF32 matmuls / bf16 autocast.
- `dit-eager`, `dit-compile`, `dit-blocks`, `dit-compile-blocks`, `dit-8bit`: a DiT-S/2-sized denoiser (12 blocks, width 384,
  patch 2) on 32x32 digits (256 tokens), bf16, batch 256: eager; `train.compile=true` (regional, per
  block); activation checkpointing `blocks`; both; `train.optimizer=adamw8bit` (torchao).
- `dit-fsdp-async`: the same DiT under torchrun (NCCL, one process) with `train.parallel=fsdp` and
  asynchronous checkpoints every 20 steps (pinned host buffers, background serialization).

Printed as JSON: per variant the median samples/s, step seconds, TFLOP/s and MFU over the second half of
its steps (the first half holds compile and warm-up), the compile line when there is one, the GPU's peak
memory (`gpu_mem_gb` of the log lines: torch's peak allocation), and the exit code; ratios against `dit-eager` for the DiT variants.

Usage: python bench/gpu.py [--variants ddpm-fp32 dit-eager ...] [--steps 200] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

DIT = "{kind: dit, num_layers: 12, num_attention_heads: 6, attention_head_dim: 64, patch_size: 2}"
DIT_ARGS = [
    "digits-ddpm",
    f"model.backbone={DIT}",
    "model.num_classes=10",
    "data.image_size=32",
    "train.batch_size=256",
    "train.precision=bf16",
]
VARIANTS: dict[str, list[str]] = {
    "ddpm-fp32": ["digits-ddpm"],
    "ddpm-bf16": ["digits-ddpm", "train.precision=bf16"],
    "dit-eager": DIT_ARGS,
    "dit-compile": [*DIT_ARGS, "train.compile=true"],
    "dit-blocks": [*DIT_ARGS, "train.activation_checkpointing=blocks"],
    "dit-compile-blocks": [*DIT_ARGS, "train.compile=true", "train.activation_checkpointing=blocks"],
    "dit-8bit": [*DIT_ARGS, "train.optimizer=adamw8bit"],
    "dit-fsdp-async": [*DIT_ARGS, "train.parallel=fsdp", "checkpoint.async=true", "checkpoint.every_steps=20"],
}
TORCHRUN = {"dit-fsdp-async"}

_STEP = re.compile(r"step=(\d+)/\d+ (.*)")
_FIELD = re.compile(r"(\w+)=([\d.e+-]+)")


def run(name: str, steps: int, out: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        args = [*VARIANTS[name], f"run.dir={tmp}/run", f"train.max_steps={steps}", "train.log_every_steps=1"]
        args += ["sample.every_steps=0", "sample.num=4", "train.val_every_steps=0"]
        if name not in TORCHRUN:
            args.append("checkpoint.every_steps=0")
        if name in TORCHRUN:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--master-addr=127.0.0.1"]
            cmd += ["--master-port=29555", "-m", "trainer", "train", *args]
        else:
            cmd = [sys.executable, "-m", "trainer", "train", *args]
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - start
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(r.stderr)
    rows = []
    for m in _STEP.finditer(r.stderr):
        fields = {k: float(v) for k, v in _FIELD.findall(m.group(2))}
        rows.append((int(m.group(1)), fields))
    late = [f for step, f in rows if step > steps // 2]
    result: dict = {"exit": r.returncode, "wall_s": round(wall, 1), "steps_logged": len(rows)}

    def med(key: str) -> float | None:
        values = [f[key] for f in late if key in f]
        return statistics.median(values) if values else None

    sps = med("samples_per_s")
    if sps:
        batch = 256 if name.startswith("dit") else 64
        result |= {"samples_per_s": round(sps, 1), "step_s": round(batch / sps, 4)}
    for key in ("tflops", "mfu"):
        value = med(key)
        if value is not None:
            result[key] = round(value, 4)
    mem = [f["gpu_mem_gb"] for _, f in rows if "gpu_mem_gb" in f]
    if mem:
        result["gpu_mem_gb"] = max(mem)
    compile_line = re.search(r"compile: [\d.]+ s compiling.*", r.stderr)
    if compile_line:
        result["compile"] = compile_line.group(0)
    device = re.search(r"device=(\S+)", r.stderr)
    result["device"] = device.group(1) if device else None
    peak = re.search(r"throughput: .* peak (.*)", r.stderr)
    result["peak"] = peak.group(1) if peak else None
    commits = re.findall(r"checkpoint committed \S+ \(([^)]*)\)", r.stderr)
    if commits:
        result["checkpoints"] = commits[-3:]
    if r.returncode != 0:
        result["stderr_tail"] = r.stderr[-2000:]
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--out", default=".")
    args = p.parse_args()
    results = {}
    for name in args.variants:
        results[name] = run(name, args.steps, args.out)
        print(json.dumps({name: results[name]}), flush=True)
    base = results.get("dit-eager", {}).get("step_s")
    if base:
        for name, r in results.items():
            if name.startswith("dit") and r.get("step_s"):
                r["step_time_vs_eager"] = round(r["step_s"] / base, 3)
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    print(json.dumps({"gpu": gpu, "torch": torch.__version__, "steps": args.steps, "results": results}, indent=1))


if __name__ == "__main__":
    main()
