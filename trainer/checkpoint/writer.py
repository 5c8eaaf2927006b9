"""Checkpointer: sync or background saves of a training-state snapshot, at most one in flight.

A background save copies the state into reused CPU buffers in two parts. Tensors that may change
before the next optimizer step (buffers: a VQ codebook's EMA, BatchNorm statistics and usage rings
change in forward; RNG states) are copied on the training thread when `save` is called. Tensors that
only change when a part updates (parameters, optimizer state, EMA weights; the caller names them with
`stable`) are copied by a background thread while the next step's forward and backward run, as
CheckFreq (Mohan et al., FAST '21) pipelines its snapshot; then a second one, at low CPU priority,
serializes, hashes and writes. Whatever changes them first calls
`fence()`, which returns once the copy is complete: every optimizer step (and with it the schedule,
the loss scaler and the EMA update), an EMA swap for previews, a load, the next save and `close()`.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from trainer.checkpoint.store import CheckpointError, CheckpointStore, Payload, SaveResult

log = logging.getLogger(__name__)


# The background write (serialize, hash, upload) yields the CPU to training: at nice 19 it gets
# about 1.5% of a core the training thread wants (CFS weights 15 vs 1024), and all of an idle one.
BACKGROUND_WRITE_NICE = 19


def lower_thread_priority(nice: int) -> None:
    """Raise this thread's nice value by `nice` (Linux: per thread; the threads it starts, the per-file
    writers and hashers, inherit it). Elsewhere, or if refused, nothing changes."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as e:
        log.debug("could not lower the checkpoint writer's priority: %s", e)


