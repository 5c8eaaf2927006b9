"""Sharded checkpoints: every rank writes its own slices; any world size reads back only the slices it needs.

Files in a sharded step dir (besides trainer.json and each rank's rank-NNNNN.* RNG files):

    <part>.<kind>.rank-NNNNN.safetensors   rank N's slices of the sharded (DTensor) tensors, written by rank N
    <part>.<kind>.replicated.safetensors   tensors every rank holds whole (optimizer step counts, buffers): rank 0
    shards.json                            for every tensor: dtype, global shape and its chunks (file, offsets,
                                           sizes); written by rank 0 after every rank reported, before the manifest

kind is `model`, `ema` or `optimizer`; keys are the same as in a single-writer checkpoint (optimizer
state keyed by parameter index), so DDP and FSDP checkpoints load into each other.

Which storage layer, and why our own: torch.distributed.checkpoint's `FileSystemWriter` pickles its
`.metadata`, and its `HuggingFaceStorageWriter` writes its own index as a second commit point and
computes no digests, while gentrain's manifest must list every file's size and digest and be written
last, streaming the digest while the bytes are written, to any fsspec store. So the write side is our
safetensors writer and our manifest; the read side is a `StorageReader` of our own under DCP's load
planner: DCP intersects the chunks each rank needs (the local shard of every DTensor, whole tensors for
DDP) with the chunks saved at whatever world size, and `ChunkReader` reads those byte ranges. Each file
a rank reads from is streamed once through its digest, keeping only the ranges that rank needs: memory
holds this rank's slices, never the whole model, and nothing is applied before the digest matched.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.tensor import DTensor
from torch.futures import Future

from trainer.checkpoint.format import DTYPE_NAMES, check_finite, new_digest, torch_dtype
from trainer.checkpoint.layout import (
    SHARD_INDEX,
    group_files,
    replicated_file,
    shard_file,
    whole_file,
)
from trainer.checkpoint.reader import CheckpointReader
from trainer.checkpoint.store import CheckpointCorrupt, CheckpointError, CheckpointInfo, CheckpointStore, SaveResult
from trainer.checkpoint.validity import Chunk, IndexedTensor
from trainer.elastic import broadcast_object, gather_objects

log = logging.getLogger(__name__)

# Test failpoint (docs/development.md), "STEP:RANK": on the first attempt (no torchrun restart yet) that
# rank writes its files of STEP's save, then stops before reporting them, so a test kills a rank in the
# middle of a sharded save at an exact point instead of racing the writer threads.
FAULT_STALL_SAVE = "GENTRAIN_FAULT_STALL_SAVE"


def _stall_here(step: int, rank: int) -> bool:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return False
    return os.environ.get(FAULT_STALL_SAVE, "") == f"{step}:{rank}"


_READ_CHUNK = 16 << 20


def is_sharded(info: CheckpointInfo) -> bool:
    return info.manifest is not None and SHARD_INDEX in info.manifest.files


# ------------------------------------------------------------------ save side


def local_slices(
    group: str, tensors: Mapping[str, torch.Tensor], rank: int
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict[str, Any]]]:
    """This rank's files of one `<part>.<kind>` group and its index entries.

    A DTensor contributes its local shard (with its offsets in the global
    tensor, as DCP's planner computes them); a plain tensor is the same on every
    rank and is written once, by rank 0.
    """
    own: dict[str, torch.Tensor] = {}
    replicated: dict[str, torch.Tensor] = {}
    index: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"cannot store tensor {group}:{key} of dtype {t.dtype} in safetensors")
        entry: dict[str, Any] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "chunks": []}
        if isinstance(t, DTensor):
            local = t.to_local()
            for chunk in t.__create_chunk_list__():
                if local.numel():
                    own[key] = local
                    f = shard_file(group, rank)
                    entry["chunks"].append({"file": f, "offsets": list(chunk.offsets), "sizes": list(chunk.sizes)})
        else:
            if rank == 0:
                replicated[key] = t
            entry["chunks"].append({"file": replicated_file(group), "offsets": [0] * t.ndim, "sizes": list(t.shape)})
        index[key] = entry
    files = {}
    if own:
        files[shard_file(group, rank)] = own
    if replicated:
        files[replicated_file(group)] = replicated
    return files, {group: index}


def merge_indexes(reports: list[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One index from every rank's: the union of their chunks per tensor."""
    out: dict[str, dict[str, Any]] = {}
    for report in reports:
        for group, tensors in report.items():
            g = out.setdefault(group, {})
            for key, entry in tensors.items():
                merged = g.setdefault(key, {"dtype": entry["dtype"], "shape": entry["shape"], "chunks": []})
                for c in entry["chunks"]:
                    if c not in merged["chunks"]:
                        merged["chunks"].append(c)
    for tensors in out.values():
        for entry in tensors.values():
            entry["chunks"].sort(key=lambda c: c["offsets"])
    return out


# The meta key that carries a rank's own index entries (`local_slices`) from its snapshot to its write, in
# the same dict as the manifest's fields (a Checkpointer hands a write `step, files, meta`); never written.
LOCAL_INDEX = "__local_shard_index__"


def write_sharded_step(
    store: CheckpointStore,
    step: int,
    files: Mapping[str, Any],
    meta: Mapping[str, Any],
    rank: int,
    world_size: int,
    group: Any,
    failed: str | None = None,
) -> SaveResult | None:
    """A sharded save of `step`, collective over `group`: a Checkpointer's `write` on every rank (bound
    with functools.partial), `meta` carrying this rank's index under LOCAL_INDEX. Rank 0 claims the step
    dir and tells the others; then `write_sharded`. Returns the result on rank 0, None elsewhere and when
    the step is committed already.

    Runs in the writer thread on every rank; its collectives use `group` only. A rank that fails (or
    dies: the others then wait in the gather until torchrun restarts the group) leaves no manifest, so
    the previous checkpoint stays the newest valid one.
    """
    t0 = time.perf_counter()
    meta = dict(meta)
    local_index = meta.pop(LOCAL_INDEX)
    # Rank 0's view decides: its previous save (and commit) has finished before this one starts. A step
    # dir that holds an invalid checkpoint (one resume fell back from) is cleared first, then rewritten.
    verdict: tuple[bool, BaseException | None] = (False, None)
    if rank == 0:
        try:
            verdict = (store.claim(step) is not None, None)  # this timeline's already, or cleared for it
        except Exception as e:  # noqa: BLE001 - raised on every rank below, together
            verdict = (False, e)
    committed, error = broadcast_object(verdict, group=group)
    if error is not None:
        raise error
    if committed:
        return None
    return write_sharded(store, step, files, local_index, meta, rank, world_size, group, t0=t0, failed=failed)


def write_sharded(
    store: CheckpointStore,
    step: int,
    files: Mapping[str, Any],
    local_index: Mapping[str, Any],
    meta: Mapping[str, Any],
    rank: int,
    world_size: int,
    group: Any,
    t0: float | None = None,
    failed: str | None = None,
) -> SaveResult | None:
    """Collective over `group`: each rank writes its files and reports their sizes and digests; rank 0
    writes the merged index, then commits the manifest listing every rank's files. Returns the result on
    rank 0, None elsewhere; raises on every rank if any rank failed (then nothing is committed). A rank
    whose snapshot already `failed` writes nothing and reports why."""
    entries, error = {}, (f"rank {rank}: {failed}" if failed else None)
    try:
        if error is None:
            entries = store.write_files(step, files)
    except Exception as e:
        error = f"rank {rank}: {type(e).__name__}: {e}"
    if _stall_here(step, rank):
        log.warning(
            "stalling the save of step %d on rank %d before it reports (%s is set)", step, rank, FAULT_STALL_SAVE
        )
        threading.Event().wait()
    reports = gather_objects((entries, local_index, error), group=group)
    errors = [r[2] for r in reports if r[2]]
    if errors:
        if rank == 0:  # every rank has stopped writing: free the space the failed save took
            store.remove_uncommitted(step)
        raise CheckpointError(f"sharded save of step {step} failed, nothing committed: {'; '.join(errors)}")
    if rank != 0:
        return None
    all_entries: dict[str, Any] = {}
    for rank_entries, _, _ in reports:
        all_entries.update(rank_entries)
    index = merge_indexes([r[1] for r in reports])
    try:
        all_entries.update(store.write_files(step, {SHARD_INDEX: index_file_bytes(index, world_size)}))
        return store.commit(step, all_entries, meta, t0)
    except BaseException:
        store.remove_uncommitted(step)
        raise


# ------------------------------------------------------------------ read side


def read_header(store: CheckpointReader, info: CheckpointInfo, name: str) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (checked against the file's size, see trainer.checkpoint.validity) and
    the byte offset its data starts at (two small ranged reads)."""
    return store.read_safetensors_header(info, name)


class ShardIndex:
    """Where every tensor of a checkpoint lives, for both layouts (sharded, or one file per part/kind)."""

    def __init__(self, store: CheckpointReader, info: CheckpointInfo):
        self.store = store
        self.info = info
        self._groups: dict[str, dict[str, IndexedTensor]] = (
            dict(store.read_json(info, SHARD_INDEX).tensors) if is_sharded(info) else {}
        )

    def has(self, group: str) -> bool:
        return group in self._groups or whole_file(group) in self.info.manifest.files

    def group(self, group: str) -> dict[str, IndexedTensor]:
        """{key: IndexedTensor (dtype, shape, chunks of file, offsets, sizes)} of `<part>.<kind>`: shards.json's,
        or one chunk of the whole file per tensor (from its safetensors header)."""
        if group not in self._groups:
            name = whole_file(group)
            header, _ = read_header(self.store, self.info, name)
            self._groups[group] = {
                key: IndexedTensor(
                    dtype=h["dtype"],
                    shape=h["shape"],
                    chunks=[Chunk(file=name, offsets=[0] * len(h["shape"]), sizes=h["shape"])],
                )
                for key, h in header.items()
            }
        return self._groups[group]


def load_group(index: ShardIndex, group: str, targets: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fresh tensors like `targets` (a DTensor target gives a DTensor sharded the same way), filled from
    the checkpoint; this rank reads only its slices. Live state is untouched until the caller applies them."""
    entries = index.group(group)
    missing = sorted(set(targets) - set(entries))
    if missing:
        raise KeyError(f"{index.info.url}: {group} has no tensors {missing[:5]} (a checkpoint of another model?)")
    for key, t in targets.items():
        if list(t.shape) != entries[key].shape:
            raise ValueError(
                f"{index.info.url}: {group}:{key} has shape {entries[key].shape}, this model's is {list(t.shape)}"
            )
    out = {key: torch.empty_like(t) for key, t in targets.items()}
    if out:
        # no_dist: every rank plans its own reads against the saved index; loading needs no collective.
        reader = ChunkReader(index.store, index.info, {k: entries[k] for k in out})
        try:
            dcp.load(out, storage_reader=reader, no_dist=True)
        except CheckpointException as e:  # DCP wraps the reader's error; hand on the one callers understand
            for failure in e.failures.values():
                inner = getattr(failure, "exc", failure)
                if isinstance(inner, CheckpointCorrupt | KeyError | ValueError):
                    raise inner from None
            raise CheckpointCorrupt(f"{index.info.url}: {group} could not be read: {e}") from None
    return out


class ChunkReader(StorageReader):
    """DCP StorageReader over gentrain's files: the JSON index as metadata, safetensors byte ranges as data.

    DCP hands it read items (a saved chunk, offsets into it, lengths); rows of
    a row-major chunk are contiguous, so each item is one byte range of rows,
    narrowed in the other dimensions in memory. Every file is streamed once
    through its manifest digest; only the needed ranges are kept.
    """

    def __init__(self, store: CheckpointReader, info: CheckpointInfo, entries: Mapping[str, IndexedTensor]):
        super().__init__()
        self.store = store
        self.info = info
        self.entries = entries

    def reset(self, checkpoint_id=None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md, storage = {}, {}
        for key, e in self.entries.items():
            chunks = [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in e.chunks]
            props = TensorProperties(dtype=torch_dtype(e.dtype))
            md[key] = TensorStorageMetadata(props, torch.Size(e.shape), chunks)
            for c in e.chunks:
                storage[MetadataIndex(key, torch.Size(c.offsets))] = c.file
        return Metadata(state_dict_metadata=md, storage_data=storage)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file = defaultdict(list)
        for item in plan.items:
            by_file[self.storage_data[MetadataIndex(item.storage_index.fqn, item.storage_index.offset)]].append(item)
        loaded = []  # every file is verified before any tensor is handed to the planner
        for name, items in by_file.items():
            loaded += self._read_verified(name, items)
        for item, tensor in loaded:
            target = planner.resolve_tensor(item).detach()
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_verified(self, name: str, items: list) -> list[tuple[Any, torch.Tensor]]:
        header, data_start = read_header(self.store, self.info, name)
        ranges = []  # (start, stop, buffer, item, dtype, rows shape)
        for item in items:
            h = header.get(item.storage_index.fqn)
            if h is None:
                raise CheckpointCorrupt(f"{self.info.url}/{name} has no tensor {item.storage_index.fqn!r}")
            dtype = torch_dtype(h["dtype"])
            if h["dtype"] != self.entries[item.storage_index.fqn].dtype:
                raise CheckpointCorrupt(
                    f"{self.info.url}/{name}: {item.storage_index.fqn!r} is {h['dtype']}, "
                    f"the index says {self.entries[item.storage_index.fqn].dtype}"
                )
            shape = h["shape"]
            if len(shape) != len(item.lengths) or any(
                o + n > d for o, n, d in zip(item.storage_offsets, item.lengths, shape, strict=True)
            ):
                raise CheckpointCorrupt(f"{self.info.url}/{name}: {item.storage_index.fqn!r} is smaller than its chunk")
            start = data_start + h["data_offsets"][0]
            if shape:
                row = math.prod(shape[1:]) * dtype.itemsize
                first, rows = item.storage_offsets[0], item.lengths[0]
                start += first * row
                stop, rows_shape = start + rows * row, [rows, *shape[1:]]
            else:
                stop, rows_shape = start + dtype.itemsize, []
            ranges.append((start, stop, bytearray(stop - start), item, dtype, rows_shape))
        algorithm = self.store.manifest_entry(self.info, name).algorithm
        digest, pos = new_digest(algorithm), 0
        with self.store.fs.open(self.store.file_path(self.info, name), "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                digest.update(chunk)
                end = pos + len(chunk)
                for start, stop, buf, *_ in ranges:
                    lo, hi = max(start, pos), min(stop, end)
                    if lo < hi:
                        buf[lo - start : hi - start] = chunk[lo - pos : hi - pos]
                pos = end
        self.store.check_digest(self.info, name, pos, digest.hexdigest(), algorithm)
        out = []
        for _, _, buf, item, dtype, rows_shape in ranges:
            t = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
            t = t.view(dtype).reshape(rows_shape)
            for d in range(1, len(rows_shape)):
                t = t.narrow(d, item.storage_offsets[d], item.lengths[d])
            check_finite(item.storage_index.fqn, t, f"{self.info.url}/{name}")  # never resume into NaN weights
            out.append((item, t))
        return out


def index_file_bytes(index: Mapping[str, Any], world_size: int) -> bytes:
    return json.dumps({"version": 1, "world_size": world_size, "tensors": index}, indent=1).encode()


def files_of_group(info: CheckpointInfo, group: str) -> list[str]:
    """Every file holding (a slice of) `<part>.<kind>`, in either layout."""
    return group_files(info.manifest.files, group)
