"""How faithfully a trained digits decoder (the `digits-decoder` preset) inverts image embeddings.

Embeds `--num` held-out digits with the run's frozen image encoder, decodes
each embedding through the cascade (EMA weights, the run's guidance scale
unless --guidance-scale), and prints JSON: the share of decoded samples that
logistic regression fitted on the 8x8 UCI digits (bench/digits_classifier.py)
assigns to the class of the digit the embedding came from, per stage, against
chance (0.1) and the classifier's own rate on those real digits (its ceiling).
The decoder never sees a label: only the embedding carries the digit.

Usage: python bench/decoder_digits.py CHECKPOINT [--num 200] [--steps 25]
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
    p.add_argument("--num", type=int, default=200)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance-scale", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    view = resolve_checkpoint(args.checkpoint)
    if view is None:
        raise SystemExit(f"{args.checkpoint}: no valid checkpoint under this root")
    device = torch.device("cpu")
    cfg, task, modules = load_for_inference(view, use_ema=True, device=device)
    if task.image_encoder is None:
        raise SystemExit("this checkpoint has no model.image_encoder: not a digits-decoder run")
    steps = view.part_steps()
    _, val, _ = build_splits(cfg)
    refs = [SampleRef(index=i, position=i) for i in range(min(args.num, len(val)))]
    real = torch.stack([val[r][0] for r in refs])
    labels = torch.tensor([val[r][1] for r in refs])
    embeds = task.image_encoder.encode(real)
    guidance = cfg.sample.guidance_scale if args.guidance_scale is None else args.guidance_scale
    clf = fit_digits_classifier()
    out = {
        "checkpoint": view.url,
        "step": view.step,
        "part_steps": steps,
        "samples": len(refs),
        "chance": 0.1,
        "guidance_scale": guidance,
        "inference_steps": args.steps,
        "real_digits_rate": class_accuracy(clf, (real + 1) / 2, labels),
    }
    for k in range(1, len(cfg.model_cfg.stages) + 1):
        if steps.get(f"stage{k}", 0) == 0:
            break
        request = SampleRequest(
            num=len(refs),
            seed=args.seed,
            image_embeds=embeds,
            stop_at_stage=k,
            part_steps=steps,
            inference_steps=args.steps,
            guidance_scale=guidance,
            batch_size=100,
        )
        images = task.sample(modules, request, device)
        out[f"stage{k}"] = {"image_size": images.shape[-1], "source_class_rate": class_accuracy(clf, images, labels)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