class SnapshotError(CheckpointError):
    """A background snapshot could not copy the state (nothing of it was written)."""


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Which memory a tensor lives in (a DTensor: its local shard's): views of one storage share it."""
    if isinstance(t, DTensor):
        t = t.to_local()
    return str(t.device), t.untyped_storage().data_ptr()


@dataclass
class _Deferred:
    name: str
    buffer: torch.Tensor
    source: torch.Tensor
    version: int  # the source's in-place version counter when staged


class Snapshot:
    """A checkpoint's files over reused CPU buffers; tensors listed in `_deferred` are copied by `complete()`."""

    def __init__(self, files: dict[str, Payload], deferred: list[_Deferred], stream: Any = None):
        self.files = files
        self._deferred = deferred
        self._stream = stream
        self.copied = threading.Event()
        self.error: BaseException | None = None
        self.deferred_bytes = sum(d.buffer.numel() * d.buffer.element_size() for d in deferred)

    def complete(self) -> None:
        """Copy the deferred tensors (background thread). A source changed in place since it was staged means
        a missing fence: raise rather than write a checkpoint mixing two steps."""
        try:
            ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
            with ctx:
                for d in self._deferred:
                    d.buffer.copy_(d.source, non_blocking=d.source.is_cuda)
                    # Tensor._version: autograd's in-place write counter, exposed only under this name;
                    # guarded by tests/test_private_apis.py::test_tensor_version_counter_counts_in_place_writes.
                    if d.source._version != d.version:
                        raise SnapshotError(
                            f"{d.name} changed while it was being copied for the checkpoint: something updated "
                            "it in place without waiting for the snapshot (Checkpointer.fence)"
                        )
            if self._stream is not None:
                self._stream.synchronize()
        except BaseException as e:
            self.error = e
            raise
        finally:
            self._deferred = []  # no references to live tensors once copied
            self.copied.set()


class SnapshotBuffers:
    """Reusable CPU buffers the live tensors are copied into before a background save.

    Fresh allocations are slow to touch on these VMs (0.5 GB/s for a clone vs
    17 GB/s for `copy_` into buffers touched before), so buffers are kept and
    reused across saves; on CUDA they are pinned so the copy is a fast DMA, and
    the deferred part runs on a side stream that first waits for the work
    already queued (the optimizer step that produced the state).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._stream: Any = None

    def _buffer(self, fname: str, tname: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get((fname, tname))
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._buffers[(fname, tname)] = buf
        return buf

    def stage(self, files: Mapping[str, Payload], stable: Callable[[torch.Tensor], bool] | None = None) -> Snapshot:
        """Copy now every tensor `stable` does not accept; defer the others to `Snapshot.complete()`."""
        out: dict[str, Payload] = {}
        deferred: list[_Deferred] = []
        pending_cuda = False
        for fname, payload in files.items():
            if isinstance(payload, bytes | bytearray):
                out[fname] = bytes(payload)
                continue
            copied = {}
            for tname, t in payload.items():
                t = t.detach()
                buf = self._buffer(fname, tname, t)
                if stable is not None and t.numel() and stable(t):
                    deferred.append(_Deferred(f"{fname}:{tname}", buf, t, t._version))
                else:
                    buf.copy_(t, non_blocking=t.is_cuda)
                    pending_cuda |= t.is_cuda
                copied[tname] = buf
            out[fname] = copied
        if pending_cuda:
            torch.cuda.synchronize()
        stream = None
        if any(d.source.is_cuda for d in deferred):
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            stream = self._stream
        return Snapshot(out, deferred, stream)


class Checkpointer:
    """Saves through a CheckpointStore, in the caller's thread or in one background worker.

    Async mode: `save` waits for the previous save (that wait is stall),
    copies the tensors that may change in the next forward (stall too), and
    returns; the worker copies the rest (until then `fence()` blocks), then
    writes. A failed write is kept and handed to the loop by `take_failure()`
    on a later step; a failed copy is raised by `fence()` in the training
    thread (nothing of that snapshot is written). Either way the next save
    simply tries again. Limits: the snapshot doubles host memory of this
    process's state.

    `write(step, files, meta)` does the writing: the store's whole-checkpoint
    write on rank 0 by default; for sharded checkpoints every rank has a
    Checkpointer whose `write` saves its own files and lets rank 0 commit
    (returning None on the other ranks). `on_copy_failure(step, meta, error)`
    stands in for `write` when this rank's copy failed, so a collective write
    still hears from every rank (sharded: the others learn the save failed).
    """

    def __init__(
        self,
        store: CheckpointStore,
        async_save: bool,
        on_done: Callable[[SaveResult], None] | None = None,
        write: Callable[[int, Mapping[str, Payload], Mapping[str, Any]], SaveResult | None] | None = None,
        on_copy_failure: Callable[[int, Mapping[str, Any], BaseException], None] | None = None,
        write_nice: int = BACKGROUND_WRITE_NICE,
    ):
        self.store = store
        self.write = write or store.write
        self.on_done = on_done
        self.on_copy_failure = on_copy_failure
        self.async_save = async_save
        # Two threads: the copy runs at normal priority (the next optimizer step may wait for it); the
        # write after it (serialize, hash, upload: seconds of CPU) at a lower one, so on a busy host the
        # training thread keeps its core (see `lower_thread_priority`).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gentrain-ckpt") if async_save else None
        self._write_pool = (
            ThreadPoolExecutor(
                max_workers=1,
                thread_name_prefix="gentrain-ckpt-write",
                initializer=lower_thread_priority,
                initargs=(write_nice,),
            )
            if async_save
            else None
        )
        self._buffers = SnapshotBuffers()
        self._inflight: Future | None = None
        self._snapshot: tuple[int, Snapshot] | None = None  # staged, not yet fenced
        self._failure: BaseException | None = None
        self._lock = threading.Lock()

    def _run(self, step: int, files: Mapping[str, Payload], meta: Mapping[str, Any]) -> SaveResult | None:
        result = self.write(step, files, meta)
        if result is None:
            return None
        log.info(
            "checkpoint committed %s (%.1f MB in %.2fs%s)",
            result.info.url,
            result.total_bytes / 1e6,
            result.seconds,
            f", pruned steps {result.deleted}" if result.deleted else "",
        )
        if self.on_done is not None:
            self.on_done(result)
        return result

    def _background(self, step: int, snapshot: Snapshot, meta: Mapping[str, Any]) -> SaveResult | None:
        try:
            snapshot.complete()
        except BaseException as e:  # the fence raises it in the training thread
            if self.on_copy_failure is not None:
                try:
                    self.on_copy_failure(step, meta, e)
                except CheckpointError:
                    pass  # the consequence of this rank's own failure, already reported by the fence
            return None
        assert self._write_pool is not None
        return self._write_pool.submit(self._run, step, snapshot.files, meta).result()

    def fence(self) -> float:
        """Block until the in-flight snapshot holds a copy of every tensor; returns the seconds waited.

        Call before anything changes a parameter, optimizer state or EMA weight. Raises SnapshotError
        here, in the caller's thread, if the copy failed (that save then writes nothing).
        """
        pending = self._snapshot
        if pending is None:
            return 0.0
        t0 = time.perf_counter()
        step, snapshot = pending
        snapshot.copied.wait()
        self._snapshot = None
        if snapshot.error is not None:
            raise SnapshotError(
                f"the background snapshot for the checkpoint of step {step} failed, nothing of it was written: "
                f"{type(snapshot.error).__name__}: {snapshot.error}"
            ) from snapshot.error
        return time.perf_counter() - t0

    def _settle(self) -> None:
        """Fence, keeping a copy failure for `take_failure()` (used where the caller is not the loop's fence)."""
        try:
            self.fence()
        except SnapshotError as e:
            with self._lock:
                self._failure = e

    def _collect(self, fut: Future) -> SaveResult | None:
        try:
            return fut.result()
        except Exception as e:  # reported to the loop, never fatal: the next save retries
            with self._lock:
                self._failure = e
            return None

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the in-flight save (if any) ends; returns its result (None if it failed)."""
        self._settle()
        fut = self._inflight
        if fut is None:
            return None
        fut.exception(timeout=timeout)  # waits; raises TimeoutError if still running
        self._inflight = None
        return self._collect(fut)

    def writing(self) -> bool:
        """True while a background save is still copying or writing."""
        return self._inflight is not None and not self._inflight.done()

    def take_failure(self) -> BaseException | None:
        fut = self._inflight
        if fut is not None and fut.done():
            self._inflight = None
            self._collect(fut)
        with self._lock:
            err, self._failure = self._failure, None
        return err

    def save(
        self,
        step: int,
        files: Mapping[str, Payload],
        meta: Mapping[str, Any],
        sync: bool = False,
        stable: Callable[[torch.Tensor], bool] | None = None,
    ) -> tuple[float, SaveResult | None]:
        """Save a checkpoint; returns (seconds the training thread was stalled, result if sync).

        `stable(tensor)`: True for tensors that stay unchanged until the next `fence()` (copied in the
        background, async only); None copies every tensor before returning.
        """
        t0 = time.perf_counter()
        if self._inflight is not None or self._snapshot is not None:
            self.wait()
        if sync or not self.async_save:
            result = self._run(step, files, meta)
            return time.perf_counter() - t0, result
        snapshot = self._buffers.stage(files, stable)
        assert self._pool is not None
        self._snapshot = (step, snapshot) if snapshot.deferred_bytes else None
        if self._snapshot is None:
            snapshot.copied.set()
        self._inflight = self._pool.submit(self._background, step, snapshot, dict(meta))
        return time.perf_counter() - t0, None

    def close(self) -> None:
        self.wait()
        for pool in (self._pool, self._write_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self.store.close()
