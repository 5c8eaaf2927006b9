"""Latent DiT training step: gentrain's engine vs a hand-written loop, and the latent cache's speed-up.

A ddpm task with `model.backbone.kind: dit` on the latents of a frozen KL autoencoder
(`model.autoencoder.url`: a diffusers `AutoencoderKL` folder saved here from a randomly initialised
model; its weights do not matter for time). Three variants, all in this one process, interleaved
(the order rotates each round so drifting load hits each alike):

- `handwritten`: what a careful user writes with torch and diffusers alone: the same images (the
  digits, upsampled), `vae.encode(x).latent_dist.sample() * scaling_factor` under `no_grad`, noise
  and timesteps from the global RNG, `DDPMScheduler.add_noise` with the task's schedule,
  `DiTTransformer2DModel` of the same shape (unconditional: one class, label dropout off, as gentrain
  builds it), `F.mse_loss`, backward, `clip_grad_norm_`, fused `AdamW`, the diffusers cosine schedule
  and diffusers' `EMAModel(foreach=True)` step, `loss.item()`;
- `gentrain`: `Trainer.fit` of the same config, encoding on the fly (no cache): batch from the
  resumable loader, per-sample counter-based noise, timesteps and posterior draws, the task's loss
  (min-SNR off, so plain MSE), clipping, fused AdamW, schedule, EMA, progress, stop agreement;
- `gentrain_cached`: the same with `model.autoencoder.cache` filled beforehand by one run over the
  same images (same seed and cursor: the measured runs visit exactly the cached images; the JSON
  gives the cache's hits and misses during the measured runs).

Each loop iteration is timed from the start of one step to the start of the next (for gentrain: at
each `step_runner.run` call, as bench/loop_overhead.py does), the first two of each run dropped. Per
round, each variant's median iteration; the ratios are per round (handwritten / gentrain: above 1
means gentrain is faster; gentrain / gentrain_cached: the cache's speed-up) and the JSON gives their
median and quartiles over rounds. The autoencoder is sized so that encoding is a large share of the
step (the JSON gives the hand-written loop's encode time): that is what the cache saves.

Usage (2 cores shared with other work: one thread per variant by default):
    python bench/dit.py [--rounds 20] [--steps 12] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from trainer.hostmem import keep_freed_memory

# Every variant runs in this one process, so all of them get the allocator settings the Trainer applies.
keep_freed_memory()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from diffusers import AutoencoderKL, DDPMScheduler, DiTTransformer2DModel  # noqa: E402
from diffusers.models.embeddings import LabelEmbedding  # noqa: E402
from diffusers.optimization import get_scheduler  # noqa: E402
from diffusers.training_utils import EMAModel  # noqa: E402

from trainer.data.datasets import DigitsDataset  # noqa: E402
from trainer.elastic import DistEnv  # noqa: E402
from trainer.loop import Trainer  # noqa: E402
from trainer.registry import load_config  # noqa: E402

# Full run: 32x32 digits -> 8x8x4 latents (three encoder levels, downsampling 4); the encoder's
# 32/64/64 channels make encoding about as costly as the DiT's step, so the cache has something to save.
FULL = {
    "batch": 32,
    "image_size": 32,
    "vae_channels": [32, 64, 64],
    "vae_groups": 32,
    "dit": {"patch_size": 2, "num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 32},
}
QUICK = {
    "batch": 8,
    "image_size": 16,
    "vae_channels": [8, 16],
    "vae_groups": 4,
    "dit": {"patch_size": 2, "num_layers": 1, "num_attention_heads": 2, "attention_head_dim": 8},
}


def latent_side(size: dict) -> int:
    return size["image_size"] // 2 ** (len(size["vae_channels"]) - 1)


def write_vae(folder: str, size: dict) -> int:
    """A randomly initialised diffusers AutoencoderKL (1 channel in, 4 latent channels) saved as a folder;
    returns its encoder's parameter count."""
    torch.manual_seed(0)
    levels = len(size["vae_channels"])
    vae = AutoencoderKL(
        in_channels=1,
        out_channels=1,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=tuple(size["vae_channels"]),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=size["vae_groups"],
        sample_size=size["image_size"],
    )
    vae.save_pretrained(folder)
    return sum(p.numel() for p in vae.encoder.parameters())


def build_dit(size: dict) -> DiTTransformer2DModel:
    """The DiT gentrain's dit backbone builds for these latents: unconditional (one class), label dropout off."""
    dit = DiTTransformer2DModel(
        **size["dit"], in_channels=4, out_channels=4, sample_size=latent_side(size), num_embeds_ada_norm=1
    )
    for mod in dit.modules():  # no label dropout draws (gentrain's DiT has none either)
        if isinstance(mod, LabelEmbedding):
            mod.dropout_prob = 0.0
    return dit


