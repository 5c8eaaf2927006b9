"""Whether a moving-digits model draws the digit and the direction it was asked for.

Samples `--per-prompt` clips for each of the 40 (digit, direction) prompts
("a seven moving left") from a `video-maskgit` checkpoint (EMA weights, the
run's decoding steps and guidance unless overridden), then judges every clip:

- digit: each frame's ink is located (the centre of the box around pixels
  above half the frame's peak), a digit-sized window (half the canvas, as the
  dataset draws it) is cropped there and classified by the shipped digits CNN
  (`trainer/conditioning/digits_features.*`, its classifier head; trained on the UCI
  digits at 16x16, the size Moving Digits draws them at 32x32). A clip's digit
  is the argmax of its frames' mean log-probabilities; frame accuracy counts
  frames one by one.
- direction: the least-squares slope of the ink centroid (intensity-weighted,
  pixels above half the peak) over the frames; the larger axis and its sign
  give left/right/up/down. `displacement_px` is the mean first-to-last centroid
  travel along the requested axis (the data moves half the canvas).

The same judges run on held-out real clips (their ceiling, should be ~1) and
on the tokenizer's reconstructions of them (what the codes can carry at
best). A `video-tokenizer` checkpoint gets only those two. Prints JSON.

Usage: python bench/moving_digits.py CHECKPOINT [--per-prompt 10] [--steps N] [--guidance-scale G]
       [--temperature T] [--choice-temperature C] [--gif OUT.gif]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from trainer.checkpoint import resolve_checkpoint
from trainer.conditioning.feature_cnn import build_cnn, shipped_digits
from trainer.data import build_splits
from trainer.data.sampler import SampleRef
from trainer.data.video import DIRECTIONS, moving_caption
from trainer.media import save_gif
from trainer.runs import load_for_inference
from trainer.tasks.sampling import SampleRequest

INK = 0.5  # share of a frame's peak above which a pixel is ink


def digits_classifier() -> torch.nn.Module:
    desc, tensors, _ = shipped_digits()
    return build_cnn(desc, tensors)


def ink_boxes(frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """frames (F, H, W) in [0, 1] -> (box centres (F, 2) as (y, x), centroids (F, 2)) of the ink."""
    peak = frames.flatten(1).amax(1).clamp(min=1e-6)[:, None, None]
    ink = frames >= INK * peak
    h, w = frames.shape[1:]
    ys = torch.arange(h, dtype=torch.float32)[None, :]
    xs = torch.arange(w, dtype=torch.float32)[None, :]
    rows, cols = ink.any(2), ink.any(1)  # (F, H), (F, W)

    def centre(occupied: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        lo = torch.where(occupied, pos, torch.inf).amin(1)
        hi = torch.where(occupied, pos, -torch.inf).amax(1)
        return (lo + hi) / 2

    boxes = torch.stack([centre(rows, ys), centre(cols, xs)], 1)
    weight = frames * ink
    mass = weight.flatten(1).sum(1).clamp(min=1e-6)
    centroids = torch.stack([(weight.sum(2) * ys).sum(1) / mass, (weight.sum(1) * xs).sum(1) / mass], 1)
    return boxes, centroids


def crop(frames: torch.Tensor, centres: torch.Tensor, size: int) -> torch.Tensor:
    """(F, 1, size, size) windows of `frames` (F, H, W) centred at `centres` (rounded, kept inside)."""
    h, w = frames.shape[1:]
    out = []
    for frame, (cy, cx) in zip(frames, centres.tolist(), strict=True):
        y = int(min(max(round(cy - size / 2 + 0.5), 0), h - size))
        x = int(min(max(round(cx - size / 2 + 0.5), 0), w - size))
        out.append(frame[y : y + size, x : x + size])
    return torch.stack(out)[:, None]


def direction_of(centroids: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(direction index, per-frame slope (dy, dx)) of a centroid track (F, 2)."""
    t = torch.arange(len(centroids), dtype=torch.float32)
    t = t - t.mean()
    slope = (t[:, None] * (centroids - centroids.mean(0))).sum(0) / (t * t).sum().clamp(min=1e-6)
    dy, dx = slope.tolist()
    if abs(dx) >= abs(dy):
        return (0 if dx < 0 else 1), slope
    return (2 if dy < 0 else 3), slope


