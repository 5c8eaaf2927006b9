"""gentrain vs diffusers' `train_unconditional.py`: paired whole-process runs, per-step time and CPU.

Both sides train the same UNet (32/64 channels, one layer per block, no
attention in the down/up blocks, GroupNorm 8), batch 64, EMA (max decay
0.9999, power 3/4, warm-up), AdamW (lr 1e-4, betas 0.95/0.999, weight decay
1e-6), cosine schedule with 500 warm-up steps, linear betas, epsilon loss
without SNR weighting, gradient clipping at 1.0, no workers, on 1,792 16x16
RGB digits written as PNG files (a multiple of 64, so no epoch ends with a
short batch that would flatter the side that has one). Each side ends with a
tiny preview (4 images, 2 inference steps) and a final save.

Each repeat runs both programs at two step counts (28 and 196 by default:
one and seven epochs), in alternating order (gentrain first on even repeats,
diffusers first on odd ones) so drifting machine load hits both alike. The
steady-state cost per step is (large - small) / (196 - 28), which cancels
start-up, the final preview and the final save; start-up is what remains of
the small run. Wall time, user CPU and system CPU come from
`resource.getrusage(RUSAGE_CHILDREN)` around each process. The JSON gives,
per side, the median and quartiles over repeats, and the ratios
gentrain/diffusers (steps per second: above 1 means gentrain is faster; CPU
per step: below 1 means gentrain uses less).

The diffusers side is, by default, `bench/diffusers_baseline.py`: the
script's training step rebuilt on the same diffusers/accelerate API (its
docstring lists exactly where it differs from the script). To run the real
script instead, pass `--script PATH/TO/train_unconditional.py --python
VENV/bin/python` where that venv can import `torchvision` and `datasets`: here
that is a separate venv with torch 2.14.1 + torchvision 0.29.1 (the CUDA wheels,
5.5 GB; they run on CPU), then `pip install datasets tensorboard diffusers accelerate`; its gentrain side still runs with the interpreter running
this file. The script's `check_min_version` wants diffusers >= 0.40. (A
PIL-based stand-in for `torchvision.transforms` does not work: transformers,
which diffusers imports through peft, then takes torchvision as installed and
imports the rest of it.)

Usage (2 cores, hold the shared lock):
    flock /tmp/gentrain-cpu.lock python bench/vs_diffusers.py [--repeats 5] [--steps 28 196]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
BATCH = 64
NUM_IMAGES = 1792  # 28 full batches per epoch
SIZE = 16
UNET = {
    "sample_size": SIZE,
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": [32, 64],
    "layers_per_block": 1,
    "down_block_types": ["DownBlock2D", "DownBlock2D"],
    "up_block_types": ["UpBlock2D", "UpBlock2D"],
    "norm_num_groups": 8,
}


def write_image_folder(root: Path) -> None:
    """The first 1,792 UCI digits, upsampled to 16x16 (as gentrain's digits source does), as RGB PNGs."""
    import torch
    import torch.nn.functional as F
    from PIL import Image

    # the harness itself imports nothing of either side: each side runs in its own measured process
    from trainer.data.datasets import load_digits_arrays

    images, _ = load_digits_arrays()
    x = torch.from_numpy(images[:NUM_IMAGES].astype(np.float32) / 16.0).unsqueeze(1)
    x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False).clamp(0, 1)
    gray = (x[:, 0].numpy() * 255).round().astype(np.uint8)
    root.mkdir(parents=True, exist_ok=True)
    for i, g in enumerate(gray):
        Image.fromarray(np.repeat(g[..., None], 3, axis=-1), "RGB").save(root / f"{i:04d}.png")


def write_unet_config(folder: Path) -> None:
    """The UNet as a diffusers config (`--model_config_name_or_path`), built by diffusers itself."""
    from diffusers import UNet2DModel

    UNet2DModel(**UNET).save_config(folder)


def gentrain_cmd(python: str, steps: int, data: Path, out: Path, workers: int) -> list[str]:
    return [
        python,
        "-m",
        "trainer",
        "train",
        "digits-ddpm",
        "data.source=folder",
        f"data.path={data}",
        "data.channels=3",
        f"data.image_size={SIZE}",
        "data.val_fraction=0",
        "data.flip=false",
        f"train.max_steps={steps}",
        f"train.batch_size={BATCH}",
        "train.lr=1e-4",
        "train.warmup_steps=500",
        "train.lr_schedule=cosine",
        "train.betas=[0.95,0.999]",
        "train.weight_decay=1e-6",
        "train.max_grad_norm=1.0",
        f"train.num_workers={workers}",
        "train.val_every_steps=0",
        "train.log_every_steps=50",
        "ema.enabled=true",
        "ema.decay=0.9999",
        "ema.power=0.75",
        "ema.inv_gamma=1.0",
        "ema.warmup=true",
        f"model.block_out_channels={UNET['block_out_channels']}",
        "model.layers_per_block=1",
        "model.attention=false",
        f"model.norm_num_groups={UNET['norm_num_groups']}",
        "model.dropout=0",
        "model.snr_gamma=null",
        "model.beta_schedule=linear",
        "model.prediction_type=epsilon",
        "model.num_train_timesteps=1000",
        "checkpoint.every_steps=0",
        "sample.every_steps=0",
        "sample.num=4",
        "sample.inference_steps=2",
        f"run.dir={out}",
    ]


