"""Bytes a `gentrain sample` reads from a checkpoint with AdamW state (issue 51, "read what you load"; the
target: at most 1.1x the EMA file's size), against `checkpoints verify` (the full check) on the same step.

One `gentrain train` of the preset writes one checkpoint; each command then runs under `strace -f -y` (Linux),
and the bytes of every `read`/`pread64`/`readv`/`preadv` whose descriptor is a file in that checkpoint's step dir
are summed per file. No timing: the figure is the same on any machine for the same checkpoint. Before this
change `gentrain sample` verified every file first (the optimizer's two moments included), then read the EMA
weights again: run this script at an earlier commit for that figure.

Usage: python bench/read_bytes.py [--preset digits-ddpm] [--json OUT] [--set key=value ...]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# strace -y: read(3</path/to/file>, "..."..., 65536) = 65536
_READ = re.compile(r"\b(?:read|pread64|readv|preadv|preadv2)\((\d+)<([^>]*)>.*\)\s+=\s+(\d+)")


def traced(argv: list[str], step_dir: Path, env: dict[str, str]) -> dict[str, int]:
    """{file name in `step_dir`: bytes read} by `python -m trainer ARGV` and its children."""
    with tempfile.NamedTemporaryFile(suffix=".strace") as log:
        cmd = ["strace", "-f", "-y", "-qq", "-e", "trace=read,pread64,readv,preadv,preadv2", "-o", log.name]
        done = subprocess.run([*cmd, sys.executable, "-m", "trainer", *argv], capture_output=True, text=True, env=env)
        if done.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(argv[:2])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        per_file: dict[str, int] = collections.Counter()
        prefix = str(step_dir.resolve()) + os.sep
        for line in Path(log.name).read_text(errors="replace").splitlines():
            m = _READ.search(line)
            if m and m.group(2).startswith(prefix):
                per_file[m.group(2)[len(prefix) :]] += int(m.group(3))
    return dict(per_file)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="digits-ddpm")
    p.add_argument("--json")
    p.add_argument("--set", action="append", default=[], dest="overrides")
    a = p.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("bench/read_bytes.py needs strace (apt-get install strace)")
    work = Path(tempfile.mkdtemp(prefix="gentrain-read-bytes-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GENTRAIN_")}
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    try:
        train = [a.preset, f"run.dir={work}/run", "train.max_steps=2", "checkpoint.every_steps=2", *a.overrides]
        done = subprocess.run(
            [sys.executable, "-m", "trainer", "train", *train], capture_output=True, text=True, env=env
        )
        if done.returncode != 0:
            raise SystemExit(f"gentrain train failed ({done.returncode}):\n{done.stderr[-3000:]}")
        root = work / "run" / "checkpoints"
        step_dir = next(d for d in sorted(root.iterdir()) if d.name.startswith("step-"))
        sizes = {f.name: f.stat().st_size for f in step_dir.iterdir()}
        ema = sum(n for name, n in sizes.items() if name.endswith(".ema.safetensors"))
        sample = traced(
            ["sample", str(step_dir), "--num", "1", "--steps", "1", "--out", str(work / "g.png")], step_dir, env
        )
        verify = traced(["checkpoints", "verify", str(step_dir)], step_dir, env)
        out = {
            "preset": a.preset,
            "checkpoint_bytes": sum(sizes.values()),
            "ema_bytes": ema,
            "files": sizes,
            "sample_read": sample,
            "sample_bytes": sum(sample.values()),
            "sample_over_ema": round(sum(sample.values()) / ema, 3),
            "verify_bytes": sum(verify.values()),
            "verify_over_ema": round(sum(verify.values()) / ema, 3),
        }
        print(json.dumps(out, indent=1))
        if a.json:
            Path(a.json).write_text(json.dumps(out, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
