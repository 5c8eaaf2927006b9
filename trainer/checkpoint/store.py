"""CheckpointStore: commits checkpoints to any fsspec store; with its reader and retention, the whole store.

The store has three parts, one module each, stacked so each adds one seam:

    reader.py     CheckpointReader: discovery (`check`, `latest_valid`), verification (`verify`), reads
    retention.py  CheckpointRetention: which old checkpoints go after a commit; removing a step dir
    store.py      CheckpointStore: payload files, then the manifest (the commit point), then LATEST

Readers (sampling, export, `verify`, a frozen part's source run) need only a reader (`resolve_checkpoint`
returns a view through one) and read what a checkpoint holds through `trainer.checkpoint.view.CheckpointView`.
The layout and what committed and valid mean are in reader.py and docs/contract.md ("Checkpoint layout").

Ownership: a save belongs to one run and one timeline of it (`Timeline`; docs/checkpoints.md, "Runs,
timelines and the lease"). A step committed by another timeline (an older run, or the part of this run
a resume fell back past) is replaced, never kept: its manifest goes first (the step is uncommitted),
then its files, then the new payload and manifest. Only a step this timeline already wrote, or the one
it started from, is not written again. `check_lease` (the lease's check) runs before every manifest write
and before such a removal, so a trainer that lost the root to another never commits or deletes there.

Limits: one committer per root (rank 0 of one job; the lease keeps other jobs out). In a sharded save every
rank writes its own payload files (`write_files`) and rank 0 commits the
manifest listing all of them (`commit`). Object stores give no atomic
rename, so on them a half-written step dir is simply a dir without manifest,
which discovery skips and retention removes.
"""

from __future__ import annotations

import logging
import os
import posixpath
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from trainer.checkpoint.format import DIGEST, Hasher, fsync, write_safetensors
from trainer.checkpoint.layout import MANIFEST, step_dir_name
from trainer.checkpoint.reader import LATEST, CheckpointInfo, CheckpointReader, resolve_checkpoint
from trainer.checkpoint.retention import CheckpointRetention
from trainer.checkpoint.validity import FORMAT_VERSION, Manifest, manifest_json
from trainer.errors import CheckpointCorrupt, CheckpointError

log = logging.getLogger(__name__)

__all__ = [
    "LATEST",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointReader",
    "CheckpointStore",
    "FORMAT_VERSION",
    "Timeline",
    "resolve_checkpoint",
]


def new_owner_id() -> str:
    """A fresh run or timeline id (64 random bits, hex)."""
    return secrets.token_hex(8)


@dataclass(frozen=True)
class Timeline:
    """Which run and which timeline of it writes the checkpoints of a training process.

    A run id is minted at a fresh start and carried through every resume; a timeline id is minted
    every time training starts from a given state (fresh or resumed), so two processes that trained on
    from the same step never share one. `origin` is the checkpoint the timeline started from (step and
    manifest fingerprint): its state is the timeline's own first state, so it is not written again.
    """

    run: str
    timeline: str
    job: str = "local"  # TORCHELASTIC_RUN_ID of the job that wrote it
    origin: tuple[int, str] | None = None

    def fields(self) -> dict[str, str]:
        """What the manifest records."""
        return {"run": self.run, "timeline": self.timeline, "job": self.job}

    def wrote(self, info: CheckpointInfo) -> bool:
        """`info` is this timeline's: committed by it, or the checkpoint it started from."""
        timeline = info.manifest.timeline if info.manifest is not None else None
        return timeline == self.timeline or (info.step, info.fingerprint) == self.origin


def describe_owner(manifest: Manifest | None) -> str:
    """Who wrote a checkpoint, in words (for logs and errors)."""
    if manifest is None or not manifest.run:
        return "a run that recorded no run id (an older gentrain)"
    return f"run {manifest.run} (timeline {manifest.timeline}, job {manifest.job}, at {manifest.time_utc})"


@dataclass
class SaveResult:
    info: CheckpointInfo
    seconds: float
    total_bytes: int
    deleted: list[int] = field(default_factory=list)


Payload = bytes | Mapping[str, torch.Tensor]


