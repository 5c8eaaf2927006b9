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
`shards_s3` and `shards_local` read with the default order (shuffle blocks of
8: a rank's slice of a step is a few runs of neighbouring samples, one range
request each); `shards_s3_block<N>` with `data.shuffle_block=N` (`--blocks`;
N=1: every sample shuffled on its own, one request per sample). Reported: images/s per rank for each source, their ratio
(target >= 0.8), range requests per image, and bytes fetched per rank (data +
indexes) vs the tar bytes of the samples it used and vs their payload bytes
(image + caption, no tar headers), and where each image's CPU goes (the
loader's own processes vs the S3 server's).

`train`: whether the loader is the bottleneck of the demo model. The
`digits-ddpm` preset's model (train.threads=1, batch 64, EMA on, no
checkpoints/samples/validation) trains in this process on the 1,797 UCI
digits written as 16x16 PNGs (class folders), once read from that folder and
once from the same images packed into shards on the moto server (each
`--train-blocks` value a `data.shuffle_block`; 0 = the default), 2 loader
workers each; reported: train steps/s over `--train-steps` steps after
`--train-warmup` steps, and the ratio to the folder run. The workers' queue
(2 workers x prefetch 2 = 4 batches, full when training starts) hides a
loader slower than the model by less than 4 batches over the run: with 68
steps, by less than about 6%.

Usage: python bench/data.py [--images 1024] [--size 64] [--steps 12] [--workers 2] [--blocks 1,16,64]
                            [--train-steps 60] [--train-blocks 0,1,64]
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


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far (another process: the S3 server)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loader_cpu(exclude: int | None) -> float:
    """CPU seconds of this process and its child processes (the loader workers), less `exclude` (the server)."""
    me = os.getpid()
    kids = Path(f"/proc/{me}/task/{me}/children").read_text().split()
    return time.process_time() + sum(process_cpu(int(k)) for k in kids if int(k) != exclude)


def time_loader(cfg, rank: int, world: int, steps: int, server_pid: int | None = None) -> tuple[float, dict]:
    # trainer (torch, the data stack) imported where used: the S3 server subprocess and the folder writer run without it
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
    cpu0, server0 = loader_cpu(server_pid), process_cpu(server_pid) if server_pid else 0.0
    t0 = time.perf_counter()
    images = sum(count(next(it)) for _ in range(steps))
    rate = images / (time.perf_counter() - t0)
    # CPU per image in the timed steps (the workers keep reading ahead meanwhile, as in training).
    io["loader_cpu_ms_per_image"] = 1000 * (loader_cpu(server_pid) - cpu0) / images
    if server_pid:
        io["server_cpu_ms_per_image"] = 1000 * (process_cpu(server_pid) - server0) / images
    return rate, io


def make_digits_folder(root: Path) -> int:
    """The UCI digits as 16x16 grayscale PNGs in class folders (what the digits presets train on)."""
    from trainer.data.datasets import load_digits_arrays  # imported where used (see time_loader)

    images, labels = load_digits_arrays()
    for i, (img, label) in enumerate(zip(images, labels, strict=True)):
        cls = root / str(int(label))
        cls.mkdir(parents=True, exist_ok=True)
        small = Image.fromarray((img.astype(np.float32) * (255 / 16)).round().astype(np.uint8))
        small.resize((16, 16), Image.Resampling.BILINEAR).save(cls / f"{i:05d}.png")
    return len(images)


def train_rate(overrides: list[str], workdir: str, steps: int, warmup: int) -> float:
    """Train steps/s of the digits-ddpm model over `steps` steps after `warmup` steps, in this process."""
    # the whole engine, imported where used (see time_loader)
    from trainer.elastic import DistEnv
    from trainer.loop import Trainer
    from trainer.registry import load_config

    cfg = load_config(
        "digits-ddpm",
        [
            "train.threads=1",
            "train.num_workers=2",
            "checkpoint.every_steps=0",
            "sample.every_steps=0",
            "train.val_every_steps=0",
            "train.log_every_steps=1000000",
            "data.val_fraction=0",
            f"train.max_steps={warmup + steps}",
            f"run.dir={workdir}",
            *overrides,
        ],
        environ={},
    )
    trainer = Trainer(cfg, DistEnv())
    stamps: list[float] = []
    run = trainer.step_runner.run

    def timed(batch, step):  # instrumentation only: when each iteration reaches its optimizer step
        stamps.append(time.perf_counter())
        return run(batch, step)

    trainer.step_runner.run = timed
    assert trainer.fit() == 0
    timed_stamps = stamps[warmup:]
    return (len(timed_stamps) - 1) / (timed_stamps[-1] - timed_stamps[0])


