"""The memory tier: each node keeps the newest snapshots in shared memory, a buddy node keeps a copy.

torchrun restarts only the workers; the pod, and its `/dev/shm`, lives on. So a worker crash loses
nothing if every step's state is also in a folder there, and a node's loss loses nothing if another
node holds a copy of what existed only on the lost one. Per node:

    <checkpoint.memory_dir>/<run key>/          run key: the durable root's name and a hash of its URL
        origin.json                             that durable root (credentials redacted), for people
        reached.json                            {"step": the newest step this node's workers completed,
                                                "stored": the newest step whose snapshot it stored}
        step-000001200/                         the durable layout's file names (trainer.checkpoint.layout)
            <payload files>                     written by this node's ranks, or received from a peer
            piece-rNNNNN.json                   commit point of rank N's piece: its files' sizes and digests
            manifest.json                       only once a resume assembled the whole step on this node

A *piece* is what one rank contributes to a step. Under FSDP it is the rank's slices and RNG state
(rank 0's also holds trainer.json and the replicated tensors), written like a durable sharded save, and
sent to the same local rank of the next node (nodes ordered by their lowest rank, the last one's buddy
is the first) over a gloo group of its own, by the background writer. Under DDP every rank already
holds the whole model and optimizer state, so the whole checkpoint is one piece, rank 0's, and every
node's first rank writes it from its own replica after one all-gather of the ranks' RNG states: nothing
is sent, and any one surviving node holds everything.

Resume: one all-gather of which pieces each node holds, with the durable tier's newest step; every rank
computes the same newest step that is complete somewhere and newer than the durable one; each node
fetches the pieces it lacks from a node that holds them, writes the step's shard index and manifest
(the same commit rule as the durable tier), and the step is loaded and checked like a durable one (a
torn, stale or digest-failing step is skipped, then older ones, then the durable tier).

Links: `checkpoint.memory_dir` is the user's choice and is followed if it is a link; it must belong to
this user (or root), and if others may write in it, carry the sticky bit (as /dev/shm does), or else
another user could swap the run's folder under it. Below it nothing is followed: the run's folder is made
by this process (0o700, this user's; a link or someone else's folder there turns the tier off with a
warning, `make_root`), a step folder or payload file that is a link is never written through (a payload
name is unlinked before it is written, a step folder that is a link fails that snapshot), and deletion
(clearing, retention, a failed snapshot's clean-up) removes links, never what they point to. A snapshot
that fails removes what it created, its step folder too when nothing else is in it.

Why not a library: DLRover's Flash Checkpoint needs its own agent (dlrover-run) in place of torchrun's
and passes its state's metadata between processes pickled; nvidia-resiliency-ext's local checkpoints
are `torch.save` files (pickle) and CUDA-first; torchft heals a replica from a live peer's state over
its own transport, which streams pickled state dicts. Each breaks gentrain's rules (no pickle read
from storage, digests, manifest last, exact data resume), so this module keeps the durable tier's
format and writer and adds only placement, replication and the agreement.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer.checkpoint.layout import MANIFEST, SHARD_INDEX, parse_piece_file, parse_step_dir, piece_file, step_dir_name
from trainer.checkpoint.sharded import index_file_bytes, merge_indexes
from trainer.checkpoint.store import CheckpointError, CheckpointStore, Payload
from trainer.checkpoint.validity import FORMAT_VERSION, PieceDoc, parse_json, parse_piece
from trainer.config.redact import redact
from trainer.elastic import DistEnv, gather_objects, new_gloo_group
from trainer.errors import CheckpointCorrupt

log = logging.getLogger("gentrain")

KEEP = 2  # steps with pieces kept per node: the newest may be incomplete while the one before it is not
_CHUNK = 64 << 20  # bytes per message when a piece travels between nodes
# Test failpoint (docs/development.md): the rank that sends its piece of this step stops after the
# first chunk, so a test can kill its node in the middle of a replication.
FAULT_STALL_REPLICATION = "GENTRAIN_FAULT_STALL_REPLICATION_AT_STEP"
OWNER = "__memory_owner__"  # carried from save() to the writer thread in the meta, never written
INDEX = "__memory_index__"


def run_key(durable_url: str) -> str:
    """The memory tier's folder name for the run checkpointing to `durable_url`: readable and unique."""
    url = durable_url.rstrip("/")
    if "://" not in url:
        url = os.path.abspath(url)
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", posixpath.basename(posixpath.dirname(url)) or "run")[:40]
    return f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:16]}"