class CheckpointStore(CheckpointRetention):
    """Writes, discovers, verifies and prunes checkpoints under one fsspec root URL: the reader and the
    retention it extends, plus committing."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        keep: int = 3,
        keep_every_steps: int = 0,
    ):
        super().__init__(url, storage_options, keep, keep_every_steps)
        # A training process sets both: the timeline its saves belong to (None: a tool or test writing a root,
        # which keeps any valid step), and the lease check run before every manifest write and before removing
        # a committed step (trainer.checkpoint.lease.Lease.check). The timeline's fields reach the manifest in
        # the meta the caller commits, merged there once (CheckpointManager._meta): the memory tier carries
        # them in its snapshots' pieces before any commit, so the store does not add them again.
        self.timeline: Timeline | None = None
        self.check_lease: Callable[[], None] | None = None

    # -- writing
    def _put_small(self, path: str, data: bytes) -> None:
        """Write a small file so that readers see the old or the new content, never half.

        On a local disk it gets no world access (0o640, or stricter under the umask) before a byte is written.
        """
        if self._local:
            tmp = f"{path}.tmp-{threading.get_ident()}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)
            os.fchmod(fd, os.fstat(fd).st_mode & 0o770)  # a leftover tmp file keeps its old mode otherwise
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                fsync(f)
            os.replace(tmp, path)
        else:
            # One PUT: object stores make it visible whole or not at all.
            self.fs.pipe_file(path, data)

    def write(self, step: int, files: Mapping[str, Payload], meta: Mapping[str, Any]) -> SaveResult:
        """Write payload files, then the manifest (commit), then LATEST, then apply retention."""
        t0 = time.perf_counter()
        existing = self.claim(step)
        if existing is not None:
            return SaveResult(existing, 0.0, existing.total_bytes)
        try:
            entries = self.write_files(step, files)
            return self.commit(step, entries, meta, t0)
        except BaseException:
            self.remove_uncommitted(step)  # a full disk must not stay full of a save that failed
            raise

    def claim(self, step: int) -> CheckpointInfo | None:
        """Before a save of `step`: the checkpoint there if this timeline already wrote it (the save is then
        skipped); otherwise whatever holds `step` is removed (invalid, or another timeline's) and None.

        Removal keeps the commit rules: manifest first, so readers see the old checkpoint, then none, then
        the new one; never a mix, never the old one's manifest over new files."""
        if step not in self.steps():
            return None
        info = self.check(step)
        valid = info.valid and self.is_valid(info)
        if valid and (self.timeline is None or self.timeline.wrote(info)):
            log.info("checkpoint %s is already committed and valid; not writing it again", info.url)
            return info
        if self.check_lease is not None:
            self.check_lease()  # a trainer that lost the root deletes nothing there
        if valid:
            log.warning(
                "checkpoint %s was written by %s, not by this timeline (%s): replacing it",
                info.url,
                describe_owner(info.manifest),
                self.timeline.timeline if self.timeline else "?",
            )
        else:
            log.warning("checkpoint %s is invalid (%s); replacing it", info.url, info.reason or "see verify")
        self._remove_step(step, committed=info.manifest is not None)
        return None

    def committed(self, step: int) -> CheckpointInfo | None:
        """The checkpoint of `step` if it is committed *and valid* (digests and structure; verified once
        per process and commit); None otherwise. The save path's "already committed?" check."""
        info = self.check(step)
        return info if info.valid and self.is_valid(info) else None

    def clear_invalid(self, step: int) -> None:
        """Remove whatever holds `step` when it is not a valid checkpoint, so a re-save replaces it whole:
        readers see the old (invalid) checkpoint, then none, then the new one; never a mix."""
        if step not in self.steps():
            return
        info = self.check(step)
        if info.valid and self.is_valid(info):
            return
        log.warning("checkpoint %s is invalid (%s); replacing it", info.url, info.reason or "see verify")
        self._remove_step(step, committed=info.manifest is not None)

    def remove_uncommitted(self, step: int) -> None:
        """Delete the step dir of a save that failed before its manifest committed it (best effort)."""
        try:
            if step in self.steps() and not self.check(step).valid:
                self._remove_step(step, committed=False)
        except (OSError, CheckpointError) as e:
            log.warning("could not remove the partial checkpoint %s: %s", self.url_for(step), e)

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
            **dict(meta),  # the run's record, its timeline's fields among them (the caller's, see `timeline`)
            "files": dict(entries),
        }
        raw = manifest_json(manifest)  # built as a Manifest, dumped in this key order
        if self.check_lease is not None:
            self.check_lease()  # never commit once another trainer holds the root
        self._put_small(posixpath.join(d, MANIFEST), raw)
        info = self.check(step)
        if not info.valid:
            raise CheckpointError(f"checkpoint {info.url} did not verify after writing: {info.reason}")
        self._verified.add((step, info.fingerprint))  # its digests were computed from the bytes written
        self._put_small(self._path(LATEST), step_dir_name(step).encode())
        total = sum(int(e["bytes"]) for e in entries.values())
        deleted = self._retain_after_commit()
        return SaveResult(info, time.perf_counter() - t0, total, deleted)

    def _write_payload(self, d: str, name: str, payload: Payload) -> dict[str, Any]:
        path = posixpath.join(d, name)
        if self._local:
            # No world access on local disks, set before a byte is written: files 0o640 in a 0o750 step dir
            # (or stricter under the umask). A checkpoint holds the run's weights and settings.
            os.chmod(d, os.stat(d).st_mode & 0o770)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o640)  # never through a link
            os.fchmod(fd, os.fstat(fd).st_mode & 0o770)  # a file already there keeps its old mode otherwise
            opened = os.fdopen(fd, "wb")
        else:
            opened = self.fs.open(path, "wb")
        with opened as f, Hasher() as digest:
            if isinstance(payload, bytes | bytearray):
                digest.update(memoryview(payload))
                f.write(payload)
                n = len(payload)
            else:
                n = write_safetensors(f, payload, digest.update, f"checkpoint save of {path}")
            if self._local:
                fsync(f)  # payload durable before the manifest commits it
            return {"bytes": n, digest.algorithm: digest.hexdigest()}
