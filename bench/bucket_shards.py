"""What aspect-ratio buckets cost a shard source: range requests per image, and the one pass over the sizes.

Prints one JSON object. A folder of random-noise JPEGs of mixed aspect ratios is packed with `gentrain data pack`
into local shards; the same training split is read for `--steps` steps of `--batch` by one rank's loader (no
workers; the first batch untimed), once in the default shard order (`data.shuffle_block` runs of neighbours) and once in
`data.buckets=auto` (a bucketed batch draws one bucket's samples from the whole set: one byte range a sample,
docs/data.md). Reported: range requests per image and images/s of each, and what building the bucketed split
costs at start per 1,000 images (ms): its sizes read from the indexes (`data pack` lists them), from one pass
over the images' headers (the indexes stripped of them), and from the run's manifest (a restart).

Usage: python bench/bucket_shards.py [--images 2048] [--per-shard 256] [--batch 64] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(96, 96), (80, 120), (120, 80), (72, 128), (128, 72), (90, 110)]  # (h, w)


def make_folder(root: Path, n: int) -> None:
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i in range(n):
        h, w = SHAPES[i % len(SHAPES)]
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(root / f"{i:06d}.jpg", quality=90)


def read(cfg, steps: int) -> dict:
    from trainer.data import build_splits, build_train_loader  # here: torch-heavy (the checkout's, sys.path above)

    train, _, _ = build_splits(cfg)
    loader = build_train_loader(train, cfg, cursor=0, rank=0, world_size=1)
    requests = images = 0
    batches = iter(loader)
    next(batches)  # the first batch (the indexes' first reads) is not timed
    t0 = time.perf_counter()
    for _, batch in zip(range(steps), batches, strict=False):
        requests += batch["io"]["requests"]
        images += len(batch["positions"])
    seconds = time.perf_counter() - t0
    return {"requests_per_image": round(requests / images, 3), "images_per_s": round(images / seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--per-shard", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    # Imported here: torch-heavy, and the checkout's trainer (put on sys.path above), not an installed one.
    from trainer.data import build_splits
    from trainer.data.pack import pack_folder
    from trainer.registry import load_config

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_folder(root / "images", a.images)
        pack_folder(str(root / "images"), str(root / "shards"), a.per_shard, progress=False)
        base = [
            "data.source=shards",
            f"data.urls={root}/shards/shards.json",
            "data.image_size=96",
            "data.channels=3",
            "data.val_fraction=0",
            f"train.batch_size={a.batch}",
        ]
        bucketed = [*base, "data.buckets=auto", "data.bucket_step=8", "data.bucket_max_ratio=2"]
        out: dict = {"images": a.images, "batch": a.batch, "steps": a.steps}
        out["default_order"] = read(load_config(None, [*base, f"run.dir={root}/plain"], environ={}), a.steps)
        out["buckets"] = read(load_config(None, [*bucketed, f"run.dir={root}/run"], environ={}), a.steps)
        for name in ("listed", "headers", "manifest"):  # sizes from the indexes, the headers, the run's manifest
            if name == "headers":  # the indexes without their sizes: one pass over the images' headers
                for index in (root / "shards").glob("*.idx.json"):
                    doc = json.loads(index.read_text())
                    doc.pop("sizes")
                    index.write_text(json.dumps(doc))
            cfg = load_config(
                None, [*bucketed, f"run.dir={root}/{'headers' if name == 'manifest' else name}"], environ={}
            )
            t0 = time.perf_counter()
            build_splits(cfg)
            out[f"start_sizes_{name}_ms_per_1000_images"] = round((time.perf_counter() - t0) * 1e6 / a.images, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
