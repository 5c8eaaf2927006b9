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
`shards_s3` reads with the default order (every sample shuffled on its own:
one range request per sample); `shards_s3_block<N>` with `data.shuffle_block=N`
(`--blocks`, runs of neighbouring samples shuffled together: a step's run is
one request). Reported: images/s per rank for each source, their ratio
(target >= 0.8), range requests per image, and bytes fetched per rank (data +
indexes) vs the tar bytes of the samples it used and vs their payload bytes
(image + caption, no tar headers).

Usage: python bench/data.py [--images 1024] [--size 64] [--steps 12] [--workers 2] [--blocks 16,64]
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
    io = {"data_bytes": 0, "index_bytes": 0, "used_bytes": 0, "requests": 0, "images": 0}

    def count(b: dict) -> int:
        for k in ("data_bytes", "index_bytes", "used_bytes", "requests"):
            io[k] += b.get("io", {}).get(k, 0)
        io["images"] += len(b["positions"])
        return len(b["positions"])

    # Each worker's start-up and first batch (its store session, the window's indexes) are not timed
    # (their bytes are counted): a training run pays them once, the timed steps are the steady state.
    for _ in range(max(1, cfg.train.num_workers)):
        count(next(it))
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
    ap.add_argument("--blocks", default="16,64", help="data.shuffle_block values: one shards_s3_block<N> source each")
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
            }
            s3 = [
                *common,
                "data.source=shards",
                f"data.urls={url}/shards.json",
                f"data.storage_options={json.dumps(opts)}",
            ]
            cfgs["shards_s3"] = load_config(None, s3, {})
            for block in (int(b) for b in args.blocks.split(",") if b):
                cfgs[f"shards_s3_block{block}"] = load_config(None, [*s3, f"data.shuffle_block={block}"], {})
            result: dict = {"images": args.images, "image_size": args.size, "batch": args.batch,
                            "workers": args.workers, "steps": args.steps, "shards": summary.shards,
                            "payload_bytes_per_image": round(payload)}  # fmt: skip
            for world in (1, 2):
                rates: dict[str, list[float]] = {k: [] for k in cfgs}
                io_per_rank: dict[str, list[dict]] = {}
                for _ in range(args.repeats):
                    for name, cfg in cfgs.items():
                        per_rank = [time_loader(cfg, r, world, args.steps) for r in range(world)]
                        rates[name].append(statistics.mean(p[0] for p in per_rank))
                        io_per_rank[name] = [p[1] for p in per_rank]
                med = {k: statistics.median(v) for k, v in rates.items()}
                result[f"world_{world}"] = {
                    "images_per_s_per_rank": {k: round(v, 1) for k, v in med.items()},
                    "spread": {k: [round(min(v), 1), round(max(v), 1)] for k, v in rates.items()},
                    **{f"ratio_{k}_vs_folder": round(med[k] / med["folder"], 3) for k in cfgs if k != "folder"},
                    "bytes_per_rank": {
                        name: [
                            {
                                **io,
                                "requests_per_image": round(io["requests"] / io["images"], 3),
                                "fetched_vs_used": round((io["data_bytes"] + io["index_bytes"]) / io["used_bytes"], 4),
                                "fetched_vs_payload": round(
                                    (io["data_bytes"] + io["index_bytes"]) / (payload * io["images"]), 4
                                ),
                            }
                            for io in ios
                        ]
                        for name, ios in io_per_rank.items()
                        if name.startswith("shards_s3")
                    },
                }
            print(json.dumps(result, indent=1))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
