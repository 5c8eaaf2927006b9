"""Steps/s of the digits latent DiT trained four ways, paired in one process, and encode throughput.

The ways (the same preset, model, batch and loss; `train.max_steps` steps each, the first `--warmup` not timed):
- `on_the_fly`: digits images, the frozen autoencoder encodes every batch inside the step (today's default);
- `cache`: the same with `model.autoencoder.cache` already filled (a second epoch's behaviour: every image is
  still hashed to find its entry, and read from local disk);
- `shards`: the latent shards `gentrain data encode` wrote (`data.source=shards`; no encoder is built);
- `in_memory`: the same training run (`Trainer.fit`, EMA, clipping, the loop's bookkeeping) with every sample
  of the encoded set read and decoded once before it starts and held in memory: the loader hands out those
  tensors, so nothing is read or decoded while it trains. The ceiling the others are measured against
  (the issue's target: `shards` at least 0.98x of it): what reading the shards costs a run.
- `hand_loop`: a hand-written loop over the same task and part: every posterior held in one tensor on the
  device, random batches sliced from it, then the task's own loss, backward and optimizer step (no loader,
  no EMA, no clipping, no loop bookkeeping). What the engine itself costs is issue 34's measure (bench/gpu.py,
  bench/host_overhead.py); it is printed here for reference.
`read_ms_per_step` is what the training process spends in the split's `__getitems__` for a step's samples,
timed on its own (shards, and the held samples), and `implied_vs_in_memory` the ratio that cost alone gives
against in memory's step time: the steps/s ratios carry the shared machine's noise, this does not.
Rounds alternate the ways (ABCDE ABCDE ...) so load drift on a shared machine hits all alike; the median of
the rounds is printed with its ratio to `in_memory`, and the ratio per round (the ways of one round ran back
to back) with its spread. `encode_images_per_s` is `gentrain data encode`'s
throughput in one process (`--dtype float16`), the autoencoder load excluded.

The autoencoder: `--autoencoder URL` (a digits-autoencoder run, or a diffusers AutoencoderKL folder), else a
freshly initialized AutoencoderKL with the digits-autoencoder preset's shape (16 px, 1 channel, widths
32/64/64, 4 latent channels: the preset's 4x4x4 latents); its weights do not change the speed.

Usage: python bench/latent_shards.py [--steps 60] [--warmup 10] [--rounds 3] [--batch-size 64] [--json OUT]
       [--set train.num_workers=2 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from trainer.data.sampler import SampleRef, StepBatchSampler
from trainer.elastic import DistEnv
from trainer.encode import encode_dataset
from trainer.loop import Trainer
from trainer.registry import load_config
from trainer.tasks.base import Batch, StepInfo


def digits_vae(folder: Path) -> str:
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    AutoencoderKL(
        in_channels=1,
        out_channels=1,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(32, 64, 64),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=32,
        sample_size=16,
    ).save_pretrained(str(folder))
    return str(folder)


def timed_fit(cfg, warmup: int, hold: bool = False) -> float:
    """Steps/s of `Trainer.fit` from step `warmup` on: the time between step starts (the data wait, the
    step and the loop's bookkeeping between steps). `hold`: the split's samples read once, held in memory."""
    t = Trainer(cfg, DistEnv())
    if hold:
        t.train_set = HeldInMemory(t.train_set)
    starts: list[float] = []
    run = t.step_runner.run

    def stamped(batch, step):
        starts.append(time.perf_counter())
        return run(batch, step)

    t.step_runner.run = stamped
    assert t.fit() == 0
    # Step starts only: the end of fit (final checkpoint, previews) is no training step.
    return (len(starts) - 1 - warmup) / (starts[-1] - starts[warmup])


class HeldInMemory:
    """A training split whose samples were all read and decoded once: `__getitems__` hands out those items."""

    def __init__(self, split) -> None:
        self.split = split
        self.items = split.__getitems__([SampleRef(index=i, position=i) for i in range(len(split))])

    def __len__(self) -> int:
        return len(self.split)

    def make_stream(self, seed: int):
        return self.split.make_stream(seed)

    def __getitems__(self, refs):
        return [self.items[r.index] for r in refs]


def read_ms_per_step(cfg, steps: int, hold: bool = False) -> float:
    """Median ms the training process spends in the split's `__getitems__` for one step's refs (the
    run's own sample order from step 0; the first step, which fetches the shard indexes, not counted)."""
    t = Trainer(cfg, DistEnv())
    split = HeldInMemory(t.train_set) if hold else t.train_set
    sampler = StepBatchSampler(split.make_stream(cfg.seed), 0, cfg.train.batch_size, 0, 1)
    times = []
    for _, refs in zip(range(steps + 1), sampler, strict=False):
        t0 = time.perf_counter()
        split.__getitems__(refs)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times[1:])


def in_memory(cfg, warmup: int) -> float:
    """`timed_fit` with the split held in memory (see the module docstring)."""
    return timed_fit(cfg, warmup, hold=True)


def hand_loop(cfg, steps: int, warmup: int) -> float:
    """The hand-written loop on posteriors held on the device (see the module docstring)."""
    t = Trainer(cfg, DistEnv())
    split = t.train_set
    # SampleRef: the hand-written loop's only gentrain piece, to read the same items.
    items = split.__getitems__([SampleRef(index=i, position=i) for i in range(len(split))])
    posteriors = torch.stack([it[0] for it in items]).to(t.device)
    labels = torch.tensor([it[1] for it in items], device=t.device)
    part = t.parts[t.task.part]
    modules = {t.task.part: part.module, "autoencoder": t.frozen["autoencoder"].module}
    batch_size, n = cfg.train.batch_size, len(posteriors)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).to(t.device)
    stamps = []
    for step in range(steps):
        stamps.append(time.perf_counter())
        idx = order[(torch.arange(batch_size, device=t.device) + step * batch_size) % n]
        batch = Batch(posteriors[idx], labels[idx], idx.cpu(), list(range(batch_size)))
        loss = t.task.loss(None, modules, batch, None, StepInfo(step)).per_sample.sum() / batch_size
        part.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        part.optimizer.step()
    if t.device.type == "cuda":
        torch.cuda.synchronize()
    stamps.append(time.perf_counter())
    return (len(stamps) - 1 - warmup) / (stamps[-1] - stamps[warmup])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--autoencoder", default=None)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--json", default=None)
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for every way")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="latent-shards-"))
    vae = args.autoencoder or digits_vae(work / "vae")
    common = [
        f"model.autoencoder.url={vae}",
        f"train.batch_size={args.batch_size}",
        f"train.max_steps={args.steps}",
        "train.log_every_steps=1000",
        "train.val_every_steps=0",
        "sample.every_steps=0",
        # the previews every fit draws at its end are not timed: the fewest steps and images (50 steps of 64
        # images took 5 s of each tiny fit)
        "sample.inference_steps=1",
        "sample.num=1",
        "checkpoint.every_steps=0",
        "ema.decay=0.999",
        *args.set,
    ]

    def cfg(name: str, *extra: str):
        return load_config("digits-latent-dit", [*common, f"run.dir={work}/{name}", *extra], environ={})

    t0 = time.perf_counter()
    encode_dataset(cfg("encode"), f"{work}/shards", 512, dtype="float16", progress=False)
    encode_s = time.perf_counter() - t0  # includes the autoencoder load: subtract it below
    t0 = time.perf_counter()
    encode_dataset(cfg("encode"), f"{work}/shards2", 512, dtype="float16", progress=False)
    encode_s = min(encode_s, time.perf_counter() - t0)
    shards = ["data.source=shards", f"data.urls={work}/shards/shards.json"]
    cache = [f"model.autoencoder.cache={work}/cache"]
    # Fill it: one epoch over every image (entries are per image, whatever the batch), in large batches (at
    # batch 8, 226 steps took 19 of a tiny run's 55 s).
    fill_batch = max(args.batch_size, 256)
    fill = [*cache, f"train.batch_size={fill_batch}", f"train.max_steps={1797 // fill_batch + 2}"]
    Trainer(cfg("fill", *fill), DistEnv()).fit()

    ways = {
        "on_the_fly": lambda r: timed_fit(cfg(f"fly{r}"), args.warmup),
        "cache": lambda r: timed_fit(cfg(f"cache{r}", *cache), args.warmup),
        "shards": lambda r: timed_fit(cfg(f"shards{r}", *shards), args.warmup),
        "in_memory": lambda r: in_memory(cfg(f"mem{r}", *shards), args.warmup),
        "hand_loop": lambda r: hand_loop(cfg(f"hand{r}", *shards), args.steps, args.warmup),
    }
    rates: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(args.rounds):
        for name, way in ways.items():
            rates[name].append(way(r))
    median = {k: statistics.median(v) for k, v in rates.items()}
    # The same cost measured directly, without the step beside it: far less noisy than the rates' ratio.
    read = {
        "shards": read_ms_per_step(cfg("read", *shards), args.steps),
        "in_memory": read_ms_per_step(cfg("read-mem", *shards), args.steps, hold=True),
    }
    step_ms = 1e3 / median["in_memory"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = {
        "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({torch.get_num_threads()} threads)",
        "batch_size": args.batch_size,
        "overrides": args.set,
        "steps_per_s": {k: round(v, 2) for k, v in median.items()},
        "vs_in_memory": {k: round(v / median["in_memory"], 3) for k, v in median.items()},
        # Per round (its ways ran back to back): median [min, max] of each way's ratio to that round's in_memory.
        "vs_in_memory_per_round": {
            k: [round(statistics.median(r), 3), round(min(r), 3), round(max(r), 3)]
            for k, r in ((k, [x / m for x, m in zip(v, rates["in_memory"], strict=True)]) for k, v in rates.items())
        },
        "rounds": {k: [round(x, 2) for x in v] for k, v in rates.items()},
        # What the training process spends reading a step's samples (median ms), and the ratio that cost
        # alone would give: in memory's step time over the same plus the difference in reading.
        "read_ms_per_step": {k: round(v, 3) for k, v in read.items()},
        "implied_vs_in_memory": round(step_ms / (step_ms + read["shards"] - read["in_memory"]), 4),
        "encode_images_per_s": round(1797 / encode_s, 1),
        "encode_note": "one process, digits 16px -> 4x4x4 float16, autoencoder load and shard writes included",
    }
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