def memory_root(memory_dir: str, durable_url: str) -> str:
    return os.path.join(memory_dir, run_key(durable_url))


def make_root(root: str) -> None:
    """Make the run's memory folder `root` (`memory_root`), or raise OSError saying why it cannot be used.

    Its parent, `checkpoint.memory_dir`, may be a link the user made (a link another user made is
    refused); the folder it names must belong to this user or to root, and if others may write in it, it
    must be sticky (/dev/shm is 1777), so nobody else can rename or replace the run's folder. The run's
    folder itself (a predictable name) must be a real directory of this user's: a link or anyone else's
    folder there is refused, never followed, since clearing and retention delete step folders in it."""
    memory_dir = os.path.dirname(root) or "."
    os.makedirs(memory_dir, mode=0o700, exist_ok=True)
    me = os.geteuid()
    if os.path.islink(memory_dir) and os.lstat(memory_dir).st_uid not in (me, 0):
        raise OSError(
            f"checkpoint.memory_dir {memory_dir} is a symbolic link of uid {os.lstat(memory_dir).st_uid}, not "
            "yours: choose a folder of your own"
        )
    st = os.stat(memory_dir)
    if st.st_uid not in (me, 0):
        raise OSError(
            f"checkpoint.memory_dir {memory_dir} belongs to uid {st.st_uid}: choose a folder of your own "
            "(its owner could replace the run's folder in it)"
        )
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise OSError(
            f"checkpoint.memory_dir {memory_dir} is writable by others without the sticky bit (mode "
            f"{stat.S_IMODE(st.st_mode):o}): others could replace the run's folder in it; chmod +t it or "
            "choose another folder"
        )
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as e:
        what = "a symbolic link" if os.path.islink(root) else "not a directory"
        raise OSError(
            f"the memory tier's folder {root} is {what}; it is never followed. Remove it (or choose another "
            f"checkpoint.memory_dir) ({e.strerror})"
        ) from None
    try:
        mine = os.fstat(fd)
        if mine.st_uid != me:
            raise OSError(
                f"the memory tier's folder {root} belongs to uid {mine.st_uid}, not this user; remove it or "
                "choose another checkpoint.memory_dir"
            )
        if stat.S_IMODE(mine.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Topology:
    """Which node each rank runs on (a node: a host and its memory folder), and who backs up whom."""

    node_of: tuple[str, ...]  # per rank

    @functools.cached_property
    def nodes(self) -> list[list[int]]:
        """Ranks per node; nodes in the order of their lowest rank."""
        out: dict[str, list[int]] = {}
        for rank, node in enumerate(self.node_of):
            out.setdefault(node, []).append(rank)
        return sorted(out.values())

    @functools.cached_property
    def _place(self) -> dict[int, tuple[int, int]]:
        """rank -> (its node's index in `nodes`, its index on that node)."""
        return {rank: (i, j) for i, node in enumerate(self.nodes) for j, rank in enumerate(node)}

    def leader(self, rank: int) -> int:
        return self.nodes[self._place[rank][0]][0]

    def buddy(self, rank: int) -> int | None:
        """The rank on the next node that keeps a copy of `rank`'s piece (None: one node, no copy)."""
        if len(self.nodes) < 2:
            return None
        i, j = self._place[rank]
        there = self.nodes[(i + 1) % len(self.nodes)]
        return there[j % len(there)]

    def sources(self, rank: int) -> list[int]:
        """The ranks whose pieces `rank` keeps a copy of (those on the previous node that map onto it)."""
        if len(self.nodes) < 2:
            return []
        i, _ = self._place[rank]
        return [r for r in self.nodes[i - 1] if self.buddy(r) == rank]


class MemoryTier:
    """One node's share of the memory tier: writing pieces, replicating them, and resuming from them."""

    def __init__(self, root: str, env: DistEnv, sharded: bool, timeout_seconds: float, origin: str):
        self.root = root
        self.env, self.sharded = env, sharded
        make_root(root)
        self.store = _MemoryStore(root)
        self.node = f"{socket.gethostname()}:{os.path.realpath(root)}"
        self.topology = Topology(tuple(gather_objects(self.node)))
        self.group = new_gloo_group(timeout_seconds)  # pieces travel here, never on the training group
        self.is_leader = self.topology.leader(env.rank) == env.rank
        self._reached: dict[str, int] = {}  # reached.json as this process last wrote it (mark_reached)
        self._reached_lock = threading.Lock()  # the training thread marks steps, the writer thread snapshots
        if self.is_leader:
            _put(os.path.join(root, "origin.json"), json.dumps({"durable": redact(origin)}).encode())

    @property
    def replicated(self) -> bool:
        return self.sharded and len(self.topology.nodes) > 1

    def describe(self) -> str:
        nodes = self.topology.nodes
        if not self.sharded:
            how = f"every node writes the whole state from its own replica ({len(nodes)} copies)"
        elif len(nodes) > 1:
            how = f"each node's pieces are copied to the next of {len(nodes)} nodes"
        else:
            how = "one node: no copy on another node (a worker crash is covered, a node loss is not)"
        return f"memory tier in {self.root}: {how}"

    # ------------------------------------------------------------------ save (writer thread)

    def mark_reached(self, step: int, stored: bool = False) -> None:
        """Note the newest step this node's workers completed (every step, from the training thread: steps lost
        on a resume are counted from it) or, with `stored`, whose snapshot it stored (from the writer thread,
        once the leader's piece is stored, never before). Two fields, so that after snapshots that failed (a
        full /dev/shm) the file never claims a step the tier does not hold: {"step": 5, "stored": 1}."""
        if not self.is_leader:
            return
        with self._reached_lock:
            key = "stored" if stored else "step"
            self._reached[key] = max(step, self._reached.get(key, step))
            try:
                _put(os.path.join(self.root, "reached.json"), json.dumps(self._reached).encode())
            except OSError as e:
                log.debug("memory tier: cannot note the step reached: %s", e)

    def write(
        self, step: int, files: Mapping[str, Payload], meta: Mapping[str, Any], failed: str | None = None
    ) -> None:
        """Write this rank's piece of `step` (if it has one), then trade pieces with the buddies.

        Under FSDP every rank exchanges, even one whose own write `failed`, so no peer waits for a piece
        that will never come; the error is raised after."""
        meta = dict(meta)
        owner, index = meta.pop(OWNER), meta.pop(INDEX)
        doc, error = None, failed
        if owner is not None and error is None:
            try:
                entries = self.store.write_files(step, files)
                doc = PieceDoc(
                    format_version=FORMAT_VERSION,
                    step=step,
                    owner=owner,
                    world_size=self.env.world_size,
                    sharded=self.sharded,
                    files=entries,
                    index=index or {},
                    meta=meta if owner == 0 else None,
                )
                self._put_piece(step, owner, doc)
                self.mark_reached(step, stored=True)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
                self._remove_files(step, [*files, piece_file(owner)])
        if self.replicated:
            self._trade(step, owner, doc)
        if self.is_leader:
            self._retain()
        if error:
            raise CheckpointError(f"memory snapshot of step {step} failed on rank {self.env.rank}: {error}")

    def _trade(self, step: int, owner: int | None, doc: PieceDoc | None) -> None:
        """Send this rank's piece to its buddy, receive the pieces it keeps copies of (both at once)."""
        to, sources = self.topology.buddy(self.env.rank), self.topology.sources(self.env.rank)
        done = threading.Event()
        errors: list[BaseException] = []

        def receive() -> None:
            try:
                for src in sources:
                    self._receive_piece(step, src)
            except BaseException as e:
                errors.append(e)
            finally:
                done.set()

        receiver = threading.Thread(target=receive, name="gentrain-memory-recv", daemon=True)
        receiver.start()
        try:
            self._send_piece(step, owner if doc is not None else None, to, stall=_stall_at() == step)
        finally:
            done.wait()
        if errors:
            raise errors[0]

    def _send_piece(self, step: int, owner: int | None, to: int, stall: bool = False) -> None:
        """[length of the piece json, or -1: none] [piece json] [each file in <= 64 MB chunks]."""
        if owner is None:
            dist.send(torch.tensor([-1], dtype=torch.int64), to, group=self.group)
            return
        d = self._step_path(step)
        raw = _read(os.path.join(d, piece_file(owner)))
        dist.send(torch.tensor([len(raw)], dtype=torch.int64), to, group=self.group)
        dist.send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), to, group=self.group)
        for name, entry in sorted(parse_piece(raw, step, owner).files.items()):
            n = entry.bytes
            if n == 0:
                continue
            data = torch.from_file(os.path.join(d, name), shared=False, size=n, dtype=torch.uint8)
            for start in range(0, n, _CHUNK):
                dist.send(data[start : start + _CHUNK], to, group=self.group)
                if stall:
                    log.warning(
                        "memory tier: stalling the replication of step %d (%s is set)", step, FAULT_STALL_REPLICATION
                    )
                    threading.Event().wait()

    def _receive_piece(self, step: int, src: int) -> None:
        header = torch.empty(1, dtype=torch.int64)
        dist.recv(header, src, group=self.group)
        n = int(header.item())
        if n < 0:
            return  # the sender had no piece this time (its save failed); it says why itself
        raw = torch.empty(n, dtype=torch.uint8)
        dist.recv(raw, src, group=self.group)
        raw_bytes = raw.numpy().tobytes()
        sent = parse_json(raw_bytes, f"piece sent by rank {src}")
        owner = sent.get("owner") if isinstance(sent, dict) else None
        if not isinstance(owner, int) or owner < 0:
            raise CheckpointCorrupt(f"the piece rank {src} sent names no owner rank")
        doc = parse_piece(raw_bytes, step, owner)
        d = self._step_path(step)
        _real_dir(d)
        for name, entry in sorted(doc.files.items()):
            size = entry.bytes
            path = os.path.join(d, name)
            with _create(path) as f:
                f.truncate(size)
            if size == 0:
                continue
            data = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
            for start in range(0, size, _CHUNK):
                dist.recv(data[start : start + _CHUNK], src, group=self.group)
            del data  # unmapped: the bytes are in the file
        _put(os.path.join(d, piece_file(doc.owner)), raw_bytes)  # last: the copy is complete

    def _put_piece(self, step: int, owner: int, doc: PieceDoc) -> None:
        _put(os.path.join(self._step_path(step), piece_file(owner)), json.dumps(doc.dump()).encode())

    def _remove_files(self, step: int, names: list[str]) -> None:
        """What a failed snapshot wrote (never through a link), and its step folder if nothing else is in it
        (a full /dev/shm must not collect an empty folder per failed snapshot)."""
        d = self._step_path(step)
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            return  # nothing was made there, or it is a link: left alone
        try:
            for name in names:
                try:
                    os.unlink(name, dir_fd=fd)
                except OSError:
                    pass
        finally:
            os.close(fd)
        try:
            os.rmdir(d)  # only if empty: another rank's files or pieces keep it
        except OSError:
            pass

    def _retain(self) -> None:
        """Keep the KEEP newest steps that hold a piece, and anything newer (being written)."""
        held = [s for s in self._steps() if self._owners_here(s)]
        if len(held) < KEEP:
            return
        oldest_kept = sorted(held)[-KEEP]
        for s in self._steps():
            if s < oldest_kept:
                self._remove_step(s)

    # ------------------------------------------------------------------ resume

    def inventory(self) -> dict[int, dict[int, tuple[int, bool]]]:
        """{step: {owner: (world size, sharded)}} of the complete pieces this node holds (files present
        with their sizes; digests are checked when the step is loaded)."""
        return {
            step: {owner: (doc.world_size, doc.sharded) for owner, doc in pieces.items()}
            for step, pieces in scan(self.root).items()
        }

    def read_piece(self, step: int, owner: int) -> PieceDoc:
        return read_piece(self.root, step, owner)

    def reached(self) -> int | None:
        """The newest step this node's workers completed: reached.json's, or a newer step holding a piece here
        (a process killed between storing a piece and noting it)."""
        try:
            step = parse_json(_read(os.path.join(self.root, "reached.json")), "reached.json").get("step")
        except (OSError, CheckpointCorrupt, AttributeError):
            step = None
        noted = step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None
        held = [s for s in self._steps() if self._owners_here(s)]
        return max([*held, *([noted] if noted is not None else [])], default=None)

    def fetch(self, step: int, owner: int, src: int, dst: int) -> None:
        """Collective pair: the node leader `src` sends its copy of a piece, the node leader `dst` keeps it."""
        if self.env.rank == src:
            self._send_piece(step, owner, dst)
        elif self.env.rank == dst:
            self._receive_piece(step, src)

    def commit(self, step: int, owners: list[int]) -> None:
        """Write the step's shard index and manifest from its pieces here (the leader, once all are here)."""
        docs = [self.read_piece(step, owner) for owner in owners]
        entries: dict[str, Any] = {}
        for doc in docs:
            entries.update(doc.entries())
        meta = dict(docs[0].meta or {})
        if docs[0].sharded:
            index = merge_indexes([doc.index_entries() for doc in docs])
            entries.update(self.store.write_files(step, {SHARD_INDEX: index_file_bytes(index, docs[0].world_size)}))
        manifest = os.path.join(self._step_path(step), MANIFEST)
        if os.path.exists(manifest):
            os.unlink(manifest)
        self.store.commit(step, entries, meta)

    def forget_after(self, step: int | None) -> None:
        """Drop every step newer than the one resumed from (the leader): they belong to the timeline the
        failure cut off, and must never mix with pieces of the steps about to be trained again."""
        if self.is_leader:
            for s in self._steps():
                if step is None or s > step:
                    self._remove_step(s)

    def drop(self, step: int) -> None:
        """Forget a step that did not load (the leader)."""
        if self.is_leader:
            self._remove_step(step)

    def clear(self) -> None:
        """Forget every step, and the step reached (a run that does not resume, or another run's snapshots)."""
        self.forget_after(None)
        if self.is_leader:
            with self._reached_lock:
                self._reached.clear()
            try:
                os.unlink(os.path.join(self.root, "reached.json"))
            except FileNotFoundError:
                pass
            except OSError as e:
                log.debug("memory tier: cannot remove reached.json: %s", e)

    # ------------------------------------------------------------------ files

    def _step_path(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    def _steps(self) -> list[int]:
        return _steps(self.root)

    def _owners_here(self, step: int) -> list[int]:
        return _owners(self.root, step)

    def _remove_step(self, step: int) -> None:
        """Delete a step folder: a link in its place goes, never what it points to."""
        d = self._step_path(step)
        if os.path.islink(d):
            os.unlink(d)
            return
        # Manifest and pieces first: a half-deleted step must look incomplete, never whole.
        for name in [MANIFEST, *(piece_file(o) for o in self._owners_here(step))]:
            try:
                os.unlink(os.path.join(d, name))
            except OSError:
                pass
        shutil.rmtree(d, ignore_errors=True)


class _MemoryStore(CheckpointStore):
    """The durable store's commit, discovery and checks over one node's memory folder. A commit here is a
    resume assembling a step, and must not delete the older steps the resume may still fall back to:
    `MemoryTier` keeps and drops steps itself."""

    def apply_retention(self) -> list[int]:
        return []

    def write_files(self, step: int, files: Mapping[str, Payload]) -> dict[str, dict[str, Any]]:
        """The durable writer's, into a step folder that is a real directory (never through a link), with
        any entry already named like a payload file (a link, a stale file) unlinked first."""
        d = self._path(step_dir_name(step))
        _real_dir(d)
        for name in files:
            _unlink_entry(os.path.join(d, name))
        return super().write_files(step, files)


def scan(root: str) -> dict[int, dict[int, PieceDoc]]:
    """{step: {owner: piece}} of the complete pieces in one node's memory folder, oldest step first; a
    piece that does not parse or whose files are missing or of the wrong size is skipped with a warning."""
    out: dict[int, dict[int, PieceDoc]] = {}
    if os.path.islink(root):
        log.warning("memory tier %s is a symbolic link; it is never followed", root)
        return out
    for step in _steps(root):
        for owner in _owners(root, step):
            try:
                out.setdefault(step, {})[owner] = read_piece(root, step, owner)
            except CheckpointCorrupt as e:
                log.warning("memory tier %s: skipping a piece: %s", os.path.join(root, step_dir_name(step)), e)
    return out


def read_piece(root: str, step: int, owner: int) -> PieceDoc:
    d = os.path.join(root, step_dir_name(step))
    if os.path.islink(d):
        raise CheckpointCorrupt(f"{d} is a symbolic link (the memory tier never follows links)")
    try:
        doc = parse_piece(_read(os.path.join(d, piece_file(owner))), step, owner)
    except OSError as e:
        raise CheckpointCorrupt(f"piece of rank {owner} cannot be read ({e})") from e
    for name, entry in doc.files.items():
        path = os.path.join(d, name)
        if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) != entry.bytes:
            raise CheckpointCorrupt(f"{name} of rank {owner}'s piece is missing or has the wrong size")
    return doc