def overrides(size: dict, vae: str, steps: int, threads: int) -> list[str]:
    dit = ", ".join(f"{k}: {v}" for k, v in size["dit"].items())
    return [
        f"model.backbone={{kind: dit, {dit}}}",
        f"model.autoencoder.url={vae}",
        "model.prediction_type=epsilon",
        "model.snr_gamma=null",  # plain MSE, as the hand-written loop
        f"data.image_size={size['image_size']}",
        "data.channels=1",
        "data.flip=false",
        "data.val_fraction=0",
        f"train.batch_size={size['batch']}",
        f"train.max_steps={steps}",
        "train.warmup_steps=10",
        "train.max_grad_norm=1.0",
        f"train.threads={threads}",
        "train.val_every_steps=0",
        "train.log_every_steps=1000000",
        "ema.enabled=true",
        "checkpoint.every_steps=0",
        "sample.every_steps=0",
        "sample.num=2",
        "sample.inference_steps=1",
    ]


def gentrain_iterations(args: list[str], workdir: str, cache: str | None) -> tuple[list[float], dict[str, int]]:
    """Seconds of each iteration of Trainer.fit's loop, and the latent cache's hits and misses."""
    extra = [f"model.autoencoder.cache={cache}"] if cache else []
    cfg = load_config(None, [*args, *extra, f"run.dir={workdir}"], environ={})
    trainer = Trainer(cfg, DistEnv())
    stamps: list[float] = []
    run = trainer.step_runner.run

    def timed(batch, step):  # instrumentation only: records when each iteration reaches its step
        stamps.append(time.perf_counter())
        return run(batch, step)

    trainer.step_runner.run = timed
    assert trainer.fit() == 0
    c = trainer.task.latent.cache
    return list(np.diff(stamps)), {"hits": c.hits, "misses": c.misses} if c else {}


def handwritten_iterations(args: list[str], vae_folder: str, size: dict) -> tuple[list[float], list[float]]:
    """The same step written by hand (see the module doc); returns iteration and encode seconds."""
    cfg = load_config(None, args, environ={})
    t, e, m = cfg.train, cfg.ema, cfg.model_cfg
    vae = AutoencoderKL.from_pretrained(vae_folder).eval().requires_grad_(False)
    scale = vae.config.scaling_factor
    dit = build_dit(size).train()
    opt = torch.optim.AdamW(dit.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, fused=True)
    sched = get_scheduler("cosine", opt, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)
    ema = EMAModel(
        dit.parameters(),
        decay=e.decay,
        min_decay=e.min_decay,
        update_after_step=e.update_after_step,
        use_ema_warmup=e.warmup,
        inv_gamma=e.inv_gamma,
        power=e.power,
        foreach=True,
    )
    noise_sched = DDPMScheduler(
        num_train_timesteps=m.num_train_timesteps, beta_schedule=m.beta_schedule, prediction_type="epsilon"
    )
    data = DigitsDataset(size["image_size"]).images
    rng = np.random.default_rng(0)
    perm, pos = rng.permutation(len(data)), 0
    b = t.batch_size
    labels = torch.zeros(b, dtype=torch.long)
    stamps: list[float] = []
    encode: list[float] = []
    for _ in range(t.max_steps):
        stamps.append(time.perf_counter())
        if pos + b > len(perm):
            perm, pos = rng.permutation(len(data)), 0
        x = data[torch.from_numpy(perm[pos : pos + b])]
        pos += b
        t0 = time.perf_counter()
        with torch.no_grad():
            z0 = vae.encode(x).latent_dist.sample() * scale
        encode.append(time.perf_counter() - t0)
        noise = torch.randn_like(z0)
        ts = torch.randint(0, noise_sched.config.num_train_timesteps, (b,))
        pred = dit(noise_sched.add_noise(z0, noise, ts), ts, class_labels=labels).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dit.parameters(), t.max_grad_norm)
        opt.step()
        sched.step()
        ema.step(dit.parameters())
        loss.item()
    stamps.append(time.perf_counter())
    return list(np.diff(stamps)), encode


