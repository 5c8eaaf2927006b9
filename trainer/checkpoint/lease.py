"""One trainer per run: an exclusive, renewed lease on a checkpoint root, checked before every commit.

Two trainers on one root (two pods of a Job after a scheduler hiccup, a user's second launch) would
both save, resume and prune there, and one's work would be lost without a word. So the first one
writes `<root>/lease.json` naming itself (host, pid, job, since when) and renews it from a thread of
its own (`lease_seconds / 4`, off the step's path); any other trainer that finds it:

- exits 2 naming the holder if the holder renews it while it watches (for up to the holder's
  `lease_seconds`);
- takes it over if it lapses in that time (a preempted or killed holder: no person needed), or at
  once if the holder is a process of this host that is gone, or if this is a worker-group restart of
  the same torchrun job (same TORCHELASTIC_RUN_ID, a higher TORCHELASTIC_RESTART_COUNT: torchrun
  stopped every worker of the old group before it started this one).

Every write is conditional where the store can make it so, so two contenders never both win:

- local disks: create with `os.link` (fails if the name exists), replace and delete under an
  `fcntl.flock` of the root dir (on a network file system only as good as its lock support), held for a
  read, a compare and a rename only and waited for at most `lease_seconds`: a process stopped while it
  holds it makes the contender exit 2 naming the folder, never hang;
- S3: `PutObject` with `If-None-Match: *` (create) or `If-Match: <etag>` (renew, take over) and
  `DeleteObject` with `If-Match` (s3fs passes these to botocore >= 1.35.20; AWS honours them since
  2024, moto's server too);
- GCS: `ifGenerationMatch=0` (create) or `=<generation>` (renew, take over, delete) on the JSON API
  (gcsfs exposes only the create form, so the calls are made through its `call`); the tests
  run them against fake-gcs-server, which honours them. A server that ignored them would still
  be caught by the read-back below, though two simultaneous writers might not be told apart;
- other fsspec stores: no precondition exists, so the write is read back and compared (a race within
  one round trip can still let two contenders believe they won; the loser finds out at its next
  renewal or commit and stops).

The lease check: a holder checks its lease before every manifest write (`check`, the store's
`check_lease`): if another trainer took it over it raises `LeaseLost` (exit 2, never retried: the other
trainer owns the run now) and never commits again; if it could not renew it for `0.75 * lease_seconds` it
refuses that commit (a failed save, retried at the next one) because a contender may be taking it over.
Clocks of different hosts are never compared: a contender watches for a change of the lease, it does not
read its time.

The lease file is data from the store, never trusted: it is opened without following a link (local disks:
`O_NOFOLLOW | O_NONBLOCK`, so a FIFO there never blocks), must be a regular file (object stores: an object,
not a prefix), is read up to `MAX_LEASE_BYTES` only, and its `lease_seconds` is held to the bounds of
`checkpoint.lease_seconds` (a forged 1e6 makes nobody wait 11 days). Anything but a regular file is a
`ForeignLease` (exit 2 naming the path and what to do); a file that is too large or does not parse is an
unreadable lease, watched and taken over like a silent holder's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import posixpath
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import quote

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from trainer.checkpoint.layout import LEASE_FILE
from trainer.checkpoint.untrusted import NotRegularFile, read_regular
from trainer.config.schema import CheckpointConfig
from trainer.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

RENEWALS_PER_TTL = 4  # the holder renews every lease_seconds / 4
STALE_FRACTION = 0.75  # a holder not renewed for this share of lease_seconds commits nothing
MAX_LEASE_BYTES = 64 << 10  # a lease gentrain writes is ~400 bytes; more is not read
# A lease's own lease_seconds is held to checkpoint.lease_seconds' bounds (one source: the schema).
_BOUNDS = CheckpointConfig.model_fields["lease_seconds"].metadata
MIN_LEASE_SECONDS = float(next(m.ge for m in _BOUNDS if getattr(m, "ge", None) is not None))
MAX_LEASE_SECONDS = float(next(m.le for m in _BOUNDS if getattr(m, "le", None) is not None))


def _exists(fs: AbstractFileSystem, path: str) -> bool:
    try:
        return bool(fs.exists(path))
    except Exception:  # noqa: BLE001 - an unreachable store: treated as existing (never removed)
        return True


class LeaseError(ConfigError):
    """Another trainer holds this run's checkpoint root (exit 2: a restart would meet it again)."""