def train_section(server, tmp: Path, args) -> dict:
    """Train steps/s of the demo model: shards on moto S3 (several shuffle blocks) vs the same images in a folder."""
    from trainer.data.pack import pack_folder  # imported where used (see time_loader)

    src = tmp / "digits"
    n = make_digits_folder(src)
    url = f"s3://{server.make_bucket()}/digits"
    opts = {"client_kwargs": {"endpoint_url": server.endpoint}}
    pack_folder(str(src), url, 128, opts, progress=False)
    variants = {"folder": ["data.source=folder", f"data.path={src}"]}
    s3 = ["data.source=shards", f"data.urls={url}/shards.json", f"data.storage_options={json.dumps(opts)}"]
    for block in (int(b) for b in args.train_blocks.split(",") if b):
        variants[f"shards_s3_block{block}" if block else "shards_s3"] = [
            *s3,
            *([f"data.shuffle_block={block}"] if block else []),
        ]
    rates: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(args.repeats):
        for name, overrides in variants.items():
            rates[name].append(train_rate(overrides, str(tmp / f"run-{name}-{r}"), args.train_steps, args.train_warmup))
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "model": "digits-ddpm (train.threads=1, batch 64, 2 loader workers)",
        "images": n,
        "steps_timed": args.train_steps,
        "warmup_steps": args.train_warmup,
        "steps_per_s": {k: round(v, 2) for k, v in med.items()},
        "spread": {k: [round(min(v), 2), round(max(v), 2)] for k, v in rates.items()},
        **{f"ratio_{k}_vs_folder": round(med[k] / med["folder"], 3) for k in variants if k != "folder"},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--blocks", default="1,16,64", help="data.shuffle_block values: one shards_s3_block<N> source each")
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--train-warmup", type=int, default=8)
    ap.add_argument("--train-blocks", default="0,1,64", help="data.shuffle_block values for `train` (0: the default)")
    ap.add_argument("--skip-pipeline", action="store_true", help="only the train section")
    args = ap.parse_args()

    from servers import S3_CREDENTIALS, S3Server

    os.environ.update(S3_CREDENTIALS)
    server = S3Server().start()
    assert server.proc is not None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            result: dict = {"load_average_at_start": list(os.getloadavg())}
            if not args.skip_pipeline:
                result["pipeline"] = pipeline_section(server, Path(tmp), args)
            if args.train_blocks:
                result["train"] = train_section(server, Path(tmp), args)
            result["load_average_at_end"] = list(os.getloadavg())
            print(json.dumps(result, indent=1))
    finally:
        server.stop()


def pipeline_section(server, tmp: Path, args) -> dict:
    """Images/s per rank of each source's loader at 1 and 2 ranks, requests, bytes and CPU per image."""
    # imported where used (see time_loader)
    from trainer.data.pack import pack_folder
    from trainer.registry import load_config

    src = tmp / "src"
    make_folder(src, args.images, args.size)
    url = f"s3://{server.make_bucket()}/bench"
    opts = {"client_kwargs": {"endpoint_url": server.endpoint}}
    summary = pack_folder(str(src), url, 128, opts, progress=False)
    local = tmp / "shards"
    pack_folder(str(src), str(local), 128, None, progress=False)
    payload = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) / args.images
    common = [
        f"train.batch_size={args.batch}",
        f"train.num_workers={args.workers}",
        "data.channels=3",
        f"data.image_size={args.size}",
        "data.val_fraction=0",
    ]
    cfgs = {
        "folder": load_config(None, [*common, "data.source=folder", f"data.path={src}"], {}),
        "shards_local": load_config(None, [*common, "data.source=shards", f"data.urls={local}/shards.json"], {}),
    }
    s3 = [*common, "data.source=shards", f"data.urls={url}/shards.json", f"data.storage_options={json.dumps(opts)}"]
    cfgs["shards_s3"] = load_config(None, s3, {})
    for block in (int(b) for b in args.blocks.split(",") if b):
        cfgs[f"shards_s3_block{block}"] = load_config(None, [*s3, f"data.shuffle_block={block}"], {})
    result: dict = {
        "images": args.images,
        "image_size": args.size,
        "batch": args.batch,
        "workers": args.workers,
        "steps": args.steps,
        "shards": summary.shards,
        "payload_bytes_per_image": round(payload),
        "default_shuffle_block": cfgs["shards_s3"].data.shuffle_block,
    }
    for world in (1, 2):
        rates: dict[str, list[float]] = {k: [] for k in cfgs}
        ios: dict[str, list[dict]] = {k: [] for k in cfgs}
        for _ in range(args.repeats):
            for name, cfg in cfgs.items():
                pid = server.proc.pid if name.startswith("shards_s3") else None
                per_rank = [time_loader(cfg, r, world, args.steps, pid) for r in range(world)]
                rates[name].append(statistics.mean(p[0] for p in per_rank))
                ios[name].append([p[1] for p in per_rank])
        med = {k: statistics.median(v) for k, v in rates.items()}
        cpu = {}
        for name, runs in ios.items():
            per_image = {
                key: round(statistics.median(io[key] for ranks in runs for io in ranks), 3)
                for key in ("loader_cpu_ms_per_image", "server_cpu_ms_per_image")
                if key in runs[0][0]
            }
            cpu[name] = per_image
        result[f"world_{world}"] = {
            "images_per_s_per_rank": {k: round(v, 1) for k, v in med.items()},
            "spread": {k: [round(min(v), 1), round(max(v), 1)] for k, v in rates.items()},
            **{f"ratio_{k}_vs_folder": round(med[k] / med["folder"], 3) for k in cfgs if k != "folder"},
            "cpu_ms_per_image": cpu,
            "bytes_per_rank": {
                name: [
                    {
                        **{k: v for k, v in io.items() if not k.endswith("cpu_ms_per_image")},
                        "requests_per_image": round(io["requests"] / io["images"], 3),
                        "fetched_vs_used": round((io["data_bytes"] + io["index_bytes"]) / io["used_bytes"], 4),
                        "fetched_vs_payload": round(
                            (io["data_bytes"] + io["index_bytes"]) / (payload * io["images"]), 4
                        ),
                    }
                    for io in runs[-1]
                ]
                for name, runs in ios.items()
                if name.startswith("shards_s3")
            },
        }
    return result


if __name__ == "__main__":
    main()
