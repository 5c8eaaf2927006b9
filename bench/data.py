"""Data benchmark: the shard pipeline from a loopback S3 server vs the same images from a local folder.

Prints one JSON object. Same images, same run: a folder of JPEG crops of
scikit-learn's sample photos, packed with `gentrain data pack` into shards on
a moto S3 server on 127.0.0.1. For world sizes 1 and 2, each rank's loader
(`build_train_loader`, `train.num_workers` workers) is timed over the same
steps for both sources, one rank after the other (this machine has 2 cores:
running ranks side by side would measure contention, not the loader).
The same shards on local disk (byte ranges through fsspec's local filesystem)
separate the pipeline's own cost from the S3 server's (moto is a Python
server sharing the 2 cores with the loader workers).
Reported: images/s per rank for each source, their ratio (target >= 0.8),
and bytes fetched per rank (data + indexes) vs the tar bytes of the samples
it used and vs their payload bytes (image + caption, no tar headers).

Usage: python bench/data.py [--images 1024] [--size 64] [--steps 12] [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def make_folder(root: Path, n: int, size: int) -> None:
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    for i in range(n):
        photo = photos[i % len(photos)]
        y, x = rng.integers(0, photo.shape[0] - 2 * size), rng.integers(0, photo.shape[1] - 2 * size)
        crop = Image.fromarray(photo[y : y + 2 * size, x : x + 2 * size])
        cls = root / f"class{i % 4}"
        cls.mkdir(parents=True, exist_ok=True)
        crop.save(cls / f"{i:05d}.jpg", quality=90)
        (cls / f"{i:05d}.txt").write_text(f"photo crop {i}")


def time_loader(cfg, rank: int, world: int, steps: int) -> tuple[float, dict]:
    from trainer.data import build_splits, build_train_loader

    train, _, _ = build_splits(cfg)
    it = iter(build_train_loader(train, cfg, 0, rank, world))
    io = {"data_bytes": 0, "index_bytes": 0, "used_bytes": 0, "images": 0}

    def count(b: dict) -> int:
        for k in ("data_bytes", "index_bytes", "used_bytes"):
            io[k] += b.get("io", {}).get(k, 0)
        io["images"] += len(b["positions"])
        return len(b["positions"])

    count(next(it))  # worker start-up and the first fetch are not timed (their bytes are counted)
    t0 = time.perf_counter()
    images = sum(count(next(it)) for _ in range(steps))
    return images / (time.perf_counter() - t0), io


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from servers import S3_CREDENTIALS, S3Server

    from trainer.config import load_config
    from trainer.data.pack import pack_folder

    os.environ.update(S3_CREDENTIALS)
    server = S3Server().start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "src"
            make_folder(src, args.images, args.size)
            url = f"s3://{server.make_bucket()}/bench"
            opts = {"client_kwargs": {"endpoint_url": server.endpoint}}
            summary = pack_folder(str(src), url, 128, opts, progress=False)
            local = Path(tmp) / "shards"
            pack_folder(str(src), str(local), 128, None, progress=False)
            payload = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) / args.images
            common = [f"train.batch_size={args.batch}", f"train.num_workers={args.workers}", "data.channels=3",
                      f"data.image_size={args.size}", "data.val_fraction=0"]  # fmt: skip
            cfgs = {
                "folder": load_config(None, [*common, "data.source=folder", f"data.path={src}"], {}),
                "shards_local": load_config(
                    None, [*common, "data.source=shards", f"data.urls={local}/shards.json"], {}
                ),
                "shards_s3": load_config(
                    None,
                    [
                        *common,
                        "data.source=shards",
                        f"data.urls={url}/shards.json",
                        f"data.storage_options={json.dumps(opts)}",
                    ],
                    {},
                ),
            }
            result: dict = {"images": args.images, "image_size": args.size, "batch": args.batch,
                            "workers": args.workers, "steps": args.steps, "shards": summary.shards,
                            "payload_bytes_per_image": round(payload)}  # fmt: skip
            for world in (1, 2):
                rates: dict[str, list[float]] = {k: [] for k in cfgs}
                io_per_rank = []
                for _ in range(args.repeats):
                    for name, cfg in cfgs.items():
                        per_rank = [time_loader(cfg, r, world, args.steps) for r in range(world)]
                        rates[name].append(statistics.mean(p[0] for p in per_rank))
                        if name == "shards_s3":
                            io_per_rank = [p[1] for p in per_rank]
                med = {k: statistics.median(v) for k, v in rates.items()}
                result[f"world_{world}"] = {
                    "images_per_s_per_rank": {k: round(v, 1) for k, v in med.items()},
                    "spread": {k: [round(min(v), 1), round(max(v), 1)] for k, v in rates.items()},
                    "ratio_shards_s3_vs_folder": round(med["shards_s3"] / med["folder"], 3),
                    "ratio_shards_local_vs_folder": round(med["shards_local"] / med["folder"], 3),
                    "bytes_per_rank": [
                        {
                            **io,
                            "fetched_vs_used": round((io["data_bytes"] + io["index_bytes"]) / io["used_bytes"], 4),
                            "fetched_vs_payload": round(
                                (io["data_bytes"] + io["index_bytes"]) / (payload * io["images"]), 4
                            ),
                        }
                        for io in io_per_rank
                    ],  # fmt: skip
                }
            print(json.dumps(result, indent=1))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
