"""CheckpointStore: committed, verified, discoverable checkpoints on any fsspec store.

Layout (docs/contract.md, "Checkpoint layout"):

    <root>/step-000001200/manifest.json   written LAST: the commit point
    <root>/step-000001200/<payload files> safetensors for tensors, JSON for the rest
    <root>/LATEST                          hint: name of the newest committed step dir

A checkpoint is *committed* when its step dir is a real dir (not a link), its
manifest parses against its schema and every file it lists exists with the
listed size (`check`, no hashing); it is *valid* when, on top of that, every
file matches its digest (blake3 for new checkpoints, sha256 in older ones)
and its structure (safetensors headers, JSON state schemas): `verify`, with
the rules in `trainer.checkpoint.validity`. Discovery, `verify`, resume,
sampling, retention and the save path's "already committed?" check all use
these two, so they agree. Nothing here unpickles: safetensors and JSON only,
and nothing in a root is trusted: a stray file, a link or a malformed entry is
one invalid candidate, never an error of the whole root.

Ownership: a save belongs to one run and one timeline of it (`Timeline`; docs/checkpoints.md, "Runs,
timelines and the lease"). A step committed by another timeline (an older run, or the part of this run
a resume fell back past) is replaced, never kept: its manifest goes first (the step is uncommitted),
then its files, then the new payload and manifest. Only a step this timeline already wrote, or the one
it started from, is not written again. `fence` (the lease's check) runs before every manifest write
and before such a removal, so a trainer that lost the root to another never commits or deletes there.

Limits: one committer per root (rank 0 of one job; the lease keeps other jobs out). In a sharded save every
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
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors.torch import load as safetensors_load

from trainer.checkpoint.format import DIGEST, Hasher, entry_digest, fsync, new_digest, write_safetensors
from trainer.checkpoint.layout import (
    MANIFEST,
    SHARD_INDEX,
    TRAINER_JSON,
    group_name,
    is_rank_json,
    is_rank_tensors,
    is_tensor_file,
    parse_group_file,
    parse_step_dir,
    step_dir_name,
    whole_file,
)
from trainer.checkpoint.validity import (
    FORMAT_VERSION,
    check_rank_tensors,
    parse_json,
    parse_manifest,
    parse_rank_json,
    parse_safetensors_header,
    parse_shard_index,
    parse_trainer_json,
    tensor_refs,
)
from trainer.errors import CheckpointCorrupt, CheckpointError
from trainer.storage import filesystem

log = logging.getLogger(__name__)

__all__ = ["CheckpointCorrupt", "CheckpointError", "CheckpointInfo", "CheckpointStore", "FORMAT_VERSION", "Timeline"]

LATEST = "LATEST"


@dataclass
class CheckpointInfo:
    url: str
    step: int
    valid: bool
    reason: str = ""
    manifest: dict[str, Any] | None = None
    fingerprint: str = ""  # blake3 of the manifest's bytes: which commit of this step was checked

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
        manifest = info.manifest or {}
        return manifest.get("timeline") == self.timeline or (info.step, info.fingerprint) == self.origin


def describe_owner(manifest: Mapping[str, Any] | None) -> str:
    """Who wrote a checkpoint, in words (for logs and errors)."""
    m = manifest or {}
    if not m.get("run"):
        return "a run that recorded no run id (an older gentrain)"
    return f"run {m['run']} (timeline {m.get('timeline')}, job {m.get('job')}, at {m.get('time_utc')})"


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
        self.fs, self.root = filesystem(self.url, self.storage_options)
        self.root = self.root.rstrip("/")
        self.keep = keep
        self.keep_every_steps = keep_every_steps
        self._local = isinstance(self.fs, LocalFileSystem)
        # Training runs set this: old checkpoints are then deleted on a helper thread after the
        # commit (deleting a GB-sized checkpoint took 0.2-0.3 s here, a quarter of a sync save).
        self.prune_in_background = False
        self._pruner: ThreadPoolExecutor | None = None
        self._pruning: Future | None = None
        self._verified: set[tuple[int, str]] = set()  # (step, manifest fingerprint) found valid by `verify`
        self._digests_ok: set[tuple[int, str, str]] = set()  # (step, fingerprint, file) whose digest matched
        # A training process sets both: the timeline its saves belong to (recorded in every manifest; None:
        # a tool or test writing a root, which keeps any valid step), and the lease check run before every
        # manifest write and before removing a committed step (trainer.checkpoint.lease.Lease.check).
        self.timeline: Timeline | None = None
        self.fence: Callable[[], None] | None = None

    # -- paths
    def _path(self, *parts: str) -> str:
        return posixpath.join(self.root, *parts)

    def url_for(self, step: int) -> str:
        return f"{self.url}/{step_dir_name(step)}"

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
        if self.fence is not None:
            self.fence()  # a trainer that lost the root deletes nothing there
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

    def _remove_step(self, step: int, committed: bool) -> None:
        d = self._path(step_dir_name(step))
        if self._is_link(d):
            # Only the link goes: whatever it points at lies outside the root and is never touched.
            log.warning("%s is a symbolic link; removing the link (not its target)", self.url_for(step))
            os.unlink(d)
            return
        if committed:
            # Manifest first: a half-deleted checkpoint must look uncommitted, never valid.
            try:
                self.fs.rm_file(posixpath.join(d, MANIFEST))
            except FileNotFoundError:
                pass
        try:
            self.fs.rm(d, recursive=True)
        except FileNotFoundError:
            pass

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
            **(self.timeline.fields() if self.timeline is not None else {}),
            "files": dict(entries),
        }
        if self.fence is not None:
            self.fence()  # fencing: never commit once another trainer holds the root
        self._put_small(posixpath.join(d, MANIFEST), json.dumps(manifest, indent=1).encode())
        info = self.check(step)
        if not info.valid:
            raise CheckpointError(f"checkpoint {info.url} did not verify after writing: {info.reason}")
        self._verified.add((step, info.fingerprint))  # its digests were computed from the bytes written
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
                n = write_safetensors(f, payload, digest.update)
            if self._local:
                fsync(f)  # payload durable before the manifest commits it
            return {"bytes": n, digest.algorithm: digest.hexdigest()}

    # -- discovery
    def _is_link(self, path: str) -> bool:
        """True for a symbolic link on a local disk (object stores have none)."""
        return self._local and os.path.islink(path)

    def steps(self) -> list[int]:
        """Step numbers of every entry named like a step dir under the root (dirs, files, links; one listing)."""
        try:
            names = self.fs.ls(self.root, detail=False, refresh=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        out = []
        for n in names:
            step = parse_step_dir(posixpath.basename(str(n).rstrip("/")))
            if step is not None:
                out.append(step)
        return sorted(set(out))

    def check(self, step: int) -> CheckpointInfo:
        """Committed: a real step dir whose manifest matches its schema and lists files of the listed sizes.

        Never raises for what a root holds: anything odd (a file or a link named like a step dir, an
        unreadable or malformed manifest, a listed file that is a link or a dir) is an invalid candidate
        whose `reason` says why. No hashing: `verify` checks digests and structure.
        """
        d = self._path(step_dir_name(step))
        url = self.url_for(step)
        if self._is_link(d):
            return CheckpointInfo(url, step, False, "is a symbolic link (gentrain never follows links in a root)")
        try:
            raw = self.fs.cat_file(posixpath.join(d, MANIFEST))
        except FileNotFoundError:
            return CheckpointInfo(url, step, False, f"no {MANIFEST} (incomplete or interrupted save)")
        except OSError as e:  # a file named like a step dir (NotADirectoryError), a dir named manifest.json, ...
            return CheckpointInfo(url, step, False, f"{MANIFEST} cannot be read ({type(e).__name__}: {e})")
        try:
            manifest = parse_manifest(raw, step)
        except CheckpointCorrupt as e:
            return CheckpointInfo(url, step, False, str(e))
        fingerprint = new_digest("blake3").update(raw).hexdigest()
        try:
            listing = {posixpath.basename(e["name"]): e for e in self.fs.ls(d, detail=True, refresh=True)}
        except OSError as e:
            return CheckpointInfo(url, step, False, f"cannot list the step dir ({type(e).__name__}: {e})", manifest)
        for name, entry in manifest["files"].items():
            found = listing.get(name)
            why = None
            if found is None:
                why = f"{name} is missing"
            elif found.get("islink") or self._is_link(posixpath.join(d, name)):
                why = f"{name} is a symbolic link (gentrain never follows links in a checkpoint)"
            elif found.get("type") != "file":
                why = f"{name} is a {found.get('type')}, not a file"
            elif int(found.get("size") or 0) != entry["bytes"]:
                why = f"{name} has {found.get('size')} bytes, manifest says {entry['bytes']}"
            if why:
                return CheckpointInfo(url, step, False, why, manifest, fingerprint)
        return CheckpointInfo(url, step, True, "", manifest, fingerprint)

    def list(self) -> list[CheckpointInfo]:
        return [self.check(s) for s in self.steps()]

    def latest_hint(self) -> int | None:
        try:
            name = self.fs.cat_file(self._path(LATEST)).decode().strip()
        except (OSError, UnicodeDecodeError):  # absent, a dir, unreadable, binary: only a hint
            return None
        return parse_step_dir(name)

    def valid_candidates(self, deep: bool = False) -> Iterable[CheckpointInfo]:
        """Committed checkpoints (`deep`: valid ones, see `verify`), newest first, each checked lazily.

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
            problems = [info.reason] if not info.valid else (self.verify(info) if deep else [])
            if not problems:
                yield info
            else:
                log.warning("skipping checkpoint %s: %s", info.url, "; ".join(problems))

    def latest_valid(self, deep: bool = False) -> CheckpointInfo | None:
        """The newest committed checkpoint; with `deep`, the newest that also passes `verify`."""
        return next(iter(self.valid_candidates(deep)), None)

    def is_valid(self, info: CheckpointInfo) -> bool:
        """Committed and every file verified (digest and structure); cached per step and manifest."""
        return info.valid and ((info.step, info.fingerprint) in self._verified or not self.verify(info))

    # -- reading
    def file_path(self, info: CheckpointInfo, name: str) -> str:
        return self._path(info.name, name)

    def manifest_entry(self, info: CheckpointInfo, name: str) -> Mapping[str, Any]:
        if info.manifest is None:
            raise CheckpointCorrupt(f"{info.url}: {info.reason or 'no manifest'}")
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
        self._digests_ok.add((info.step, info.fingerprint, name))

    def files_verified(self, info: CheckpointInfo) -> set[str]:
        """Files of `info` this process has read through their digests (reads, `verify`, chunk reads)."""
        return {name for step, fp, name in self._digests_ok if (step, fp) == (info.step, info.fingerprint)}

    def read_file(self, info: CheckpointInfo, name: str) -> bytes:
        """One payload file, checked against the manifest's size and digest."""
        algorithm, _ = entry_digest(self.manifest_entry(info, name))
        try:
            data = self.fs.cat_file(self._path(info.name, name))
        except FileNotFoundError:
            raise CheckpointCorrupt(f"{info.url}/{name} is missing") from None
        except IsADirectoryError:
            raise CheckpointCorrupt(f"{info.url}/{name} is a directory") from None
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
        except (FileNotFoundError, IsADirectoryError):
            raise CheckpointCorrupt(f"{info.url}/{name} is missing or not a file") from None
        self.check_digest(info, name, n, h.hexdigest(), algorithm)

    def read_tensors(self, info: CheckpointInfo, name: str) -> dict[str, torch.Tensor]:
        """A safetensors payload, digest-checked and its header checked before the library parses it."""
        data = self.read_file(info, name)
        parse_safetensors_header(lambda start, n: data[start : start + n], len(data), f"{info.url}/{name}")
        return safetensors_load(data)

    def read_json(self, info: CheckpointInfo, name: str) -> Any:
        """A JSON payload, digest-checked and, for the state files gentrain reads, checked against its schema."""
        return _parse_json_payload(name, self.read_file(info, name), info)

    def read_safetensors_header(self, info: CheckpointInfo, name: str) -> tuple[dict[str, Any], int]:
        """A payload's safetensors header (checked) and its data offset, by ranged reads (no digest)."""
        path = self._path(info.name, name)
        size = int(self.manifest_entry(info, name)["bytes"])
        what = f"{info.url}/{name}"
        try:
            with self.fs.open(path, "rb") as f:

                def read(start: int, n: int) -> bytes:
                    f.seek(start)
                    return f.read(n)

                return parse_safetensors_header(read, size, what)
        except (FileNotFoundError, IsADirectoryError):
            raise CheckpointCorrupt(f"{what} is missing or not a file") from None

    def verify(self, info: CheckpointInfo, digests_checked: Iterable[str] = ()) -> list[str]:
        """Full check: every file's size and digest (streamed) and structure (safetensors headers, JSON
        state schemas, tensors the state refers to); the problems found, none if valid. Files named in
        `digests_checked` were read through their digests already (a resume's reads) and are not hashed again."""
        if not info.valid:
            return [info.reason]
        problems: list[str] = []
        parsed: dict[str, Any] = {}
        skip = set(digests_checked)
        for name in info.manifest["files"]:
            try:
                if name not in skip:
                    self.verify_file(info, name)
                if is_tensor_file(name):
                    parsed[name] = self.read_safetensors_header(info, name)[0]
                    if is_rank_tensors(name):  # small: its RNG state is read and tried on scratch generators
                        partner = name.removesuffix(".safetensors") + ".json"
                        if partner not in info.manifest["files"]:  # a resume reads both: one without the other
                            raise CheckpointCorrupt(f"{info.url}: {name} is listed without its {partner}")
                        check_rank_tensors(self.read_tensors(info, name), f"{info.url}/{name}")
                elif name.endswith(".json"):
                    parsed[name] = self.read_json(info, name)
            except CheckpointCorrupt as e:
                problems.append(str(e))
        if not problems:
            problems += _cross_check(info, parsed)
        if not problems:
            self._verified.add((info.step, info.fingerprint))
        return problems

    # -- retention
    def apply_retention(self) -> list[int]:
        """Delete checkpoints beyond `keep` newest valid ones + milestones; never the newest valid one.

        Runs only after a newer checkpoint is committed. Only valid checkpoints count (`is_valid`:
        digests and structure, checked once per process; the ones this process wrote are known valid),
        newest first. Invalid or uncommitted step dirs older than the newest valid one are debris of
        interrupted saves or corruption and are removed too. Links are never followed nor deleted. A
        failed delete is logged; the next save retries it.
        """
        kept: list[int] = []
        newest: int | None = None
        deleted = []
        for step in sorted(self.steps(), reverse=True):
            info = self.check(step)
            if info.reason.startswith("is a symbolic link"):
                log.warning("leaving %s alone: %s", info.url, info.reason)
                continue
            valid = info.valid and self.is_valid(info)
            if newest is None:
                if valid:
                    newest = step
                    kept.append(step)
                continue  # newer than the newest valid one: maybe a save in progress
            milestone = valid and self.keep_every_steps and step % self.keep_every_steps == 0
            if valid and len(kept) < self.keep:
                kept.append(step)
                continue
            if milestone:
                continue
            try:
                self._remove_step(step, committed=info.manifest is not None)
                deleted.append(step)
            except (OSError, CheckpointError) as e:
                log.warning("could not delete old checkpoint %s (will retry after the next save): %s", info.url, e)
        return sorted(deleted)


