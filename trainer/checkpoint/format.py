"""Checkpoint file format: nested state <-> (tensors, JSON skeleton), streaming safetensors, digests.

Nothing here unpickles: tensors go to safetensors, everything else to JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import blake3
import torch
from safetensors import safe_open

from trainer.errors import CheckpointCorrupt, CheckpointError

_CHUNK = 64 << 20


def split_tensors(tree: Any, prefix: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """Replace every tensor in a nested state dict by {"__tensor__": key}.

    Returns the tensors (for safetensors) and the JSON-able skeleton. Tuples
    become lists and int dict keys are tagged so `join_tensors` restores them.
    """
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors[path] = x
            return {"__tensor__": path}
        if isinstance(x, Mapping):
            out = {}
            for k, v in x.items():
                key = f"__int__{k}" if isinstance(k, int) else str(k)
                out[key] = walk(v, f"{path}.{k}" if path else str(k))
            return out
        if isinstance(x, list | tuple):
            return [walk(v, f"{path}.{i}") for i, v in enumerate(x)]
        if x is None or isinstance(x, bool | int | float | str):
            return x
        raise TypeError(f"cannot checkpoint value of type {type(x).__name__} at {path!r}")

    return tensors, walk(tree, prefix)


def join_tensors(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return tensors[skeleton["__tensor__"]]
        return {
            (int(k[len("__int__") :]) if k.startswith("__int__") else k): join_tensors(v, tensors)
            for k, v in skeleton.items()
        }
    if isinstance(skeleton, list):
        return [join_tensors(v, tensors) for v in skeleton]
    return skeleton


# ------------------------------------------------------------ safetensors writer

# Every dtype the safetensors library both writes and reads back, by its header name (safetensors'
# `Dtype` enum), with the torch dtype it holds. One table for the writer, the readers and
# validation. Left out, refused at write time: F8_E8M0 and F4, which safetensors 0.8 writes but
# cannot load (and F4 packs two elements a byte, so its header shape is not the tensor's).
# tests/test_checkpoint_layout.py checks the table against the installed safetensors.
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a safetensors header dtype name; ValueError for one the format does not define."""
    try:
        return SAFETENSORS_DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown safetensors dtype {name!r}") from None