def _steps(root: str) -> list[int]:
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(s for n in names if (s := parse_step_dir(n)) is not None)


def _owners(root: str, step: int) -> list[int]:
    d = os.path.join(root, step_dir_name(step))
    if os.path.islink(d) or not os.path.isdir(d):
        return []
    try:
        names = os.listdir(d)
    except OSError:
        return []
    return sorted(o for n in names if (o := parse_piece_file(n)) is not None)


def _stall_at() -> int | None:
    value = os.environ.get(FAULT_STALL_REPLICATION)
    return int(value) if value and value.isdigit() else None


def _read(path: str) -> bytes:
    """A file's bytes; OSError (ELOOP) if it is a link."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        return f.read()


def _put(path: str, data: bytes) -> None:
    """Readers see the old content or the new, never half (rename over it; a link there is replaced)."""
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with _create(tmp) as f:
        f.write(data)
    os.replace(tmp, path)


def _create(path: str):
    """A new file at `path`, open for writing: whatever had the name (a link, a stale file) is unlinked
    first, and the open neither follows a link nor reuses a file."""
    _unlink_entry(path)
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb")


def _unlink_entry(path: str) -> None:
    """Remove a link or file at `path` (not what a link points to); a directory there is left alone."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _real_dir(path: str) -> None:
    """Make the step folder `path` if it is missing; OSError if a link or anything but a directory is there."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise OSError(f"{path} is {kind}; the memory tier never writes through it")


@dataclass(frozen=True)
class Plan:
    """What the ranks agreed on at start: memory steps to try, newest first, and who holds which piece."""

    candidates: list[int]
    holders: dict[int, dict[int, list[int]]]  # step -> owner -> node leaders holding it
    owners: dict[int, list[int]]  # step -> owners it needs
    reached: int | None  # the newest step any node completed before the restart


def agree(
    reports: list[tuple[dict[int, dict[int, tuple[int, bool]]] | None, int | None, int | None]], durable: int | None
) -> Plan:
    """Every rank computes the same plan from everyone's (inventory or None, reached or None, rank)."""
    holders: dict[int, dict[int, list[int]]] = {}
    shapes: dict[int, set[tuple[int, bool]]] = {}
    reached = None
    for inventory, seen, rank in reports:
        if seen is not None:
            reached = seen if reached is None else max(reached, seen)
        for step, pieces in (inventory or {}).items():
            for owner, shape in pieces.items():
                holders.setdefault(step, {}).setdefault(owner, []).append(rank)
                shapes.setdefault(step, set()).add(tuple(shape))
    candidates, owners = [], {}
    for step in sorted(holders, reverse=True):
        if durable is not None and step <= durable:
            break
        if len(shapes[step]) != 1:
            log.warning("memory tier: step %d has pieces of different world sizes; skipping it", step)
            continue
        world_size, sharded = next(iter(shapes[step]))
        needed = list(range(world_size)) if sharded else [0]
        missing = [o for o in needed if o not in holders[step]]
        if missing:
            log.info("memory tier: step %d is incomplete (no node holds the pieces of ranks %s)", step, missing)
            continue
        candidates.append(step)
        owners[step] = needed
    return Plan(candidates, holders, owners, reached)
