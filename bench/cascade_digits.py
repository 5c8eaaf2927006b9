"""How often a trained digits cascade draws the digit it was asked for.

Samples `--per-class` images of each digit through the cascade (EMA weights,
the run's guidance scale unless --guidance-scale), classifies them with
logistic regression fitted on the 8x8 UCI digits (bench/digits_classifier.py),
and prints JSON: the share assigned to the requested class, per stage
(--stop-at-stage 1..N), against chance (0.1) and against the classifier's own
accuracy on real held-out digits resized the same way (its ceiling).

Usage: python bench/cascade_digits.py CHECKPOINT [--per-class 20] [--steps 25]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from digits_classifier import class_accuracy, fit_digits_classifier  # noqa: E402

from trainer.checkpoint import resolve_checkpoint  # noqa: E402
from trainer.data import build_splits  # noqa: E402
from trainer.data.sampler import SampleRef  # noqa: E402
from trainer.runs import load_for_inference  # noqa: E402
from trainer.tasks.sampling import SampleRequest  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--per-class", type=int, default=20)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(2)
    view = resolve_checkpoint(args.checkpoint)
    if view is None:
        raise SystemExit(f"{args.checkpoint}: no valid checkpoint under this root")
    device = torch.device("cpu")
    cfg, task, modules = load_for_inference(view, use_ema=True, device=device)
    steps = view.part_steps()
    clf = fit_digits_classifier()
    labels = torch.arange(10).repeat_interleave(args.per_class)
    guidance = cfg.sample.guidance_scale if args.guidance_scale is None else args.guidance_scale
    out = {
        "checkpoint": view.url,
        "step": view.step,
        "part_steps": steps,
        "samples": len(labels),
        "chance": 0.1,
        "guidance_scale": guidance,
        "inference_steps": args.steps,
    }
    _, val, _ = build_splits(cfg)
    real = torch.stack([val[ref][0] for ref in _refs(len(val))])
    real_labels = torch.tensor([val[ref][1] for ref in _refs(len(val))])
    for k in range(1, len(cfg.model_cfg.stages) + 1):
        if steps.get(f"stage{k}", 0) == 0:
            break
        request = SampleRequest(
            num=len(labels),
            seed=args.seed,
            labels=labels,
            stop_at_stage=k,
            part_steps=steps,
            inference_steps=args.steps,
            guidance_scale=guidance,
            batch_size=100,
        )
        images = task.sample(modules, request, device)
        size = cfg.model_cfg.stages[k - 1].image_size
        real_k = torch.nn.functional.interpolate((real + 1) / 2, size=(size, size), mode="area")
        out[f"stage{k}"] = {
            "image_size": size,
            "requested_class_rate": class_accuracy(clf, images, labels),
            "real_digits_rate": class_accuracy(clf, real_k, real_labels),
        }
    print(json.dumps(out, indent=1))


def _refs(n: int):
    return [SampleRef(index=i, position=i) for i in range(n)]


if __name__ == "__main__":
    main()