def _parse_json_payload(name: str, raw: bytes, info: CheckpointInfo) -> Any:
    what = f"{info.url}/{name}"
    try:
        if name == TRAINER_JSON:
            return parse_trainer_json(raw, info.step)
        if name == SHARD_INDEX:
            return parse_shard_index(raw, (info.manifest or {}).get("files", {}))
        if is_rank_json(name):
            return parse_rank_json(raw)
        return parse_json(raw, name)
    except CheckpointCorrupt as e:
        raise CheckpointCorrupt(f"{what}: {e}") from None


def _cross_check(info: CheckpointInfo, parsed: Mapping[str, Any]) -> list[str]:
    """Structure across files: what trainer.json and shards.json refer to exists, EMA fits its weights."""
    problems = []
    files = info.manifest["files"]
    index = parsed.get(SHARD_INDEX)
    if index is not None:
        for group, tensors in index["tensors"].items():
            for key, t in tensors.items():
                for c in t["chunks"]:
                    h = (parsed.get(c["file"]) or {}).get(key)
                    if h is None or h["dtype"] != t["dtype"] or h["shape"] != c["sizes"]:
                        problems.append(f"{info.url}/{c['file']}: {group}:{key} does not match shards.json")
    if TRAINER_JSON in files and not isinstance(info.manifest.get("config"), dict):
        # A training checkpoint: sampling and export build the model from its config, so one without it
        # would verify and then not load there.
        problems.append(f"{info.url}: manifest.json holds no config (a mapping) for {TRAINER_JSON}'s run")
    doc = parsed.get(TRAINER_JSON)
    if doc is not None:
        for part, state in doc["parts"].items():
            refs = tensor_refs(state["optimizer"])
            group = group_name(part, "optimizer")
            saved = set((index or {}).get("tensors", {}).get(group, {})) | set(parsed.get(whole_file(group)) or {})
            if refs - saved:
                problems.append(f"{info.url}: {group} lacks tensors trainer.json refers to: {sorted(refs - saved)[:3]}")
            model = group_name(part, "model")
            if whole_file(model) not in files and model not in (index or {}).get("tensors", {}):
                problems.append(f"{info.url}: trainer.json has part {part!r}, but no weights of it are listed")
    for name, header in parsed.items():
        g = parse_group_file(name)
        if g is not None and g.kind == "ema" and g.whole:
            model = parsed.get(whole_file(group_name(g.part, "model")))
            if model is None:
                continue
            for key, h in header.items():
                if key not in model or model[key]["shape"] != h["shape"]:
                    problems.append(f"{info.url}/{name}: {key} has no weight of shape {h['shape']} in the model")
                    break
    return problems


def resolve_checkpoint(
    url: str, storage_options: Mapping[str, Any] | None = None
) -> tuple[CheckpointStore, CheckpointInfo | None]:
    """A URL that is either one checkpoint (step-NNN) or a root; returns its store and checkpoint.

    For a root, the newest valid checkpoint (digests and structure verified: a corrupt newest one is
    skipped with a warning); for a step dir, that one, valid or not (`reason` says why not).
    """
    url = url.rstrip("/")
    base = posixpath.basename(url)
    step = parse_step_dir(base)
    if step is not None:
        store = CheckpointStore(url[: -len(base) - 1] or ".", storage_options)
        info = store.check(step)
        problems = store.verify(info) if info.valid else []
        if problems:
            info = CheckpointInfo(info.url, info.step, False, "; ".join(problems), info.manifest, info.fingerprint)
        return store, info
    store = CheckpointStore(url, storage_options)
    return store, store.latest_valid(deep=True)