class LeaseLost(LeaseError):
    """This trainer's lease was taken over: it must never commit to the root again."""


class ForeignLease(LeaseError):
    """Something that is not a file stands where the lease goes (a FIFO, a link, a directory, a device):
    gentrain never wrote it, never opens or follows it, and cannot replace it; a person removes it."""

    def __init__(self, path: str, kind: str):
        self.path, self.kind = path, kind
        super().__init__(
            f"the lease file {path} is {kind}, not a file gentrain writes: gentrain reads a lease as data only "
            "and never follows or opens anything else there, so it cannot tell who holds this checkpoint root. "
            f"If no trainer is using the root, remove it (rm -r '{path}') and run again; nothing else was changed"
        )


class _Conflict(Exception):
    """A conditional write or delete found another version than the one it was made against."""


# ---------------------------------------------------------------------------------------- who holds it


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _process_start(pid: int) -> str:
    """The kernel's start time of `pid` (clock ticks since boot): with the pid, names one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


@dataclass(frozen=True)
class Holder:
    """Who writes a lease: enough for a person to find it, and for a successor to tell it is gone."""

    host: str
    pid: int
    job: str  # TORCHELASTIC_RUN_ID ("local" outside torchrun)
    restart: int  # TORCHELASTIC_RESTART_COUNT
    boot: str = ""  # the host's boot id: a pid names a process only within one boot
    start: str = ""  # the process's start time: a pid can be reused

    @classmethod
    def me(cls, job: str, restart: int) -> Holder:
        return cls(socket.gethostname(), os.getpid(), job, restart, _boot_id(), _process_start(os.getpid()))

    def describe(self, since: str) -> str:
        return f"host {self.host}, pid {self.pid}, job {self.job} (restart {self.restart}), holding it since {since}"

    def gone(self) -> bool:
        """True only for a holder on this host (same boot) whose process no longer exists."""
        me = Holder.me(self.job, self.restart)
        if not self.boot or self.host != me.host or self.boot != me.boot:
            return False
        if os.path.exists("/proc/self/stat"):
            return _process_start(self.pid) != self.start
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def same_job_later_attempt(self, other: Holder) -> bool:
        """`self` is a worker-group restart of the torchrun job `other` belongs to."""
        return self.job not in ("", "local") and self.job == other.job and self.restart > other.restart


@dataclass
class _Doc:
    holder: Holder
    token: str
    since: str
    beat: int
    lease_seconds: float
    run: str = ""

    def to_bytes(self) -> bytes:
        h = self.holder
        return json.dumps(
            {
                "format": 1,
                "token": self.token,
                "host": h.host,
                "pid": h.pid,
                "job": h.job,
                "restart": h.restart,
                "boot": h.boot,
                "start": h.start,
                "run": self.run,
                "since": self.since,
                "beat": self.beat,
                "lease_seconds": self.lease_seconds,
            },
            indent=1,
        ).encode()

    @classmethod
    def parse(cls, raw: bytes) -> _Doc | None:
        """The lease's fields, or None for bytes gentrain did not write (treated as a silent holder). Its
        lease_seconds is held to checkpoint.lease_seconds' bounds: a lease cannot make a contender wait longer
        than a config could."""
        if len(raw) > MAX_LEASE_BYTES:
            return None
        try:
            d = json.loads(raw)
            holder = Holder(
                str(d["host"]), int(d["pid"]), str(d["job"]), int(d["restart"]), str(d["boot"]), str(d["start"])
            )
            seconds = float(d["lease_seconds"])
            if not (math.isfinite(seconds) and seconds > 0):
                return None
            seconds = min(max(seconds, MIN_LEASE_SECONDS), MAX_LEASE_SECONDS)
            return cls(holder, str(d["token"]), str(d["since"]), int(d["beat"]), seconds, str(d.get("run", "")))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None


# ---------------------------------------------------------------------------------------- stores


class _LeaseFile:
    """One small object with compare-and-swap by version; the generic form (no preconditions) reads back."""

    conditional = False

    def __init__(self, fs: AbstractFileSystem, path: str):
        self.fs, self.path = fs, path

    def read(self) -> tuple[bytes, str] | None:
        """(its first MAX_LEASE_BYTES + 1 bytes, its version), None if there is none; ForeignLease if it is
        not an object (a prefix, a directory)."""
        try:
            info = self.fs.info(self.path)
            if info.get("type") != "file":
                raise ForeignLease(self._url(), f"a {info.get('type') or 'non-file'}, not an object")
            data = self.fs.cat_file(self.path, start=0, end=MAX_LEASE_BYTES + 1)
        except FileNotFoundError:
            return None
        return data, hashlib.sha256(data).hexdigest()

    def _url(self) -> str:
        try:
            return self.fs.unstrip_protocol(self.path)
        except Exception:  # noqa: BLE001 - only for a message
            return self.path

    def create(self, data: bytes) -> str:
        if self.read() is not None:
            raise FileExistsError(self.path)
        self.fs.pipe_file(self.path, data)
        return self._confirm(data)

    def replace(self, data: bytes, version: str) -> str:
        cur = self.read()
        if cur is None or cur[1] != version:
            raise _Conflict
        self.fs.pipe_file(self.path, data)
        return self._confirm(data)

    def delete(self, version: str) -> None:
        cur = self.read()
        if cur is not None and cur[1] == version:
            self.fs.rm_file(self.path)

    def _confirm(self, data: bytes) -> str:
        cur = self.read()
        if cur is None or cur[0] != data:
            raise _Conflict
        return cur[1]


class _LocalLeaseFile(_LeaseFile):
    """A local disk: every change under an exclusive flock, files replaced by rename (never seen half)."""

    conditional = True
    lock_seconds = 30.0  # how long a change waits for the folder's lock (the Lease sets its lease_seconds)

    def read(self) -> tuple[bytes, str] | None:
        # As data only (trainer.checkpoint.untrusted): a FIFO, device or link is never opened or waited on.
        try:
            data = read_regular(self.path, MAX_LEASE_BYTES)
        except NotRegularFile as e:
            raise ForeignLease(self.path, e.kind) from None
        return None if data is None else (data, hashlib.sha256(data).hexdigest())

    def _tmp(self, data: bytes) -> str:
        # Written and synced before the lock is taken: the locked section is a read, a compare and a rename.
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = f"{self.path}.tmp-{os.getpid()}-{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    @contextlib.contextmanager
    def _locked(self):
        # The root dir itself is locked: no lock file is left behind. Where a directory cannot be locked
        # (some network file systems) the create stays exclusive (os.link) and a replace is read-compare-write.
        root = os.path.dirname(self.path)
        os.makedirs(root, exist_ok=True)
        fd = os.open(root, os.O_RDONLY)
        try:
            self._lock(fd, root)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _lock(self, fd: int, root: str) -> None:
        # Never a blocking flock: a process stopped while it holds the lock (SIGSTOP, a frozen container, a
        # network file system keeping the lock of a client it lost) would hang this one for good. The lock
        # is held for a read, a compare and a rename, so a wait of a whole lease period means it is stuck.
        deadline = time.monotonic() + self.lock_seconds
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LeaseError(
                        f"the lease of checkpoint root {root} cannot be changed: another process has held its "
                        f"lock (a flock of that folder) for {self.lock_seconds:g}s without releasing it, most "
                        "likely a stopped process of this host (SIGSTOP, a frozen container) or a network file "
                        "system that keeps the lock of a client it lost. Nothing was changed; resume or end "
                        f"that process (`lsof {root}` names it), then run again"
                    ) from None
                time.sleep(0.01)
            except OSError as e:
                log.debug("cannot lock %s (%s): lease writes are read-compare-write there", root, e)
                return

    def create(self, data: bytes) -> str:
        tmp = self._tmp(data)
        try:
            with self._locked():
                os.link(tmp, self.path)  # atomic: fails if the name exists
        finally:
            os.unlink(tmp)
        return hashlib.sha256(data).hexdigest()

    def replace(self, data: bytes, version: str) -> str:
        tmp = self._tmp(data)
        try:
            with self._locked():
                cur = self.read()
                if cur is None or cur[1] != version:
                    raise _Conflict
                os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):  # renamed into place, or left after a conflict
                os.unlink(tmp)
        return hashlib.sha256(data).hexdigest()

    def delete(self, version: str) -> None:
        with self._locked():
            cur = self.read()
            if cur is not None and cur[1] == version:
                os.unlink(self.path)


class _S3LeaseFile(_LeaseFile):
    """S3: PutObject If-None-Match / If-Match and DeleteObject If-Match; the version is the ETag."""

    conditional = True

    def _split(self) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path)
        return bucket, key

    def read(self) -> tuple[bytes, str] | None:
        # ETag first, bytes second: if it changed in between, a write made against this ETag fails (safe).
        try:
            self.fs.invalidate_cache(self.path)
            info = self.fs.info(self.path)
            if info.get("type") != "file" or "ETag" not in info:
                raise ForeignLease(self._url(), "a prefix (a folder), not an object")
            data = self.fs.cat_file(self.path, start=0, end=MAX_LEASE_BYTES + 1)
        except FileNotFoundError:
            return None
        return data, info["ETag"]

    def _put(self, data: bytes, **condition: str) -> str:
        bucket, key = self._split()
        try:
            out = self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **condition)
        except FileNotFoundError:  # If-Match on an object that is gone
            raise _Conflict from None
        except OSError as e:
            if _precondition_failed(e):
                raise _Conflict from None
            raise
        finally:
            self.fs.invalidate_cache(self.path)
        return out["ETag"]

    def create(self, data: bytes) -> str:
        try:
            return self._put(data, IfNoneMatch="*")
        except _Conflict:
            raise FileExistsError(self.path) from None

    def replace(self, data: bytes, version: str) -> str:
        return self._put(data, IfMatch=version)

    def delete(self, version: str) -> None:
        bucket, key = self._split()
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=version)
        except FileNotFoundError:
            pass
        except OSError as e:
            if not _precondition_failed(e):
                raise
        finally:
            self.fs.invalidate_cache(self.path)


def _precondition_failed(e: BaseException) -> bool:
    # s3fs turns 412 PreconditionFailed into FileExistsError (If-None-Match) or OSError(EINVAL), and 409
    # ConditionalRequestConflict (a concurrent conditional write) into another OSError; the text names them.
    text = f"{e!r} {getattr(e, '__cause__', '')!r}"
    return isinstance(e, FileExistsError) or any(
        s in text for s in ("PreconditionFailed", "Precondition", "ConditionalRequestConflict", "412", "409")
    )


class _GCSLeaseFile(_LeaseFile):
    """GCS JSON API with ifGenerationMatch; the version is the object's generation."""

    conditional = True

    def _split(self) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(self.path)
        return bucket, key

    def read(self) -> tuple[bytes, str] | None:
        bucket, key = self._split()
        try:
            meta = self.fs.call("GET", "b/{}/o/{}", bucket, key, json_out=True)
            generation = str(meta["generation"])
            # Only what a lease can hold is fetched: a larger object is unreadable, whatever its size.
            big = (
                {"headers": {"Range": f"bytes=0-{MAX_LEASE_BYTES}"}}
                if int(meta.get("size", 0)) > MAX_LEASE_BYTES
                else {}
            )
            _, data = self.fs.call("GET", "b/{}/o/{}", bucket, key, alt="media", generation=generation, **big)
        except FileNotFoundError:
            return None
        return data, generation

    def _upload(self, data: bytes, generation: str) -> str:
        bucket, key = self._split()
        body = (
            b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n"
            + json.dumps({"name": key}).encode()
            + b"\n--==0==\nContent-Type: application/json\n\n"
            + data
            + b"\n--==0==--"
        )
        try:
            out = self.fs.call(
                "POST",
                f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",  # as gcsfs's simple_upload
                uploadType="multipart",
                headers={"Content-Type": 'multipart/related; boundary="==0=="'},
                data=body,
                json_out=True,
                ifGenerationMatch=generation,
            )
        except (FileExistsError, FileNotFoundError):  # gcsfs: 412 -> FileExistsError
            raise _Conflict from None
        finally:
            self.fs.invalidate_cache(self.path)
        return str(out["generation"])

    def create(self, data: bytes) -> str:
        try:
            version = self._upload(data, "0")
        except _Conflict:
            raise FileExistsError(self.path) from None
        # Read back as well: a GCS-compatible server that ignored the precondition still shows the lost race here.
        return self._confirm_gcs(data, version)

    def replace(self, data: bytes, version: str) -> str:
        # Compared first as well: where a server ignores ifGenerationMatch a stale writer still stops.
        cur = self.read()
        if cur is None or cur[1] != version:
            raise _Conflict
        return self._confirm_gcs(data, self._upload(data, version))

    def _confirm_gcs(self, data: bytes, version: str) -> str:
        cur = self.read()
        if cur is None or cur[0] != data:
            raise _Conflict
        return cur[1]

    def delete(self, version: str) -> None:
        bucket, key = self._split()
        cur = self.read()
        if cur is None or cur[1] != version:
            return
        try:
            self.fs.call("DELETE", "b/{}/o/{}", bucket, key, ifGenerationMatch=version)
        except (FileNotFoundError, FileExistsError):
            pass
        finally:
            self.fs.invalidate_cache(self.path)