def diffusers_cmd(
    python: str, script: Path, steps: int, data: Path, unet_cfg: Path, out: Path, workers: int
) -> list[str]:
    return [
        python,
        str(script),
        "--train_data_dir",
        str(data),
        "--resolution",
        str(SIZE),
        "--center_crop",
        "--train_batch_size",
        str(BATCH),
        "--num_epochs",
        str(steps * BATCH // NUM_IMAGES),
        "--use_ema",
        "--model_config_name_or_path",
        str(unet_cfg),
        "--eval_batch_size",
        "4",
        "--ddpm_num_inference_steps",
        "2",
        "--dataloader_num_workers",
        str(workers),
        "--checkpointing_steps",
        "1000000",
        "--save_images_epochs",
        "1000000",
        "--save_model_epochs",
        "1000000",
        "--output_dir",
        str(out),
    ]


def run_child(cmd: list[str], env: dict[str, str], log: Path) -> dict[str, float]:
    """Wall, user and system seconds of one whole process (and its children)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        code = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"{cmd[:3]} exited {code}; see {log}:\n{log.read_text()[-3000:]}")
    return {
        "wall": wall,
        "user": after.ru_utime - before.ru_utime,
        "sys": after.ru_stime - before.ru_stime,
        "minflt": after.ru_minflt - before.ru_minflt,
    }


def summary(values: list[float], digits: int = 4) -> dict[str, float]:
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": round(med, digits), "q1": round(q1, digits), "q3": round(q3, digits)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, nargs=2, default=[28, 196], metavar=("SMALL", "LARGE"))
    ap.add_argument("--workers", type=int, default=0, help="data loader workers on both sides")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS for both sides (1: CPU per step stays meaningful when other jobs share the cores)",
    )
    ap.add_argument("--script", type=Path, default=REPO / "bench" / "diffusers_baseline.py")
    ap.add_argument("--python", default=sys.executable, help="interpreter for the diffusers side")
    ap.add_argument("--keep", type=Path, default=None, help="keep run folders and logs here")
    args = ap.parse_args()
    small, large = args.steps
    if small >= large or (small * BATCH) % NUM_IMAGES or (large * BATCH) % NUM_IMAGES:
        raise SystemExit(f"--steps must be two increasing multiples of {NUM_IMAGES // BATCH} (whole epochs)")

    with tempfile.TemporaryDirectory() as tmp:
        work = args.keep or Path(tmp)
        data, unet_cfg = work / "digits16", work / "unet"
        write_image_folder(data)
        write_unet_config(unet_cfg)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        env.update(HF_HUB_OFFLINE="1", TQDM_MININTERVAL="1")
        if args.threads:
            env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
        sides = {
            "gentrain": lambda n, out: run_child(
                gentrain_cmd(sys.executable, n, data, out, args.workers), env, out.with_suffix(".log")
            ),
            "diffusers": lambda n, out: run_child(
                diffusers_cmd(args.python, args.script, n, data, unet_cfg, out, args.workers),
                env,
                out.with_suffix(".log"),
            ),
        }
        runs: dict[str, dict[int, list[dict[str, float]]]] = {s: {small: [], large: []} for s in sides}
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for n in (small, large):
                for side in order:
                    runs[side][n].append(sides[side](n, work / f"{side}-{n}-{r}"))
                    print(f"repeat {r} {side} {n} steps: {runs[side][n][-1]}", file=sys.stderr, flush=True)

    dn = large - small
    per_step: dict[str, dict[str, list[float]]] = {}
    for side in sides:
        pairs = list(zip(runs[side][small], runs[side][large], strict=True))
        per_step[side] = {k: [(b[k] - a[k]) / dn for a, b in pairs] for k in ("wall", "user", "sys", "minflt")}
        per_step[side]["startup_wall"] = [a["wall"] - small * (b["wall"] - a["wall"]) / dn for a, b in pairs]
    g, d = per_step["gentrain"], per_step["diffusers"]
    # Paired ratios: repeat r of one side against repeat r of the other (run back to back).
    steps_ratio = [dw / gw for gw, dw in zip(g["wall"], d["wall"], strict=True)]
    cpu_ratio = [(gu + gs) / (du + ds) for gu, gs, du, ds in zip(g["user"], g["sys"], d["user"], d["sys"], strict=True)]
    sys_ratio = [gs / ds for gs, ds in zip(g["sys"], d["sys"], strict=True)]
    print(
        json.dumps(
            {
                "benchmark": "vs_diffusers",
                "diffusers_side": str(
                    args.script.relative_to(REPO) if args.script.is_relative_to(REPO) else args.script
                ),
                "repeats": args.repeats,
                "steps": [small, large],
                "batch_size": BATCH,
                "workers": args.workers,
                "threads": args.threads or "default",
                "per_step_seconds": {
                    s: {k: summary(v) for k, v in per_step[s].items() if k != "minflt"} for s in sides
                },
                "per_step_minor_faults": {s: summary(per_step[s]["minflt"], 0) for s in sides},
                "gentrain_over_diffusers": {
                    "steps_per_second": summary(steps_ratio),
                    "steps_per_second_of_medians": round(
                        statistics.median(d["wall"]) / statistics.median(g["wall"]), 4
                    ),
                    "cpu_seconds_per_step": summary(cpu_ratio),
                    "system_seconds_per_step": summary(sys_ratio),
                },
                "target": {"steps_per_second_min": 1.0},
                "runs": {s: {str(n): v for n, v in runs[s].items()} for s in sides},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
