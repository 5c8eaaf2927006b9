"""How often a trained latent digits model (digits-latent-dit, digits-latent-mmdit) draws the digit it was asked for.

Samples `--per-class` images of each digit (EMA weights, the run's sampler, steps and guidance unless given):
by class label for a class-conditional model, by the caption "a handwritten <digit>" for a caption-conditional
one. A logistic regression fitted on the 8x8 UCI digits (bench/digits_classifier.py) reads them; prints JSON
with the share read as the requested digit, against chance (0.1), against the classifier on real held-out digits
(its ceiling) and on their reconstructions through the run's frozen autoencoder (what the latents can carry).
Writes the samples as a grid (rows = digits) with --grid.

Usage: python bench/latent_digits.py CHECKPOINT [--per-class 10] [--grid docs/x.png]
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
from trainer.data.datasets import digit_caption  # noqa: E402
from trainer.data.sampler import SampleRef  # noqa: E402
from trainer.diffusion.latent import PART as AUTOENCODER  # noqa: E402
from trainer.media import save_grid  # noqa: E402
from trainer.runs import load_for_inference  # noqa: E402
from trainer.tasks.sampling import SampleRequest  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--per-class", type=int, default=10)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--grid", default=None, help="write the samples here (one row per digit)")
    args = p.parse_args()
    view = resolve_checkpoint(args.checkpoint)
    if view is None:
        raise SystemExit(f"{args.checkpoint}: no valid checkpoint under this root")
    device = torch.device("cpu")
    cfg, task, modules = load_for_inference(view, use_ema=True, device=device)
    s = cfg.sample
    labels = torch.arange(10).repeat_interleave(args.per_class)
    captioned = cfg.model_cfg.text is not None
    conditions = {"prompts": [digit_caption(int(k)) for k in labels]} if captioned else {"labels": labels}
    steps = args.steps or s.inference_steps
    guidance = s.guidance_scale if args.guidance_scale is None else args.guidance_scale
    request = SampleRequest(
        len(labels), seed=args.seed, inference_steps=steps, scheduler=s.scheduler, guidance_scale=guidance, **conditions
    )
    images = task.sample(modules, request, device)
    clf = fit_digits_classifier()
    _, val, _ = build_splits(cfg)
    refs = [SampleRef(index=i, position=i) for i in range(len(val))]
    real = torch.stack([val[r][0] for r in refs])
    real_labels = torch.tensor([val[r][1] for r in refs])
    ae, latent = modules[AUTOENCODER], task.latent
    with torch.no_grad():  # each real digit through the autoencoder at its posterior mean
        mean, _ = latent._posterior(ae, real)
        scale, shift = latent._scale_shift(ae)
        rebuilt = latent.decode(ae, (mean - shift) * scale)
    out = {
        "checkpoint": view.url,
        "step": view.step,
        "conditioning": "caption" if captioned else "class",
        "samples": len(labels),
        "inference_steps": steps,
        "scheduler": s.scheduler,
        "guidance_scale": guidance,
        "requested_digit_rate": class_accuracy(clf, images, labels),
        "chance": 0.1,
        "real_digits_rate": class_accuracy(clf, (real + 1) / 2, real_labels),
        "autoencoder_reconstruction_rate": class_accuracy(clf, (rebuilt.clamp(-1, 1) + 1) / 2, real_labels),
    }
    if args.grid:
        out["grid"] = save_grid(images, args.grid, nrow=args.per_class)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
