"""Reading `gentrain data encode`'s shards: a sample's stored posterior (and caption embeddings) for the loader.

The member layout is written by trainer/encode.py (see its docstring); the `encoded` settings come
from the set's `shards.json` (`trainer.data.shards.encoded.EncodedSettings`).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch

from trainer.data.buckets import SIZE_CONDITIONS, cover_size
from trainer.data.shards.encoded import EncodedSettings

# A sample's members: the posterior (and, mirrored, `flip.*`), the caption's embeddings.
_POSTERIOR = ("mean", "std")
_TEXT = ("tokens", "mask", "pooled")


_NPY_MAGIC = b"\x93NUMPY"
# A set's members share a handful of headers (one per member kind): parsed once each. Bounded, for sets
# whose arrays vary in shape (caption tokens of many lengths).
_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...], str, int]] = {}
_NPY_HEADERS_MAX = 4096
_POSTERIOR_MEMBERS = {flip: tuple(f"{'flip.' if flip else ''}{k}.npy" for k in _POSTERIOR) for flip in (False, True)}


def _npy_header(raw: bytes) -> tuple[tuple[np.dtype, tuple[int, ...], str, int], int]:
    """(dtype, shape, memory order, element count) of an .npy member and where its data starts.

    numpy's own parser (`np.lib.format`) reads each distinct header once: `np.load` costs about 41 us a member
    here, most of it evaluating the header's dict literal, against 7 us this way, and a latent sample has two
    or more members (and the digits latent DiT reads 64 samples a step); the data itself is then a view (`np.frombuffer`)."""
    if raw[:6] != _NPY_MAGIC or raw[6:7] not in (b"\x01", b"\x02", b"\x03"):
        raise ValueError("not an .npy array")
    size_bytes = 2 if raw[6] == 1 else 4
    start = 8 + size_bytes + int.from_bytes(raw[8 : 8 + size_bytes], "little")
    header = raw[:start]
    parsed = _NPY_HEADERS.get(header)
    if parsed is None:
        f = io.BytesIO(header)
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)  # format 3.0 differs from 2.0 only in the header's text encoding
        parsed = (dtype, tuple(shape), "F" if fortran else "C", int(np.prod(shape, dtype=np.int64)))
        if len(_NPY_HEADERS) < _NPY_HEADERS_MAX:
            _NPY_HEADERS[header] = parsed
    return parsed, start


def _npy_view(raw: bytes, name: str) -> np.ndarray:
    """A float16 or float32 .npy member's array, a read-only view of `raw`."""
    try:
        (dtype, shape, order, count), start = _npy_header(raw)
    except ValueError as e:
        raise ValueError(f"member {name}: {e}") from None
    if dtype not in (np.float16, np.float32):
        raise ValueError(f"member {name}: dtype {dtype}, not float16/float32")
    if len(raw) - start < count * dtype.itemsize:
        raise ValueError(f"member {name}: {len(raw) - start} bytes of data, its header says {count * dtype.itemsize}")
    return np.frombuffer(raw, dtype=dtype, count=count, offset=start).reshape(shape, order=order)


def _read_npy(raw: bytes, name: str) -> np.ndarray:
    """A float16 or float32 .npy member as float32 (a copy of its own); what `np.load` would read."""
    return _npy_view(raw, name).astype(np.float32, order="C")


def decode_encoded_sample(members: dict[str, bytes], encoded: EncodedSettings, flip: bool, aug_seed: int, size=None):
    """(posterior, label, extras) of an encoded sample: posterior = cat(mean, std) on the channel axis,
    float32 (the loader moves it like an image; the task splits it). The mirrored image's posterior when
    `flip` and the sample's augmentation draw says so (the draw an image source flips by). ValueError (the
    loader skips and counts the sample) for a member that is malformed or holds inf or NaN. `size`: the
    (height, width) aspect-ratio bucket the sample was encoded at (its posterior has that bucket's shape)."""
    flipped = bool(flip and aug_seed & 1)
    names = _POSTERIOR_MEMBERS[flipped]
    mean, std = (_npy_view(members[name], name) for name in names)
    want = encoded.latent_shape if size is None else encoded.buckets.latent_shape(size)
    if mean.shape != want or std.shape != want:
        raise ValueError(f"posterior of shape {list(mean.shape)}, the set's is {list(want)}")
    posterior = np.empty((2 * want[0], *want[1:]), np.float32)  # both halves converted straight into it
    posterior[: want[0]] = mean
    posterior[want[0] :] = std
    if not np.isfinite(posterior).all():  # one inf would make every weight NaN: a corrupt sample, skipped
        raise ValueError("posterior holds inf or NaN values")
    x = torch.from_numpy(posterior)
    label = int(members["cls"].decode().strip()) if "cls" in members else -1
    extras: dict[str, Any] = {}
    if "txt" in members:
        extras["caption"] = members["txt"].decode("utf-8", errors="replace").strip()
    if "size.npy" in members:  # a bucketed encode's: the size micro-conditions of the unmirrored image
        sizes = _read_npy(members["size.npy"], "size.npy")
        if sizes.shape != (6,) or not np.isfinite(sizes).all() or (sizes[[0, 1, 4, 5]] <= 0).any():
            raise ValueError("member size.npy is not six finite sizes")
        if flipped:  # the mirror's crop: its left counted from the right of the resized image
            resized_width = cover_size(int(sizes[0]), int(sizes[1]), int(sizes[4]), int(sizes[5]))[1]
            sizes[3] = resized_width - sizes[5] - sizes[3]
        extras[SIZE_CONDITIONS] = torch.from_numpy(sizes)
    if encoded.text is not None:
        for k in _TEXT:
            values = _read_npy(members[f"text.{k}.npy"], f"text.{k}.npy")
            if not np.isfinite(values).all():
                raise ValueError(f"member text.{k}.npy holds inf or NaN values")
            extras[f"text_{k}"] = torch.from_numpy(values)
    return x, label, extras
