"""Aspect-ratio buckets against the square-crop loader on the same images: steps/s, and the image each one trains.

One folder of images of eight aspect ratios (1:1, 5:4, 4:3, 3:2, 16:9 and the portrait ones; from 1:1.78 to
1.78:1, all within `data.bucket_max_ratio=2`), made here: each a gradient with a frame at its edges and a disc
at its centre, so a crop shows. The same run (a small UNet DDPM, `data.source=folder`, the same batch, seed and
steps) trains on it two ways:

- `square`: today's loader: every image resized to cover `data.image_size` squared and centre-cropped to it;
- `buckets`: `data.buckets=auto` (`data.image_size` squared pixels, sides multiples of `--bucket-step`, ratio
  at most 2: five buckets at 32^2 and step 4), each image resized to cover the bucket nearest its aspect ratio and
  centre-cropped to it; every global batch from one bucket (trainer/data/buckets.py).

Steps/s is `Trainer.fit`'s pace from step `--warmup` on (bench/latent_shards.py's `timed_fit`: the time between
step starts, the data wait included). Rounds alternate the ways (AB AB ...) so load drift on a shared machine
hits both alike; the median of each way's rounds is printed, and `buckets / square` per round (the two ran back
to back) as its median [min, max]. A bucket holds 0.9-1.0 x the square's pixels, so the pixels trained per
second are printed too. `load_ms_per_step` is what the training process spends loading one step's samples
(the split's items for the step's refs, in the run's own order: decode, cover resize, crop), median of
`--steps` steps timed alone, and `implied_buckets_vs_square` the ratio that difference alone gives against the
square run's step time: the steps/s ratios carry the shared machine's noise, this does not.

What each trains of the images (computed from the images' sizes and the same `cover_size` the loaders use):
- padding: pixels trained that are not image. Both loaders cover and crop, so it is 0 for both (a loader that
  letterboxed a 16:9 image into a square would train 44% padding);
- crop loss: pixels of the image (after the cover resize) that are not trained, per image, mean and worst.
  Square crops cut the long side of every non-square image; a bucket only the difference between the image's
  ratio and its bucket's.

`--preview PNG` writes a picture of what the bucketed run's loader hands the step: for one image of each aspect
ratio, the square crop (a held-out ref, as the previews and validation load) above its bucket's crop (a training
ref), at the loader's pixel sizes.

Usage: python bench/buckets.py [--images 162] [--steps 30] [--warmup 5] [--rounds 3] [--batch-size 8]
       [--image-size 32] [--bucket-step 4] [--threads 1] [--json OUT] [--preview PNG]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from trainer.data import build_splits
from trainer.data.buckets import bucket_list, cover_size, nearest_buckets
from trainer.data.sampler import SampleRef, StepBatchSampler
from trainer.registry import load_config

# (height, width) ratios of the folder: square, photo landscapes and their portraits.
RATIOS = [(1, 1), (4, 5), (5, 4), (3, 4), (4, 3), (2, 3), (3, 2), (9, 16), (16, 9)]
LONG_SIDE = 160  # pixels of each image's long side before the loaders resize it


def make_images(root: Path, count: int) -> list[tuple[int, int]]:
    """`count` RGB PNGs cycling through RATIOS, each a gradient (its hue from its index), a 6 px frame and a disc
    at the centre; returns their (height, width)."""
    root.mkdir(parents=True, exist_ok=True)
    sizes = []
    for i in range(count):
        rh, rw = RATIOS[i % len(RATIOS)]
        scale = LONG_SIDE / max(rh, rw)
        h, w = round(rh * scale), round(rw * scale)
        y, x = np.mgrid[0:h, 0:w]
        hue = (i * 37) % 256
        arr = np.stack([x * 255 // w, y * 255 // h, np.full((h, w), hue)], -1).astype(np.uint8)
        im = Image.fromarray(arr)
        draw = ImageDraw.Draw(im)
        draw.rectangle((0, 0, w - 1, h - 1), outline=(255, 255, 255), width=6)
        r = min(h, w) // 4
        draw.ellipse((w // 2 - r, h // 2 - r, w // 2 + r, h // 2 + r), fill=(20, 20, 20))
        im.save(root / f"{i:04d}-{h}x{w}.png")
        sizes.append((h, w))
    return sizes


def crop_figures(sizes: list[tuple[int, int]], targets: list[tuple[int, int]]) -> dict:
    """Per image: the share of its (cover-resized) pixels the crop to its target leaves out; mean and worst."""
    lost = []
    for (h, w), (th, tw) in zip(sizes, targets, strict=True):
        nh, nw = cover_size(h, w, th, tw)
        lost.append(1 - (th * tw) / (nh * nw))
    return {"padding": 0.0, "crop_loss_mean": round(float(np.mean(lost)), 4), "crop_loss_max": round(max(lost), 4)}


def preview(cfg, path: Path) -> None:
    """One image of each aspect ratio: its square crop above its bucket's crop, as the bucketed run loads them."""
    train, _, _ = build_splits(cfg)
    seen, picks = set(), []
    for local in range(len(train)):
        index = int(train.indices[local])
        ratio = RATIOS[index % len(RATIOS)]
        if ratio not in seen:
            seen.add(ratio)
            picks.append(local)
    picks.sort(key=lambda k: train.bucket_of(k)[0] / train.bucket_of(k)[1])
    pad, zoom = 8, max(1, 128 // cfg.data.image_size)  # tiles of about 128 px
    tiles = []
    for local in picks:
        square = train[SampleRef(index=local, position=0)][0]
        bucket = train[SampleRef(index=local, position=0, seed=cfg.seed)][0]
        tiles.append([to_image(square, zoom), to_image(bucket, zoom)])
    width = sum(max(a.width, b.width) for a, b in tiles) + pad * (len(tiles) + 1)
    top = max(a.height for a, _ in tiles)
    height = top + max(b.height for _, b in tiles) + pad * 3
    canvas = Image.new("RGB", (width, height), (255, 255, 255))
    x = pad
    for a, b in tiles:
        canvas.paste(a, (x, pad))
        canvas.paste(b, (x, top + 2 * pad))
        x += max(a.width, b.width) + pad
    path.parent.mkdir(parents=True, exist_ok=True)
    canvas.save(path)


def load_ms_per_step(cfg, steps: int) -> float:
    """Median ms to load one step's samples (the training split's items for the step's refs, from step 0)."""
    train, _, _ = build_splits(cfg)
    sampler = StepBatchSampler(train.make_stream(cfg.seed), 0, cfg.train.batch_size, 0, 1)
    times = []
    for _, refs in zip(range(steps), sampler, strict=False):
        t0 = time.perf_counter()
        [train[r] for r in refs]
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def to_image(t: torch.Tensor, zoom: int) -> Image.Image:
    arr = ((t.permute(1, 2, 0).numpy() + 1) * 127.5).clip(0, 255).astype(np.uint8)
    im = Image.fromarray(arr)
    return im.resize((im.width * zoom, im.height * zoom), Image.Resampling.NEAREST)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=162)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--bucket-step", type=int, default=4, help="data.bucket_step (the small UNet's factor is 2)")
    p.add_argument("--threads", type=int, default=1, help="train.threads of both ways")
    p.add_argument("--json", default=None)
    p.add_argument("--preview", default=None, help="write the picture of the two loaders' crops here")
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # here: bench/ is not a package (the sibling script's timed fit), and the figures above need no trainer loop
    from latent_shards import timed_fit

    work = Path(tempfile.mkdtemp(prefix="buckets-bench-"))
    sizes = make_images(work / "images", args.images)
    common = [
        "data.source=folder",
        f"data.path={work}/images",
        f"data.image_size={args.image_size}",
        "data.channels=3",
        "data.val_fraction=0",
        "data.flip=false",
        "model.block_out_channels=[16,32]",
        "model.norm_num_groups=8",
        f"train.batch_size={args.batch_size}",
        f"train.max_steps={args.steps}",
        "train.log_every_steps=1000",
        "train.val_every_steps=0",
        "sample.every_steps=0",
        "sample.inference_steps=1",  # the previews every fit draws at its end are not timed: the fewest
        "sample.num=1",
        "checkpoint.every_steps=0",
        f"train.threads={args.threads}",
    ]
    bucketed = ["data.buckets=auto", f"data.bucket_step={args.bucket_step}", "data.bucket_max_ratio=2"]

    def cfg(name: str, *extra: str):
        return load_config(None, [*common, f"run.dir={work}/{name}", *extra], environ={})

    ways = {
        "square": lambda r: timed_fit(cfg(f"square{r}"), args.warmup),
        "buckets": lambda r: timed_fit(cfg(f"buckets{r}", *bucketed), args.warmup),
    }
    rates: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        for name, way in ways.items():
            rates[name].append(way(r))
    median = {k: statistics.median(v) for k, v in rates.items()}
    load = {"square": load_ms_per_step(cfg("load-square"), args.steps)}
    load["buckets"] = load_ms_per_step(cfg("load-buckets", *bucketed), args.steps)
    step_ms = 1e3 / median["square"]
    per_round = [b / s for b, s in zip(rates["buckets"], rates["square"], strict=True)]

    buckets = bucket_list(cfg("plan", *bucketed).data)
    assign = nearest_buckets(np.asarray(sizes, dtype=np.float64), buckets)
    bucket_of = [buckets[int(k)] for k in assign]
    square = (args.image_size, args.image_size)
    pixels = float(np.mean([h * w for h, w in bucket_of])) / (args.image_size**2)  # a bucket's pixels / square's
    if args.preview:
        preview(cfg("preview", *bucketed), Path(args.preview))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {
        "bench": "buckets",
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "images": args.images,
        "ratios_hw": [f"{h}:{w}" for h, w in RATIOS],
        "image_size": args.image_size,
        "buckets": [list(b) for b in buckets],
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "steps_per_s": {k: round(v, 3) for k, v in median.items()},
        "buckets_vs_square": round(median["buckets"] / median["square"], 3),
        # Per round (the two ran back to back): median [min, max] of buckets / square.
        "buckets_vs_square_per_round": [
            round(statistics.median(per_round), 3),
            round(min(per_round), 3),
            round(max(per_round), 3),
        ],
        "rounds": {k: [round(x, 3) for x in v] for k, v in rates.items()},
        "load_ms_per_step": {k: round(v, 3) for k, v in load.items()},
        "implied_buckets_vs_square": round(step_ms / (step_ms + load["buckets"] - load["square"]), 4),
        "bucket_pixels_vs_square": round(pixels, 4),
        "trained_pixels_per_s_vs_square": round(median["buckets"] * pixels / median["square"], 3),
        "square": crop_figures(sizes, [square] * len(sizes)),
        "bucketed": crop_figures(sizes, bucket_of),
        "preview": args.preview,
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