@torch.no_grad()
def judge(clips: torch.Tensor, digits: torch.Tensor, directions: torch.Tensor, net: torch.nn.Module) -> dict:
    """clips (N, T, C, H, W) in [0, 1] against the requested digits and directions (N,)."""
    n, t, _, h, _ = clips.shape
    size = h // 2  # MovingDigitsDataset draws the digit at half the canvas
    frames = clips.float().mean(2)  # (N, T, H, W)
    frame_hits, clip_digit, clip_dir, travel = [], [], [], []
    for k in range(n):
        boxes, centroids = ink_boxes(frames[k])
        logp = F.log_softmax(net.head(net.features(crop(frames[k], boxes, size))), dim=-1)  # (T, 10)
        frame_hits.append((logp.argmax(1) == digits[k]).float().mean().item())
        clip_digit.append(int(logp.mean(0).argmax()))
        d, _ = direction_of(centroids)
        clip_dir.append(d)
        axis, sign = (1, -1 if directions[k] == 0 else 1) if directions[k] < 2 else (0, -1 if directions[k] == 2 else 1)
        travel.append(sign * float(centroids[-1, axis] - centroids[0, axis]))
    digit_ok = torch.tensor(clip_digit) == digits
    dir_ok = torch.tensor(clip_dir) == directions
    per_direction = {
        name: round(float(dir_ok[directions == i].float().mean()), 4)
        for i, name in enumerate(DIRECTIONS)
        if (directions == i).any()
    }
    per_digit = {
        str(i): round(float(digit_ok[digits == i].float().mean()), 4) for i in range(10) if (digits == i).any()
    }
    return {
        "clips": n,
        "frames": t,
        "digit_accuracy": round(float(digit_ok.float().mean()), 4),
        "digit_frame_accuracy": round(float(np.mean(frame_hits)), 4),
        "direction_accuracy": round(float(dir_ok.float().mean()), 4),
        "both_accuracy": round(float((digit_ok & dir_ok).float().mean()), 4),
        "displacement_px": round(float(np.mean(travel)), 2),
        "digit_accuracy_by_digit": per_digit,
        "direction_accuracy_by_direction": per_direction,
    }


def held_out_clips(cfg, limit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, val, _ = build_splits(cfg)
    items = [val[SampleRef(index=i, position=i)] for i in range(min(limit, len(val)))]
    clips = torch.stack([x[0] for x in items])
    labels = torch.tensor([x[1] for x in items])
    return clips, labels % 10, labels // 10


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--per-prompt", type=int, default=10, help="samples per (digit, direction) prompt")
    p.add_argument("--steps", type=int, default=None, help="decoding steps (default: the run's)")
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the run's")
    p.add_argument("--temperature", type=float, default=None, help="token draws (default: the run's)")
    p.add_argument(
        "--choice-temperature", type=float, default=None, help="which tokens stay masked (default: the run's)"
    )
    p.add_argument("--real", type=int, default=400, help="held-out real clips to judge (and reconstruct)")
    p.add_argument("--batch", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--gif", default=None, help="also write the first sample of each prompt as one GIF here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    view = resolve_checkpoint(args.checkpoint)
    if view is None:
        raise SystemExit(f"{args.checkpoint}: no valid checkpoint under this root")
    cfg, task, modules = load_for_inference(view, use_ema=True, device=device)
    if cfg.data.source != "moving-digits":
        raise SystemExit(f"{args.checkpoint}: trained on data.source={cfg.data.source}, not moving-digits")
    net = digits_classifier()
    out: dict = {
        "checkpoint": view.url,
        "step": view.step,
        "task": cfg.task,
        "chance": {"digit": 0.1, "direction": 0.25, "both": 0.025},
    }
    tokenizer = modules["generator"] if cfg.task == "video-tokenizer" else modules["tokenizer"]
    clips, digits, directions = held_out_clips(cfg, args.real)
    out["real"] = judge((clips + 1) / 2, digits, directions, net)
    with torch.no_grad():
        recon = torch.cat([tokenizer.decode_indices(tokenizer.encode_indices(c)) for c in clips.split(args.batch)])
    out["reconstruction"] = judge((recon[:, : clips.shape[1]].float() + 1) / 2, digits, directions, net)
    if cfg.task == "video-maskgit":
        digits = torch.arange(10).repeat_interleave(len(DIRECTIONS) * args.per_prompt)
        directions = torch.arange(len(DIRECTIONS)).repeat_interleave(args.per_prompt).repeat(10)
        steps = args.steps or cfg.sample.inference_steps
        guidance = cfg.sample.guidance_scale if args.guidance_scale is None else args.guidance_scale
        conditions = {}
        begin = time.perf_counter()
        samples = []
        for i in range(0, len(digits), args.batch):
            d, r = digits[i : i + args.batch], directions[i : i + args.batch]
            if task.text is not None:
                conditions = {"prompts": [moving_caption(int(a), int(b)) for a, b in zip(d, r, strict=True)]}
            else:
                conditions = {"labels": r * 10 + d}
            request = SampleRequest(
                num=len(d),
                seed=args.seed + i,
                inference_steps=steps,
                guidance_scale=guidance,
                temperature=args.temperature,
                choice_temperature=args.choice_temperature,
                **conditions,
            )
            samples.append(task.sample(modules, request, device))
        samples = torch.cat(samples)
        out["samples"] = judge(samples, digits, directions, net)
        if args.gif:  # the first clip of every prompt: a row per digit, a column per direction
            out["gif"] = save_gif(samples[:: args.per_prompt], args.gif, nrow=len(DIRECTIONS))
        out["samples"].update(
            inference_steps=steps,
            guidance_scale=guidance,
            temperature=task.cfg.temperature if args.temperature is None else args.temperature,
            choice_temperature=task.cfg.choice_temperature
            if args.choice_temperature is None
            else args.choice_temperature,
            seconds=round(time.perf_counter() - begin, 1),
        )
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