def summary(values: list[float], digits: int = 4) -> dict[str, float]:
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else (values[0],) * 3
    return {"median": round(med, digits), "q1": round(q1, digits), "q3": round(q3, digits)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=12, help="steps per variant per round")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (every variant)")
    ap.add_argument("--quick", action="store_true", help="smoke test: tiny models, 2 rounds of 5 steps")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps = 2, 5
    if args.steps < 4:
        raise SystemExit("--steps must be at least 4 (the first two iterations of each run are dropped)")
    size = QUICK if args.quick else FULL
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    # digits-ddpm's UNet keys are ignored under model.backbone: the task says so once per Trainer
    logging.getLogger("trainer.tasks.ddpm").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    with tempfile.TemporaryDirectory() as tmp:
        vae = os.path.join(tmp, "vae")
        enc_params = write_vae(vae, size)
        dit_params = sum(p.numel() for p in build_dit(size).parameters())
        cfg_args = overrides(size, vae, args.steps, args.threads)
        cache = os.path.join(tmp, "cache")
        # Warm-up (first-call allocations, kernels) and the cache's fill: same seed and cursor as the
        # measured runs, so they visit exactly these images.
        handwritten_iterations(overrides(size, vae, 3, args.threads), vae, size)
        fill, fill_stats = gentrain_iterations(cfg_args, os.path.join(tmp, "fill"), cache)
        variants = {
            "handwritten": lambda d: handwritten_iterations(cfg_args, vae, size),
            "gentrain": lambda d: gentrain_iterations(cfg_args, d, None),
            "gentrain_cached": lambda d: gentrain_iterations(cfg_args, d, cache),
        }
        medians: dict[str, list[float]] = {k: [] for k in variants}
        samples: dict[str, list[float]] = {k: [] for k in variants}
        encode: list[float] = []
        cached = {"hits": 0, "misses": 0}
        for r in range(args.rounds):
            names = list(variants)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                times, extra = variants[name](os.path.join(tmp, f"{name}-{r}"))
                times = times[2:]  # the first iterations of a run still allocate; keep the steady state
                samples[name] += times
                medians[name].append(statistics.median(times))
                if name == "handwritten":
                    encode += extra[2:]
                elif name == "gentrain_cached":
                    cached = {k: cached[k] + extra[k] for k in cached}
                print(f"round {r} {name}: {medians[name][-1]:.4f} s/step", file=sys.stderr, flush=True)

    hand, gen, gen_c = medians["handwritten"], medians["gentrain"], medians["gentrain_cached"]
    overhead = [h / g for h, g in zip(hand, gen, strict=True)]
    speedup = [g / c for g, c in zip(gen, gen_c, strict=True)]
    pooled = {k: statistics.median(v) for k, v in samples.items()}
    print(
        json.dumps(
            {
                "benchmark": "dit",
                "quick": args.quick,
                "device": "cpu",
                "torch_threads": args.threads,
                "rounds": args.rounds,
                "steps_per_run": args.steps,
                "setup": {
                    "batch_size": size["batch"],
                    "images": f"digits upsampled to {size['image_size']}x{size['image_size']}, 1 channel",
                    "autoencoder": {
                        "block_out_channels": size["vae_channels"],
                        "layers_per_block": 1,
                        "latent": [4, latent_side(size), latent_side(size)],
                        "encoder_parameters": enc_params,
                    },
                    "dit": {**size["dit"], "parameters": dit_params},
                    "objective": "epsilon, squaredcos_cap_v2 DDPM schedule, 1000 steps, plain MSE (min-SNR off)",
                    "both_sides": "posterior sample of the frozen VAE times its scaling_factor, noise, timestep, "
                    "add_noise, DiT forward, MSE, backward, clip_grad_norm 1.0, fused AdamW, cosine schedule "
                    "with warm-up, EMA (diffusers EMAModel foreach)",
                    "handwritten_only": "global-RNG noise/timesteps/posterior draws, a slice of a permuted image "
                    "tensor as the batch, loss.item()",
                    "gentrain_only": "resumable loader and collate, per-sample counter-based draws, global RNG "
                    "reseed per chunk, per-sample loss sum, progress/report, stop agreement, final save "
                    "(outside the timed iterations)",
                },
                "median_step_seconds": {k: summary(v) for k, v in medians.items()},
                "pooled_median_step_seconds": {k: round(v, 4) for k, v in pooled.items()},
                "handwritten_encode_seconds": summary(encode) if encode else None,
                "encode_share_of_handwritten_step": round(statistics.median(encode) / pooled["handwritten"], 3),
                "handwritten_over_gentrain": summary(overhead),
                "handwritten_over_gentrain_of_pooled_medians": round(pooled["handwritten"] / pooled["gentrain"], 4),
                "gentrain_cached_speedup": summary(speedup),
                "gentrain_cached_speedup_of_pooled_medians": round(pooled["gentrain"] / pooled["gentrain_cached"], 4),
                "cache": {"fill_run": fill_stats, "measured_runs": cached},
                "cache_fill_median_step_seconds": round(statistics.median(fill[2:]), 4),
                "targets": {"handwritten_over_gentrain_min": 0.97},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
