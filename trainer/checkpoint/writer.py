"""Checkpointer: sync or background saves of a training-state snapshot, at most one in flight."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from trainer.checkpoint.store import CheckpointStore, Payload, SaveResult

log = logging.getLogger(__name__)


class SnapshotBuffers:
    """Reusable CPU buffers the live tensors are copied into before a background save.

    Fresh allocations are slow to touch on these VMs (0.5 GB/s for a clone vs
    17 GB/s for `copy_` into buffers touched before), so buffers are kept and
    reused across saves; on CUDA they are pinned so the copy is a fast DMA.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def copy(self, files: Mapping[str, Payload]) -> dict[str, Payload]:
        out: dict[str, Payload] = {}
        pending_cuda = False
        for fname, payload in files.items():
            if isinstance(payload, bytes | bytearray):
                out[fname] = bytes(payload)
                continue
            copied = {}
            for tname, t in payload.items():
                buf = self._buffers.get((fname, tname))
                if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                    pin = t.is_cuda
                    buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
                    self._buffers[(fname, tname)] = buf
                buf.copy_(t.detach(), non_blocking=t.is_cuda)
                pending_cuda |= t.is_cuda
                copied[tname] = buf
            out[fname] = copied
        if pending_cuda:
            torch.cuda.synchronize()
        return out


class Checkpointer:
    """Saves through a CheckpointStore, in the caller's thread or in one background worker.

    Async mode: `save` waits for the previous save (that wait is stall),
    snapshots tensors to CPU (stall too) and returns; the write happens in the
    background. A background failure is kept and handed to the loop by
    `take_failure()` on a later step; the next save simply tries again. Limits:
    the snapshot doubles host memory of this process's state.

    `write(step, files, meta)` does the writing: the store's whole-checkpoint
    write on rank 0 by default; for sharded checkpoints every rank has a
    Checkpointer whose `write` saves its own files and lets rank 0 commit
    (returning None on the other ranks).
    """

    def __init__(
        self,
        store: CheckpointStore,
        async_save: bool,
        on_done: Callable[[SaveResult], None] | None = None,
        write: Callable[[int, Mapping[str, Payload], Mapping[str, Any]], SaveResult | None] | None = None,
    ):
        self.store = store
        self.write = write or store.write
        self.on_done = on_done
        self.async_save = async_save
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gentrain-ckpt") if async_save else None
        self._buffers = SnapshotBuffers()
        self._inflight: Future | None = None
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

    def _collect(self, fut: Future) -> SaveResult | None:
        try:
            return fut.result()
        except Exception as e:  # reported to the loop, never fatal: the next save retries
            with self._lock:
                self._failure = e
            return None

    def wait(self, timeout: float | None = None) -> SaveResult | None:
        """Block until the in-flight save (if any) ends; returns its result (None if it failed)."""
        fut = self._inflight
        if fut is None:
            return None
        fut.exception(timeout=timeout)  # waits; raises TimeoutError if still running
        self._inflight = None
        return self._collect(fut)

    def take_failure(self) -> BaseException | None:
        fut = self._inflight
        if fut is not None and fut.done():
            self._inflight = None
            self._collect(fut)
        with self._lock:
            err, self._failure = self._failure, None
        return err

    def save(
        self, step: int, files: Mapping[str, Payload], meta: Mapping[str, Any], sync: bool = False
    ) -> tuple[float, SaveResult | None]:
        """Save a checkpoint; returns (seconds the training thread was stalled, result if sync)."""
        t0 = time.perf_counter()
        if self._inflight is not None:
            self.wait()
        if sync or not self.async_save:
            result = self._run(step, files, meta)
            return time.perf_counter() - t0, result
        snapshot = self._buffers.copy(files)
        assert self._pool is not None
        self._inflight = self._pool.submit(self._run, step, snapshot, dict(meta))
        return time.perf_counter() - t0, None

    def close(self) -> None:
        if self._inflight is not None:
            self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.store.close()
