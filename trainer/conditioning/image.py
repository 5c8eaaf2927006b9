"""A frozen image encoder for DALL-E 2-style decoders: image -> embedding, when the data carries none.

DALL-E 2's decoder (Ramesh et al. 2022, arXiv:2204.06125) learns to invert
CLIP's image embedding. On the built-in digits no CLIP is available offline,
so `model.image_encoder: digits-features` uses the small digits CNN gentrain
ships for FID/KID (`trainer/conditioning/digits_features.safetensors`, 98% digit
accuracy): its 64-wide penultimate features, L2-normalized as CLIP embeddings
are. The decoder then draws variations of the image an embedding came from.

Each image is encoded alone (a batch of one): a convolution's floats depend
on the batch it runs in, and exact resume needs a sample to embed the same
whichever chunk or micro-batch holds it.

`python -m trainer.conditioning.image OUT.npy [IMAGE ...]` writes embeddings
for `gentrain sample --embeddings OUT.npy`: of the given image files, or
without files of the first example of each digit 0-9 of the built-in set.
"""

from __future__ import annotations

import argparse
import sys

import blake3
import numpy as np
import torch
from PIL import Image

from trainer.conditioning.feature_cnn import build_cnn, shipped_digits
from trainer.data.datasets import DigitsDataset, image_to_tensor

ENCODERS = ("digits-features",)


class ImageEncoder:
    """The shipped digits feature CNN on CPU, frozen; `encode` takes images in [-1, 1]."""

    def __init__(self, name: str):
        desc, tensors, raw = shipped_digits()
        self.name = name
        self.net = build_cnn(desc, tensors)
        self.dim = int(desc["feature_dim"])
        self.digest = "blake3:" + blake3.blake3(raw).hexdigest()

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(N, dim) unit-norm embeddings of images (N, C, H, W) in [-1, 1], on the images' device."""
        # Never under the training step's autocast: the embedding must not depend on train.precision.
        with torch.autocast(images.device.type, enabled=False):
            x = ((images.detach().float().cpu() + 1) / 2).clamp(0, 1)
            rows = [self.net.features(x[i : i + 1]) for i in range(len(x))]
        e = torch.cat(rows) if rows else torch.zeros(0, self.dim)
        return torch.nn.functional.normalize(e, dim=1).to(images.device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.conditioning.image", description=__doc__.split("\n")[0])
    p.add_argument("out", help="the .npy to write: (N, 64) float32")
    p.add_argument("images", nargs="*", help="image files (default: one built-in digit of each class 0-9)")
    args = p.parse_args(argv)
    enc = ImageEncoder("digits-features")
    if args.images:
        x = torch.stack([image_to_tensor(Image.open(f), 16, 1) for f in args.images])
    else:
        digits = DigitsDataset(16)
        first = [int(torch.nonzero(digits.labels == d)[0]) for d in range(10)]
        x = digits.images[first]
    np.save(args.out, enc.encode(x).numpy().astype(np.float32))
    print(f"wrote {args.out}: {len(x)} embeddings of width {enc.dim} ({enc.name}, {enc.digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
