"""Trains the shipped digits feature network: `python -m trainer.eval.train_digits_features`.

A small CNN classifies the 1,797 UCI digits (scikit-learn's copy, shipped in
trainer/data/digits.npz) at 16x16 with random one-pixel shifts; its 64-wide
penultimate layer is the feature space of `eval.features=digits`. 20% of the
digits (a fixed split) measure its accuracy, then it trains on all of them.
Deterministic on CPU for a given torch build; writes
trainer/conditioning/digits_features.safetensors and digits_features.json (beside the CNN,
trainer.conditioning.feature_cnn).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from trainer.conditioning.feature_cnn import ARCHITECTURE, CNNFeatures
from trainer.data.datasets import DigitsDataset

DESC = {
    "architecture": ARCHITECTURE,
    "channels": 1,
    "input_size": 16,
    "widths": [32, 64],
    "feature_dim": 64,
    "num_classes": 10,
}


def shifted(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    dx, dy = torch.randint(-1, 2, (2,), generator=g).tolist()
    return torch.roll(x, shifts=(dy, dx), dims=(2, 3))


def train(images: torch.Tensor, labels: torch.Tensor, epochs: int, seed: int) -> CNNFeatures:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    net = CNNFeatures(**{k: v for k, v in DESC.items() if k != "architecture"})
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, 3e-3, total_steps=epochs * ((len(images) + 63) // 64))
    for _ in range(epochs):
        perm = torch.randperm(len(images), generator=g)
        for i in range(0, len(images), 64):
            idx = perm[i : i + 64]
            logits = net.head(net.features(shifted(images[idx], g)))
            loss = F.cross_entropy(logits, labels[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return net.eval()


@torch.no_grad()
def accuracy(net: CNNFeatures, images: torch.Tensor, labels: torch.Tensor) -> float:
    return float((net.head(net.features(images)).argmax(1) == labels).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conditioning")
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    ds = DigitsDataset(16, 1)
    images, labels = (ds.images + 1) / 2, ds.labels  # features take [0, 1] images
    perm = np.random.default_rng(1234).permutation(len(images))
    held, fit = torch.from_numpy(perm[: len(perm) // 5]), torch.from_numpy(perm[len(perm) // 5 :])
    acc = accuracy(train(images[fit], labels[fit], args.epochs, args.seed), images[held], labels[held])
    print(f"held-out accuracy (trained on 80%): {acc:.4f}")
    net = train(images, labels, args.epochs, args.seed)
    save_file(
        {k: v.contiguous() for k, v in net.state_dict().items()}, os.path.join(args.out, "digits_features.safetensors")
    )
    desc = {
        **DESC,
        "trained_on": "UCI optdigits (1,797 images) at 16x16, one-pixel shifts",
        "accuracy": round(acc, 4),
        "epochs": args.epochs,
        "seed": args.seed,
        "script": "python -m trainer.eval.train_digits_features",
    }
    with open(os.path.join(args.out, "digits_features.json"), "w") as f:
        json.dump(desc, f, indent=1)
    print(f"wrote {args.out}/digits_features.safetensors ({sum(v.numel() for v in net.state_dict().values())} values)")


if __name__ == "__main__":
    main()
