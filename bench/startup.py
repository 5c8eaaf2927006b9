"""Time to the first step: `gentrain train digits-ddpm` and a torchrun worker, this tree against a base tree.

A restart after a preemption, and every torchrun worker, pays its process's start-up before it trains again:
the interpreter, imports, building the parts, resuming, the first step. The figure is the run's own
`startup timings` log line: seconds from the process's start (read from /proc) to its first completed step,
with the share spent importing. The run is tiny so the step itself is small: digits-ddpm, batch 8, one
step, one thread, previews and validation off, no checkpoint before the end.

Each round runs every variant once, interleaved (A B A B ...) so a shared machine's load hits all alike:
`python -m trainer train` and `torch.distributed.run --standalone --nproc-per-node N -m trainer train`
(the worker's own figure, and `launch`: from starting torchrun to the worker's first step; `launch_to_exit`:
the whole tiny run, its final checkpoint, preview and the process's exit included), for this tree
and, with `--base DIR`, for another checkout of gentrain (a worktree of the commit before a change:
`git worktree add --detach ../base <commit>`), each imported through PYTHONPATH. Also timed, once a
round: `python -c "from diffusers import UNet2DModel"` (what importing one diffusers class cost before
trainer/lazy_packages.py) against the same import under the lazy packages. Printed: the median and the
spread (min, max) of each figure, and this tree's time over the base tree's, per round (the two ran back
to back, under the same load) and then the median of those ratios.

Usage: python bench/startup.py [--rounds 5] [--base ../base] [--nproc 1]
Target (issue 37, docs/benchmarks.md): half of the base tree's time to the first step.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "digits-ddpm",
    "train.max_steps=1",
    "train.batch_size=8",
    "train.threads=1",
    "train.val_every_steps=0",
    "checkpoint.every_steps=0",
    "checkpoint.lease=false",
    "sample.every_steps=0",
    "sample.num=1",
    "sample.inference_steps=1",
]
LINE = re.compile(r"startup timings \(s\): (\{.*\})")
IMPORT_ONE_CLASS = {
    "diffusers_top_level": "from diffusers import UNet2DModel",
    "lazy_packages": "import trainer; from diffusers.models.unets.unet_2d import UNet2DModel",
}


def _env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GENTRAIN_", "TORCHELASTIC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(PYTHONPATH=str(tree), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _boot_offset() -> float:
    """Seconds to subtract from a `startup timings` total: trainer.elastic reads the process's start from
    /proc as boot time + its start tick, and /proc/stat's boot time is whole seconds; /proc/uptime gives
    it to 10 ms. The same constant for every process, up to a second."""
    with open("/proc/uptime") as f:
        boot = time.time() - float(f.read().split()[0])
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot - btime


BOOT_OFFSET = _boot_offset()


def _run(cmd: list[str], tree: Path, workdir: str) -> dict[str, float]:
    launched = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(tree), cwd=workdir, timeout=900)
    ended = time.time()
    found = LINE.search(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not found:
        sys.exit(f"{' '.join(cmd)} (PYTHONPATH={tree}) failed, exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    t = json.loads(found.group(1))
    return {
        "first_step": round(t["total"] - BOOT_OFFSET, 3),
        "imports": round(t["imports"] - BOOT_OFFSET, 3),
        "launch_to_first_step": round(t["first_step_unix"] - launched, 3),
        # the whole tiny run: first step, final checkpoint and preview, and the process's exit
        "launch_to_exit": round(ended - launched, 3),
    }


def _import_time(code: str) -> dict[str, float]:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, env=_env(REPO), timeout=600)
    return {"wall": round(time.perf_counter() - t0, 3)}


def _summary(samples: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    return {
        key: {
            "median": round(statistics.median(s[key] for s in samples), 3),
            "min": min(s[key] for s in samples),
            "max": max(s[key] for s in samples),
        }
        for key in samples[0]
    }


def _machine() -> dict[str, str]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    versions = subprocess.run(
        [sys.executable, "-c", "import torch, diffusers; print(torch.__version__, diffusers.__version__)"],
        capture_output=True,
        text=True,
        env=_env(REPO),
    ).stdout.split()
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": platform.python_version(),
        "torch": versions[0] if versions else "?",
        "diffusers": versions[1] if len(versions) > 1 else "?",
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--base", type=Path, help="another gentrain checkout to time the same way (before a change)")
    p.add_argument("--nproc", type=int, default=1, help="torchrun workers (--nproc-per-node)")
    args = p.parse_args()
    trees = {"this": REPO} | ({"base": args.base.resolve()} if args.base else {})
    for tree in trees.values():
        # Both trees as an install runs them: pip writes bytecode when it installs gentrain (the image's too), and
        # under PYTHONDONTWRITEBYTECODE=1 (set here, in CI and in the image) a checkout's sources would otherwise
        # be compiled again by every process: 0.15 s of this tree's start-up, more of the base tree's.
        compileall.compile_dir(tree / "trainer", quiet=1)
    results: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="gentrain-startup-") as tmp:
        for r in range(args.rounds):
            for name, tree in trees.items():
                for kind in ("train", "torchrun"):
                    run_dir = f"{tmp}/{name}-{kind}-{r}"
                    launcher = (
                        ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}"]
                        if kind == "torchrun"
                        else []
                    )
                    cmd = [sys.executable, *launcher, "-m", "trainer", "train", *TINY, f"run.dir={run_dir}"]
                    results.setdefault(f"{name}/{kind}", []).append(_run(cmd, tree, tmp))
            for name, code in IMPORT_ONE_CLASS.items():
                results.setdefault(f"import_unet2d/{name}", []).append(_import_time(code))
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    out = {
        "machine": _machine(),
        "rounds": args.rounds,
        "nproc": args.nproc,
        "trees": {k: str(v) for k, v in trees.items()},
    }
    out["results"] = {k: _summary(v) for k, v in results.items()}
    if "base" in trees:
        # Per round (the two trees ran back to back, under the same load), then the median over rounds.
        out["this_over_base"] = {
            f"{kind}/{figure}": _summary(
                [
                    {figure: round(a[figure] / b[figure], 3)}
                    for a, b in zip(results[f"this/{kind}"], results[f"base/{kind}"], strict=True)
                ]
            )[figure]
            for kind in ("train", "torchrun")
            for figure in ("first_step", "launch_to_exit")
        }
    out["samples"] = results
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