def lease_file(fs: AbstractFileSystem, root: str) -> _LeaseFile:
    """The lease object of the root `root` on `fs`, with the strongest conditional writes the store has."""
    path = posixpath.join(root, LEASE_FILE)
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if isinstance(fs, LocalFileSystem):
        return _LocalLeaseFile(fs, path)
    if "s3" in protocols and hasattr(fs, "call_s3"):
        return _S3LeaseFile(fs, path)
    if "gs" in protocols or "gcs" in protocols:
        return _GCSLeaseFile(fs, path)
    return _LeaseFile(fs, path)


# ---------------------------------------------------------------------------------------- the lease


class Lease:
    """The exclusive lease of one trainer (rank 0 of a job) on a checkpoint root."""

    def __init__(
        self, fs: AbstractFileSystem, root: str, url: str, lease_seconds: float, holder: Holder, run: str = ""
    ):
        self.file = lease_file(fs, root)
        if isinstance(self.file, _LocalLeaseFile):  # a lock held past a whole lease period is stuck
            self.file.lock_seconds = float(lease_seconds)
        self.fs, self.root = fs, root
        # A root the lease itself created (a local folder) is removed again when the run leaves nothing in it
        # (a config refused at start-up): a refused run leaves no trace.
        self._root_existed = _exists(fs, root)
        self.url = url
        self.seconds = float(lease_seconds)
        self.me = holder
        self.run = run
        self.token = secrets.token_hex(16)
        self.since = ""
        self.previous_run = ""  # the run the lease this one took over named ("": none, or it named none)
        self._version: str | None = None
        self._beat = 0
        self._renewed_at = 0.0  # monotonic time a renewal that succeeded was sent
        self.lost: str | None = None  # why this trainer lost the lease (set once, never cleared)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return self._version is not None and self.lost is None

    def _doc(self) -> bytes:
        return _Doc(self.me, self.token, self.since, self._beat, self.seconds, self.run).to_bytes()

    # -- taking it
    def acquire(self, poll_seconds: float | None = None) -> None:
        """Take the lease, watching a holder found there; raises LeaseError naming a holder that renews."""
        poll = poll_seconds if poll_seconds is not None else max(0.05, min(1.0, self.seconds / 20))
        self.since = datetime.now(timezone.utc).isoformat(timespec="seconds")
        while True:
            cur = self.file.read()
            if cur is None:
                try:
                    self._took(self.file.create(self._doc()), "took")
                    return
                except FileExistsError:
                    continue  # another contender created it first: look at it
                except _Conflict:
                    raise LeaseError(self._refusal(self.file.read(), "took it at the same moment")) from None
            raw, version = cur
            doc = _Doc.parse(raw)
            if doc is not None and doc.token == self.token:
                self._took(version, "kept")
                return
            if doc is not None and (doc.holder.gone() or self.me.same_job_later_attempt(doc.holder)):
                why = "its process is gone" if doc.holder.gone() else "this is a restart of the same torchrun job"
                if self._take_over(version, doc, why):
                    return
                continue
            watch = max(self.seconds, doc.lease_seconds if doc is not None else self.seconds)
            who = doc.holder.describe(doc.since) if doc is not None else "an unreadable lease"
            log.warning(
                "checkpoint root %s is leased by another trainer (%s); waiting up to %gs for it to lapse",
                self.url,
                who,
                watch,
            )
            deadline = time.monotonic() + watch
            changed = None
            while time.monotonic() < deadline and changed is None:
                time.sleep(poll)
                now = self.file.read()
                if now is None or now[1] != version:
                    changed = now
            if changed is None:  # not renewed for a whole lease period: lapsed
                if self._take_over(version, doc, f"it was not renewed for {watch:g}s"):
                    return
                continue
            if (d := _Doc.parse(changed[0])) is not None:
                raise LeaseError(self._refusal(changed, "renewed it" if doc and d.token == doc.token else "took it"))
            # gone (released) or replaced by bytes nobody can read: look again

    def _take_over(self, version: str, doc: _Doc | None, why: str) -> bool:
        try:
            new = self.file.replace(self._doc(), version)
        except _Conflict:
            return False  # someone else moved first: the caller looks again
        who = doc.holder.describe(doc.since) if doc is not None else "an unreadable lease"
        log.warning("took over the lease on %s from %s: %s", self.url, who, why)
        self.previous_run = doc.run if doc is not None else ""
        self._took(new, "took over")
        return True

    def _refusal(self, cur: tuple[bytes, str] | None, what: str) -> str:
        doc = _Doc.parse(cur[0]) if cur is not None else None
        who = doc.holder.describe(doc.since) if doc is not None else "another trainer"
        return (
            f"checkpoint root {self.url} is in use by another trainer ({who}), which {what}: two trainers "
            "must not write one run. Stop that one first, or give this run its own checkpoint.url "
            "(or name); a holder that is gone without releasing it is taken over after checkpoint.lease_seconds"
        )

    def _took(self, version: str, how: str) -> None:
        self._version = version
        self._renewed_at = time.monotonic()
        log.info("%s the lease on %s (%s, lease_seconds=%g)", how, self.url, self.me.describe(self.since), self.seconds)
        self._thread = threading.Thread(target=self._heartbeat, name="gentrain-lease", daemon=True)
        self._thread.start()

    def name_run(self, run: str) -> None:
        """Record the run this trainer writes in the lease now, not at the next renewal: a crash a moment
        later leaves a lease that names it (a restart ties the memory tier to the root by it)."""
        if run == self.run:
            return
        self.run = run
        self.renew()

    # -- keeping it
    def _heartbeat(self) -> None:
        interval = self.seconds / RENEWALS_PER_TTL
        while not self._stop.wait(interval):
            if not self.renew():
                return

    def renew(self) -> bool:
        """One renewal; False once the lease is lost (then the heartbeat ends)."""
        with self._lock:
            if not self.held:
                return False
            sent = time.monotonic()
            self._beat += 1
            try:
                self._version = self.file.replace(self._doc(), self._version)
                self._renewed_at = sent
                return True
            except _Conflict:
                self._mark_lost(self.file.read())
                return False
            except Exception as e:  # noqa: BLE001 - an outage: retried at the next beat; `check` refuses commits meanwhile
                log.warning("could not renew the lease on %s (retrying): %s", self.url, e)
                return True

    def _mark_lost(self, cur: tuple[bytes, str] | None) -> None:
        doc = _Doc.parse(cur[0]) if cur is not None else None
        if doc is not None and doc.token == self.token:
            return
        who = doc.holder.describe(doc.since) if doc is not None else "nobody holds it now"
        self.lost = (
            f"this trainer lost its lease on {self.url} ({who}): another trainer took the run over while this "
            "one was not renewing it (paused, partitioned or stalled for checkpoint.lease_seconds="
            f"{self.seconds:g}); it stops without committing anything more"
        )
        log.error("%s", self.lost)

    def check(self) -> None:
        """The lease check, before every commit (`CheckpointStore.check_lease`): LeaseLost if another trainer took over, CheckpointError if the lease
        could not be renewed lately (a contender may be taking it over now)."""
        if self.lost is not None:
            raise LeaseLost(self.lost)
        if self._version is None:
            raise LeaseLost(f"this trainer holds no lease on {self.url}")
        try:
            cur = self.file.read()
        except ForeignLease as e:  # replaced by something else: this trainer cannot know it still owns the root
            with self._lock:
                self.lost = f"this trainer lost its lease on {self.url}: {e}"
            log.error("%s", self.lost)
            raise LeaseLost(self.lost) from None
        with self._lock:
            doc = _Doc.parse(cur[0]) if cur is not None else None
            if doc is None or doc.token != self.token:
                self._mark_lost(cur)
                raise LeaseLost(self.lost)
            age = time.monotonic() - self._renewed_at
            if age > STALE_FRACTION * self.seconds:
                raise CheckpointError(
                    f"the lease on {self.url} was last renewed {age:.1f}s ago (checkpoint.lease_seconds="
                    f"{self.seconds:g}): not committing while another trainer may be taking it over"
                )

    # -- giving it back
    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this trainer's (a clean exit, an emergency save)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(1.0, self.seconds))
        with self._lock:
            version, self._version = self._version, None
            if version is None or self.lost is not None:
                return
            try:
                self.file.delete(version)
                log.info("released the lease on %s", self.url)
                if not self._root_existed:
                    with contextlib.suppress(Exception):  # not empty, or a store without folders: kept
                        self.fs.rmdir(self.root)
            except Exception as e:  # noqa: BLE001 - it lapses after lease_seconds anyway
                log.warning("could not release the lease on %s (it lapses after %gs): %s", self.url, self.seconds, e)

    def describe(self) -> dict[str, Any]:
        return {"url": self.url, "holder": self.me.describe(self.since), "lost": self.lost}


def present_holder(fs: AbstractFileSystem, root: str) -> str | None:
    """Who the lease found on `root` names, for a trainer that does not take one (`checkpoint.lease=false`):
    None when there is none, its holder is a process of this host that is gone, or it cannot be read now (an
    outage is reported where it matters, at the first save). Reads it as data only, as a contender does."""
    try:
        cur = lease_file(fs, root).read()
    except ForeignLease as e:
        return f"something that is not a lease ({e.kind} at {e.path})"
    except Exception as e:  # noqa: BLE001 - an unreachable store: nothing to warn about yet
        log.debug("cannot read the lease of %s: %s", root, e)
        return None
    if cur is None:
        return None
    doc = _Doc.parse(cur[0])
    if doc is None:
        return "an unreadable lease (not one gentrain wrote)"
    if doc.holder.gone():
        return None
    return doc.holder.describe(doc.since)
