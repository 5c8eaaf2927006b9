"""CheckpointStore: committed, verified, discoverable checkpoints on any fsspec store.

Layout (see design.md):

    <root>/step-000001200/manifest.json   written LAST: the commit point
    <root>/step-000001200/<payload files> safetensors for tensors, JSON for the rest
    <root>/LATEST                          hint: name of the newest committed step dir

A checkpoint exists if and only if its manifest exists, parses, and every file
it lists has the listed size; its digest (blake3 for new checkpoints, sha256
in older ones: the manifest names the algorithm) is checked when a file is
read. Nothing here unpickles: safetensors and JSON only.

Limits: one committer per root (rank 0 of one job). In a sharded save every
rank writes its own payload files (`write_files`) and rank 0 commits the
manifest listing all of them (`commit`). Object stores give no atomic
rename, so on them a half-written step dir is simply a dir without manifest,
which discovery skips and retention removes.
"""

from __future__ import annotations

import json
import logging
import os
import posixpath
import re
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as safetensors_load

from trainer.checkpoint.format import DIGEST, Hasher, entry_digest, fsync, new_digest, write_safetensors

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: blake3 digests, sharded layout; 1 (sha256, one writer) still loads
MANIFEST = "manifest.json"
LATEST = "LATEST"
_STEP_RE = re.compile(r"^step-(\d{9,})$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's file does not match its manifest (size or digest)."""


def step_dir_name(step: int) -> str:
    return f"step-{step:09d}"


@dataclass
class CheckpointInfo:
    url: str
    step: int
    valid: bool
    reason: str = ""
    manifest: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return step_dir_name(self.step)

    @property
    def total_bytes(self) -> int:
        if not self.manifest:
            return 0
        return sum(int(v["bytes"]) for v in self.manifest.get("files", {}).values())

    @property
    def time_utc(self) -> str:
        return (self.manifest or {}).get("time_utc", "")


@dataclass
class SaveResult:
    info: CheckpointInfo
    seconds: float
    total_bytes: int
    deleted: list[int] = field(default_factory=list)


Payload = bytes | Mapping[str, torch.Tensor]


class CheckpointStore:
    """Writes, discovers, verifies and prunes checkpoints under one fsspec root URL."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        keep: int = 3,
        keep_every_steps: int = 0,
    ):
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **self.storage_options)
        self.root = self.root.rstrip("/")
        self.keep = keep
        self.keep_every_steps = keep_every_steps
        self._local = isinstance(self.fs, LocalFileSystem)
        # Training runs set this: old checkpoints are then deleted on a helper thread after the
        # commit (deleting a GB-sized checkpoint took 0.2-0.3 s here, a quarter of a sync save).
        self.prune_in_background = False
        self._pruner: ThreadPoolExecutor | None = None
        self._pruning: Future | None = None

    # -- paths
    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_for(self, step: int) -> str:
        return f"{self.url}/{step_dir_name(step)}"

    # -- writing
    def _put_small(self, path: str, data: bytes) -> None:
        """Write a small file so that readers see the old or the new content, never half."""
        if self._local:
            tmp = f"{path}.tmp-{threading.get_ident()}"
            with open(tmp, "wb") as f:
                f.write(data)
                fsync(f)
            os.replace(tmp, path)
        else:
            # One PUT: object stores make it visible whole or not at all.
            self.fs.pipe_file(path, data)

    def write(self, step: int, files: Mapping[str, Payload], meta: Mapping[str, Any]) -> SaveResult:
        """Write payload files, then the manifest (commit), then LATEST, then apply retention."""
        t0 = time.perf_counter()
        existing = self.check(step)
        if existing.valid:
            log.info("checkpoint %s is already committed; not writing it again", existing.url)
            return SaveResult(existing, 0.0, existing.total_bytes)
        entries = self.write_files(step, files)
        return self.commit(step, entries, meta, t0)

    def write_files(self, step: int, files: Mapping[str, Payload]) -> dict[str, dict[str, Any]]:
        """Write (and on local disks fsync) payload files into the step dir; their manifest entries.

        Nothing is committed: a step dir without manifest is invisible. In a
        sharded save every rank calls this for its own files.
        """
        d = self._path(step_dir_name(step))
        if self._local:
            self.fs.makedirs(d, exist_ok=True)
        if not files:
            return {}
        # Files are written concurrently: each hashes on its own thread, and
        # object stores upload several files at once.
        with ThreadPoolExecutor(max_workers=min(4, len(files)), thread_name_prefix="gentrain-put") as pool:
            futures = {name: pool.submit(self._write_payload, d, name, payload) for name, payload in files.items()}
            return {name: fut.result() for name, fut in futures.items()}

    def commit(
        self, step: int, entries: Mapping[str, Mapping[str, Any]], meta: Mapping[str, Any], t0: float | None = None
    ) -> SaveResult:
        """Write the manifest listing `entries` (the commit point), then LATEST, then apply retention."""
        t0 = time.perf_counter() if t0 is None else t0
        self.wait_pruned()  # one pruning at a time, never racing the next commit's retention
        d = self._path(step_dir_name(step))
        manifest = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "digest": DIGEST,
            **dict(meta),
            "files": dict(entries),
        }
        self._put_small(posixpath.join(d, MANIFEST), json.dumps(manifest, indent=1).encode())
        info = self.check(step)
        if not info.valid:
            raise CheckpointError(f"checkpoint {info.url} did not verify after writing: {info.reason}")
        self._put_small(self._path(LATEST), step_dir_name(step).encode())
        total = sum(int(e["bytes"]) for e in entries.values())
        if not self.prune_in_background:
            return SaveResult(info, time.perf_counter() - t0, total, self.apply_retention())
        if self._pruner is None:
            self._pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gentrain-prune")
        self._pruning = self._pruner.submit(self._prune_logged)
        return SaveResult(info, time.perf_counter() - t0, total)

    def _prune_logged(self) -> list[int]:
        deleted = self.apply_retention()
        if deleted:
            log.info("pruned checkpoints %s under %s", deleted, self.url)
        return deleted

    def wait_pruned(self) -> list[int]:
        """Wait for a background pruning (if any); the steps it deleted."""
        fut, self._pruning = self._pruning, None
        if fut is None:
            return []
        try:
            return fut.result()
        except Exception as e:  # noqa: BLE001 - like a failed delete: logged, the next commit retries
            log.warning("pruning old checkpoints under %s failed (retried after the next save): %s", self.url, e)
            return []

    def close(self) -> None:
        self.wait_pruned()
        if self._pruner is not None:
            self._pruner.shutdown(wait=True)
            self._pruner = None

    def _write_payload(self, d: str, name: str, payload: Payload) -> dict[str, Any]:
        with self.fs.open(posixpath.join(d, name), "wb") as f, Hasher() as digest:
            if isinstance(payload, bytes | bytearray):
                digest.update(memoryview(payload))
                f.write(payload)
                n = len(payload)
            else:
                n = write_safetensors(f, payload, digest.update)
            if self._local:
                fsync(f)  # payload durable before the manifest commits it
            return {"bytes": n, digest.algorithm: digest.hexdigest()}

    # -- discovery
    def steps(self) -> list[int]:
        """Step numbers of every step dir under the root, committed or not (one listing)."""
        try:
            names = self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            m = _STEP_RE.match(posixpath.basename(n.rstrip("/")))
            if m:
                out.append(int(m.group(1)))
        return sorted(set(out))

    def check(self, step: int) -> CheckpointInfo:
        """Manifest parses and every listed file has its size (no hashing)."""
        d = self._path(step_dir_name(step))
        url = self.url_for(step)
        try:
            raw = self.fs.cat_file(posixpath.join(d, MANIFEST))
        except FileNotFoundError:
            return CheckpointInfo(url, step, False, "no manifest.json (incomplete or interrupted save)")
        try:
            manifest = json.loads(raw)
            files = manifest["files"]
            if int(manifest["step"]) != step:
                raise ValueError(f"manifest says step {manifest['step']}")
            if int(manifest.get("format_version", 0)) > FORMAT_VERSION:
                raise ValueError(f"format_version {manifest['format_version']} is newer than this gentrain")
        except (ValueError, KeyError, TypeError) as e:
            return CheckpointInfo(url, step, False, f"manifest.json is unreadable: {e}")
        try:
            listing = {posixpath.basename(e["name"]): e for e in self.fs.ls(d, detail=True, refresh=True)}
        except FileNotFoundError:
            listing = {}
        for name, entry in files.items():
            found = listing.get(name)
            if found is None:
                return CheckpointInfo(url, step, False, f"{name} is missing", manifest)
            if int(found.get("size") or 0) != int(entry["bytes"]):
                return CheckpointInfo(
                    url, step, False, f"{name} has {found.get('size')} bytes, manifest says {entry['bytes']}", manifest
                )
        return CheckpointInfo(url, step, True, "", manifest)

    def list(self) -> list[CheckpointInfo]:
        return [self.check(s) for s in self.steps()]

    def latest_hint(self) -> int | None:
        try:
            name = self.fs.cat_file(self._path(LATEST)).decode().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        m = _STEP_RE.match(name)
        return int(m.group(1)) if m else None

    def valid_candidates(self) -> Iterable[CheckpointInfo]:
        """Committed checkpoints, newest first, each checked lazily.

        LATEST is read first (one GET); one listing of step dir names finds any
        newer step dir the hint does not know of (a crash between manifest and
        LATEST), which is checked before it. Invalid ones are skipped with a
        warning naming why.
        """
        hint = self.latest_hint()
        steps = self.steps()
        order = sorted(steps, reverse=True)
        if hint is not None and hint in steps:
            newer = [s for s in order if s > hint]
            order = newer + [hint] + [s for s in order if s < hint]
        for s in order:
            info = self.check(s)
            if info.valid:
                yield info
            else:
                log.warning("skipping checkpoint %s: %s", info.url, info.reason)

    def latest_valid(self) -> CheckpointInfo | None:
        return next(iter(self.valid_candidates()), None)

    # -- reading
    def file_path(self, info: CheckpointInfo, name: str) -> str:
        return self._path(info.name, name)

    def manifest_entry(self, info: CheckpointInfo, name: str) -> Mapping[str, Any]:
        assert info.manifest is not None
        entry = info.manifest["files"].get(name)
        if entry is None:
            raise CheckpointCorrupt(f"{info.url}: manifest lists no file {name!r}")
        return entry

    def check_digest(self, info: CheckpointInfo, name: str, size: int, hexdigest: str, algorithm: str) -> None:
        entry = self.manifest_entry(info, name)
        if size != int(entry["bytes"]):
            raise CheckpointCorrupt(f"{info.url}/{name}: {size} bytes, manifest says {entry['bytes']}")
        want_algorithm, want = entry_digest(entry)
        if algorithm != want_algorithm or hexdigest != want:
            raise CheckpointCorrupt(f"{info.url}/{name}: {algorithm} {hexdigest[:12]}… does not match the manifest")

    def read_file(self, info: CheckpointInfo, name: str) -> bytes:
        """One payload file, checked against the manifest's size and digest."""
        algorithm, _ = entry_digest(self.manifest_entry(info, name))
        try:
            data = self.fs.cat_file(self._path(info.name, name))
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{info.url}/{name} is missing") from None
        h = new_digest(algorithm)
        h.update(data)
        self.check_digest(info, name, len(data), h.hexdigest(), algorithm)
        return data

    def verify_file(self, info: CheckpointInfo, name: str, chunk_bytes: int = 16 << 20) -> None:
        """Stream one file through its digest (memory: one chunk); raises CheckpointCorrupt."""
        algorithm, _ = entry_digest(self.manifest_entry(info, name))
        h, n = new_digest(algorithm), 0
        try:
            with self.fs.open(self._path(info.name, name), "rb") as f:
                while chunk := f.read(chunk_bytes):
                    h.update(chunk)
                    n += len(chunk)
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{info.url}/{name} is missing") from None
        self.check_digest(info, name, n, h.hexdigest(), algorithm)

    def read_tensors(self, info: CheckpointInfo, name: str) -> dict[str, torch.Tensor]:
        return safetensors_load(self.read_file(info, name))

    def read_json(self, info: CheckpointInfo, name: str) -> Any:
        return json.loads(self.read_file(info, name))

    def verify(self, info: CheckpointInfo) -> list[str]:
        """Full check of every file (size and digest, streamed); returns the problems found."""
        if not info.valid:
            return [info.reason]
        problems = []
        for name in info.manifest["files"]:
            try:
                self.verify_file(info, name)
            except CheckpointCorrupt as e:
                problems.append(str(e))
        return problems

    # -- retention
    def apply_retention(self) -> list[int]:
        """Delete checkpoints beyond `keep` newest + milestones; never the newest valid one.

        Runs only after a newer checkpoint is committed. Uncommitted step dirs
        older than the newest committed one are debris of interrupted saves and
        are removed too. A failed delete is logged; the next save retries it.
        """
        infos = self.list()
        valid = [i for i in infos if i.valid]
        if not valid:
            return []
        newest = valid[-1].step
        keep = {i.step for i in valid[-self.keep :]}
        if self.keep_every_steps:
            keep |= {i.step for i in valid if i.step % self.keep_every_steps == 0}
        deleted = []
        for info in infos:
            if info.step in keep or info.step >= newest:
                continue
            d = self._path(info.name)
            try:
                if info.valid:
                    # Manifest first: a half-deleted checkpoint must look invalid, not valid.
                    self.fs.rm_file(posixpath.join(d, MANIFEST))
                self.fs.rm(d, recursive=True)
                deleted.append(info.step)
            except (OSError, FileNotFoundError) as e:
                log.warning("could not delete old checkpoint %s (will retry after the next save): %s", info.url, e)
        return deleted


def resolve_checkpoint(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[CheckpointStore, CheckpointInfo | None]:
    """A URL that is either one checkpoint (step-NNN) or a root; returns its store and checkpoint.

    For a root, the newest valid checkpoint; for a step dir, that one (valid or not).
    """
    url = url.rstrip("/")
    base = posixpath.basename(url)
    m = _STEP_RE.match(base)
    if m:
        store = CheckpointStore(url[: -len(base) - 1] or ".", storage_options)
        return store, store.check(int(m.group(1)))
    store = CheckpointStore(url, storage_options)
    return store, store.latest_valid()