def library_header(head: bytes, size: int) -> dict[str, tuple[str, list[int]]]:
    """{key: (dtype, shape)} as the safetensors library itself reads them from a file of `size` bytes that
    starts with `head` (the 8-byte length and the header); ValueError with the library's reason if it
    refuses them.

    The library parses headers its own way (strict UTF-8 JSON, shapes as unsigned 64-bit integers, no
    duplicate fields, overflow-checked sizes), which Python's `json` does not match, so whatever a
    checkpoint's header is checked with must be the library that later loads it. It runs on a sparse
    image of the file: the real header over `size` bytes of which only the header is stored (an
    anonymous memory file, or a temporary file where there is none), so no tensor data is read or held.
    """
    made = None
    try:
        fd = os.memfd_create("gentrain-safetensors-header", os.MFD_CLOEXEC)
        path = f"/proc/self/fd/{fd}"
    except (AttributeError, OSError):  # no memfd (not Linux): a temporary file, sparse where the disk allows
        fd, made = tempfile.mkstemp(prefix="gentrain-header-")
        path = made
    try:
        _write_all(fd, head)
        os.ftruncate(fd, size)
        try:
            with safe_open(path, framework="pt") as f:
                return {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - SafetensorError, or whatever else the library refuses with
            raise ValueError(f"{type(e).__name__}: {str(e)[:200]}") from None
    finally:
        os.close(fd)
        if made is not None:
            os.unlink(made)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _tensor_bytes(t: torch.Tensor, name: str, what: str) -> memoryview:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    check_finite(name, t, what)
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# Float dtypes torch has no isfinite or sum for on the CPU: checked as float16, which holds each of their values.
_WIDEN = {torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz}


class NonFiniteTensor(CheckpointCorrupt):
    """A tensor to be saved (or read from a checkpoint) holds inf or NaN: such a checkpoint is never committed,
    and one found in a root is invalid (a run resumed from it would train nothing but NaN)."""


def all_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds no inf or NaN (integer and bool tensors always do).

    One sum first: an inf or NaN anywhere makes the sum inf or NaN, so a finite sum proves every element
    finite, at memory speed (about 5 GB/s a core here, where `isfinite(t).all()` ran 0.5). Only a sum that is
    not finite (a real inf or NaN, or finite values whose sum overflowed) gets the element-wise check."""
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return True
    if t.dtype in _WIDEN:
        t = t.to(torch.float16)
    if bool(torch.isfinite(t.sum())):
        return True
    return bool(torch.isfinite(t).all())


def check_finite(name: str, t: torch.Tensor, where: str) -> None:
    """NonFiniteTensor naming the tensor and where it is, if `t` holds an inf or NaN."""
    if not all_finite(t):
        raise NonFiniteTensor(
            f"{where}: tensor {name!r} holds inf or NaN values. A checkpoint never keeps non-finite weights: "
            "the training that produced them diverged (see train.max_nonfinite_steps), or the file was altered"
        )


class FiniteScan:
    """The inf/NaN check of a safetensors file's tensors on the bytes streaming through its digest: `update`
    takes the file's chunks in order, so a verify reads each file once.

    The header is taken from the stream's first bytes and parsed by `parse_header(prefix)` (the reader's
    checked parser: (header entries, data offset)); a header it refuses, or longer than `max_header_bytes`,
    ends the scan (`skipped`), since the structure check names that defect. `bad` lists the tensors found
    holding inf or NaN."""

    def __init__(self, parse_header: Callable[[bytes], tuple[Mapping[str, Any], int]], max_header_bytes: int):
        self._parse_header = parse_header
        self._max_header = max_header_bytes
        self._prefix = bytearray()  # the bytes up to the end of the header, until it is parsed
        self._regions: list[tuple[int, int, torch.dtype, str]] | None = None
        self._pos = 0
        self._carry = b""  # the start of an element the previous chunk cut off
        self.skipped = False
        self.bad: list[str] = []

    def update(self, chunk: bytes | memoryview) -> None:
        if self.skipped:
            return
        pos, end = self._pos, self._pos + len(chunk)
        self._pos = end
        if self._regions is None and not self._header_from(chunk):
            return
        for start, stop, dtype, name in self._regions:
            if stop <= pos or start >= end:
                continue
            lo, hi = max(start, pos), min(stop, end)
            piece = bytes(chunk[lo - pos : hi - pos])
            if lo == pos and self._carry:
                piece, self._carry = self._carry + piece, b""
            whole = len(piece) - len(piece) % dtype.itemsize
            if hi == end and hi < stop:
                self._carry = piece[whole:]
            if whole and name not in self.bad:
                with warnings.catch_warnings():  # a bytes object is read-only: nothing here writes to it
                    warnings.simplefilter("ignore", UserWarning)
                    values = torch.frombuffer(piece, dtype=dtype, count=whole // dtype.itemsize)
                if not all_finite(values):
                    self.bad.append(name)

    def _header_from(self, chunk: bytes | memoryview) -> bool:
        """Gather the header's bytes; once all are in, parse it (True: the tensors' regions are known)."""
        self._prefix += chunk
        if len(self._prefix) < 8:
            return False
        n = int.from_bytes(self._prefix[:8], "little")
        if n > self._max_header:
            self.skipped = True
            return False
        if len(self._prefix) < 8 + n:
            return False
        try:
            header, data_start = self._parse_header(bytes(self._prefix[: 8 + n]))
        except (ValueError, CheckpointError):
            self.skipped = True
            return False
        self._regions = []
        for name, h in header.items():
            dtype = SAFETENSORS_DTYPES[h["dtype"]]
            start, stop = (data_start + int(o) for o in h["data_offsets"])
            if (dtype.is_floating_point or dtype.is_complex) and stop > start:
                self._regions.append((start, stop, dtype, name))
        self._regions.sort()
        self._prefix = bytearray()
        return True


def write_safetensors(
    f, tensors: Mapping[str, torch.Tensor], on_bytes: Callable[[memoryview], None], what: str = "checkpoint save"
) -> int:
    """Stream `tensors` to file object `f` in the safetensors format; returns bytes written.

    Written by hand because the safetensors package can only serialize to a
    complete in-memory `bytes` copy or to a local path, and checkpoints must go
    to any fsspec file (S3, GCS) without a second full copy in memory while the
    digest is computed on the way. The result is read back with the safetensors
    library itself (tests check the round trip).

    Each tensor is checked for inf and NaN on the way (`check_finite`, on the copy its bytes are taken from):
    NonFiniteTensor (naming `what`, the file) stops the write before its first byte, so the store never
    commits (nor prunes for) a checkpoint holding one.
    """
    header: dict[str, Any] = {}
    offset = 0
    names = sorted(tensors)
    for name in names:
        t = tensors[name]
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"cannot store tensor {name!r} of dtype {t.dtype} in safetensors")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = memoryview(len(raw).to_bytes(8, "little") + raw)
    total = 0
    for chunk in [head] + [_tensor_bytes(tensors[n], n, what) for n in names]:
        for i in range(0, len(chunk), _CHUNK):
            piece = chunk[i : i + _CHUNK]
            on_bytes(piece)
            f.write(piece)
            total += len(piece)
    return total


DIGEST = "blake3"  # new checkpoints; "sha256" entries of older ones keep verifying


def new_digest(algorithm: str = DIGEST, threads: int = 0):
    """A hashlib-like object for a manifest digest algorithm (`blake3` or `sha256`); threads 0 = blake3's AUTO."""
    if algorithm == "blake3":
        # SIMD and multi-threaded: 6 GB/s on one core where sha256 ran 0.3-1.8 GB/s.
        return blake3.blake3(max_threads=threads or blake3.blake3.AUTO)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: blake3, sha256)")


class Hasher:
    """The digest on a helper thread, overlapped with the write of the same bytes.

    blake3 and hashlib release the GIL on large buffers, so hashing chunk i
    while chunk i+1 is written hides the hash behind the write.
    """

    def __init__(self, algorithm: str = DIGEST) -> None:
        self.algorithm = algorithm
        # One thread per file: it already runs beside the writer (and files are written in
        # parallel); blake3's own thread pool on top oversubscribed the cores (measured here
        # on 2 shared cores: 4.6 GB/s with 1 thread, 3.9 GB/s with max_threads=AUTO).
        self._hash = new_digest(algorithm, threads=1)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gentrain-hash")
        self._pending: Future | None = None

    def __enter__(self) -> Hasher:
        return self

    def update(self, chunk: memoryview) -> None:
        if self._pending is not None:
            self._pending.result()
        self._pending = self._pool.submit(self._hash.update, chunk)

    def hexdigest(self) -> str:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        return self._hash.hexdigest()

    def __exit__(self, *exc) -> None:
        if self._pending is not None:
            self._pending.result()
        self._pool.shutdown(wait=True)


def fsync(f) -> None:
    f.flush()
    inner = getattr(f, "f", f)  # fsspec's LocalFileOpener wraps the real file
    os.fsync(inner.fileno())
