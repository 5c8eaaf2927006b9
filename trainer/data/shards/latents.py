"""Reading `gentrain data encode`'s shards: a sample's stored posterior (and caption embeddings) for the loader.

The member layout is written by trainer/data/encode.py (see its docstring); the `encoded` settings come
from the set's `shards.json`.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

ENCODED_FORMAT = "gentrain-encoded/1"
# A sample's members: the posterior (and, mirrored, `flip.*`), the caption's embeddings.
_POSTERIOR = ("mean", "std")
_TEXT = ("tokens", "mask", "pooled")


def _read_npy(raw: bytes, name: str) -> np.ndarray:
    arr = np.load(io.BytesIO(raw), allow_pickle=False)
    if arr.dtype not in (np.float16, np.float32):
        raise ValueError(f"member {name}: dtype {arr.dtype}, not float16/float32")
    return arr.astype(np.float32)


def decode_encoded_sample(members: dict[str, bytes], encoded: dict, flip: bool, aug_seed: int):
    """(posterior, label, extras) of an encoded sample: posterior = cat(mean, std) on the channel axis,
    float32 (the loader moves it like an image; the task splits it). The mirrored image's posterior when
    `flip` and the sample's augmentation draw says so (the draw an image source flips by)."""
    prefix = "flip." if flip and aug_seed & 1 else ""
    mean, std = (_read_npy(members[f"{prefix}{k}.npy"], f"{prefix}{k}.npy") for k in _POSTERIOR)
    want = tuple(encoded["latent_shape"])
    if mean.shape != want or std.shape != want:
        raise ValueError(f"posterior of shape {list(mean.shape)}, the set's is {list(want)}")
    x = torch.from_numpy(np.concatenate([mean, std], axis=0))
    label = int(members["cls"].decode().strip()) if "cls" in members else -1
    extras: dict[str, Any] = {}
    if "txt" in members:
        extras["caption"] = members["txt"].decode("utf-8", errors="replace").strip()
    if encoded.get("text") is not None:
        for k in _TEXT:
            extras[f"text_{k}"] = torch.from_numpy(_read_npy(members[f"text.{k}.npy"], f"text.{k}.npy"))
    return x, label, extras


def posterior_shape(encoded: dict) -> tuple[int, ...]:
    """What the loader yields per encoded sample (mean and std stacked on the channel axis)."""
    c, h, w = encoded["latent_shape"]
    return (2 * c, h, w)
