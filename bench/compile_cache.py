"""Compile time of a replacement worker with and without the run's compile cache (issue 49; the target: at most
0.3x), on whatever device this runs on.

Three `gentrain train` processes of one compiled run on one checkpoint root, each with an empty local inductor
cache (a fresh `TORCHINDUCTOR_CACHE_DIR`, as a replacement pod has):
- `first`: compiles from scratch and saves the signed cache (GENTRAIN_COMPILE_CACHE_KEY set);
- `cold`: a replacement that resumes with another key, so the store's copy is ignored: it compiles from scratch;
- `restored`: a replacement with the run's key: restores the cache, then compiles (looks its graphs up).
Each one's compile seconds are its own log's `compile: X s compiling` (dynamo's timers); the wall time of the
whole process is printed too. `cold` and `restored` alternate `--rounds` times, each from a copy of the
checkpoint root `first` left, so each resumes the same step; the median and the spread of the ratios print.

Usage: python bench/compile_cache.py [--preset digits-ddpm] [--rounds 2] [--json OUT] [--set key=value ...]
(default model: a 2-block DiT on the digits; `--set model.backbone={kind: dit, num_layers: 28, ...}` for
DiT-XL/2 shapes on a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DIT = "{kind: dit, num_layers: 2, num_attention_heads: 2, attention_head_dim: 8}"
_COMPILE = re.compile(r"compile: ([0-9.]+) s compiling")


def _worker(args: list[str], root: Path, key: str, inductor: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENTRAIN_")}
    env.update(GENTRAIN_COMPILE_CACHE_KEY=key, TORCHINDUCTOR_CACHE_DIR=str(inductor), PYTHONUNBUFFERED="1")
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trainer", "train", *args], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"gentrain train failed ({done.returncode}):\n{done.stderr[-3000:]}")
    found = _COMPILE.search(done.stderr)
    restored = "compile cache: restored" in done.stderr
    out = {"compile_s": float(found.group(1)) if found else None, "wall_s": round(wall, 2), "restored": restored}
    print(f"worker ({inductor.name}): {out}", file=sys.stderr, flush=True)  # kept if a later worker runs out of time
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="digits-ddpm")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--set", action="append", default=[], dest="overrides")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gentrain-compile-cache-"))
    try:
        root = work / "run" / "checkpoints"
        base = [
            a.preset,
            f"model.backbone={DIT}",
            "train.compile=true",
            "train.batch_size=16",
            "checkpoint.every_steps=2",
            "sample.every_steps=0",
            "metrics.port=0",
            f"run.dir={work}/run",
            *a.overrides,
        ]
        first = _worker([*base, "train.max_steps=2"], root, "run-key", work / "inductor-first")
        shutil.copytree(root, work / "saved")
        rounds = []
        for i in range(a.rounds):
            row = {}
            for way, key in (("cold", "another-key"), ("restored", "run-key")):
                shutil.rmtree(root)
                shutil.copytree(work / "saved", root)
                row[way] = _worker([*base, "train.max_steps=3"], root, key, work / f"inductor-{way}-{i}")
            rounds.append(row)
        ratios = [r["restored"]["compile_s"] / r["cold"]["compile_s"] for r in rounds]
        wall = [r["restored"]["wall_s"] / r["cold"]["wall_s"] for r in rounds]
        import torch

        device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({os.cpu_count()} cores)"
        out = {
            "bench": "compile_cache",
            "device": device,
            "torch": torch.__version__,
            "overrides": a.overrides,
            "first": first,
            "rounds": rounds,
            "compile_ratio_median": round(statistics.median(ratios), 3),
            "compile_ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
            "wall_ratio_median": round(statistics.median(wall), 3),
            "all_restored": all(r["restored"]["restored"] and not r["cold"]["restored"] for r in rounds),
        }
        text = json.dumps(out, indent=1)
        print(text)
        if a.json:
            Path(a.json).write_text(text)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
