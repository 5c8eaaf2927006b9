"""The run's compile cache (`train.compile` with `GENTRAIN_COMPILE_CACHE_KEY`, issue 49): a restarted or
replacement worker starts from what an earlier worker of the run compiled instead of compiling again.

What is kept: the whole local inductor cache folder (`TORCHINDUCTOR_CACHE_DIR`: inductor's FX-graph and
AOTAutograd entries *and* the kernels they compiled, the C++ shared objects on a CPU, the Triton binaries on a
GPU) packed as one tar beside the checkpoints, `<root>/compile-cache/<identity>.tar` with its `.json`. Not
`torch.compiler.save_cache_artifacts`: measured here (CPU, torch 2.13, a two-layer MLP), a worker that hot-loaded
those artifacts into an empty cache compiled for 15.4 s against 15.8 s cold (the artifacts hold the graphs'
code, not the compiled kernels, which on a CPU are the compile), while the same worker with the first one's
folder compiled in 3.5 s.

The identity is what makes a cache usable at all: torch's version, Python's, the device kind (a GPU's name and
compute capability; a CPU's vector ISA, `torch.backends.cpu.get_cpu_capability()`, which inductor's C++ kernels
are built for) and a digest of the compiled model's configuration. A worker restores only a cache of its own
identity, and only into an empty local folder; inductor then looks its graphs up by its own keys, so an entry
that does not fit a graph is a miss, never a wrong result (results are bit-identical with and without the
cache: tests/test_compile_cache.py).

**Compiled artifacts are code** (shared objects loaded into the process), so "nothing from storage runs code"
needs a key the store never sees: the archive's HMAC-SHA256 under `GENTRAIN_COMPILE_CACHE_KEY` (from a
Kubernetes Secret, say) is checked before a byte of it is unpacked; an unsigned, tampered or foreign archive is
ignored with a warning and the worker compiles as without one. Without the key nothing is saved or restored: the
cache stays node-local, as torch keeps it. Whoever holds the key can make workers run code; whoever can only
write the store cannot (docs/contract.md, "The compile cache").

Unpacking takes regular files and folders only, under the cache folder (tarfile's `data` filter: no links, no
device files, no absolute or `..` paths); the archive and its JSON are size-capped before they are read.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import os
import platform
import posixpath
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("gentrain")

KEY_ENV = "GENTRAIN_COMPILE_CACHE_KEY"
FOLDER = "compile-cache"
_MAX_ARCHIVE = 2 << 30  # an inductor cache of a large model's blocks is tens of MB; past 2 GiB it is not one
_MAX_JSON = 64 << 10


def cache_key() -> bytes | None:
    """The HMAC key from the environment (None: the cache stays node-local)."""
    value = os.environ.get(KEY_ENV, "")
    return value.encode() if value else None


def local_folder() -> Path:
    """Inductor's cache folder in this process: `TORCHINDUCTOR_CACHE_DIR`, else torch's default (private:
    `torch._inductor.runtime.cache_dir_utils.cache_dir`, guarded by tests/test_private_apis.py)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def identity(device: torch.device, model: Mapping[str, Any]) -> dict[str, str]:
    """What a cache must match to be used: torch, Python, the device kind and the compiled model's config."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        kind = f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}"
    else:
        kind = f"{device.type}:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"
    blob = json.dumps(model, sort_keys=True, default=str).encode()
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": kind,
        "model": hashlib.sha256(blob).hexdigest(),
    }


def archive_name(ident: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(ident), sort_keys=True).encode()).hexdigest()[:24]


def _signature(key: bytes, ident: Mapping[str, str], archive_digest: str, size: int) -> str:
    message = json.dumps({"identity": dict(ident), "sha256": archive_digest, "bytes": size}, sort_keys=True)
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def _pack(folder: Path) -> bytes:
    """The cache folder as a tar of its regular files (links, sockets and lock files left out)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink() or not path.is_file() or path.suffix == ".lock":
                continue
            tar.add(path, arcname=str(path.relative_to(folder)), recursive=False)
    return buffer.getvalue()


def is_empty(folder: Path) -> bool:
    return not folder.is_dir() or not any(p.is_file() for p in folder.rglob("*") if not p.name.endswith(".lock"))


def save(fs, root: str, ident: Mapping[str, str], key: bytes, folder: Path) -> str | None:
    """Pack, sign and write the cache folder to `root/compile-cache/` unless an archive of this identity is
    there already; the URL written, or None. Store errors are the caller's (a failed save costs a later worker
    its compile time, nothing else)."""
    base = posixpath.join(root.rstrip("/"), FOLDER, archive_name(ident))
    if fs.exists(base + ".json"):
        return None
    data = _pack(folder)
    digest = hashlib.sha256(data).hexdigest()
    meta = {
        "identity": dict(ident),
        "sha256": digest,
        "bytes": len(data),
        "hmac": _signature(key, ident, digest, len(data)),
    }
    fs.makedirs(posixpath.dirname(base), exist_ok=True)
    fs.pipe_file(base + ".tar", data)
    fs.pipe_file(base + ".json", json.dumps(meta, indent=1).encode())  # last: a reader needs both
    return base + ".tar"


def restore(fs, root: str, ident: Mapping[str, str], key: bytes, folder: Path) -> tuple[bool, str]:
    """(restored, why): unpack this identity's archive into the empty `folder` after checking its HMAC."""
    base = posixpath.join(root.rstrip("/"), FOLDER, archive_name(ident))
    try:
        if not fs.exists(base + ".json"):
            return False, "none saved for this torch, device and model yet"
        if int(fs.info(base + ".json").get("size") or 0) > _MAX_JSON:
            return False, f"{base}.json is over {_MAX_JSON} bytes"
        meta = json.loads(fs.cat_file(base + ".json"))
        size = int(meta["bytes"])
        if not 0 < size <= _MAX_ARCHIVE or int(fs.info(base + ".tar").get("size") or 0) != size:
            return False, f"{base}.tar is not the size its JSON records"
        if meta.get("identity") != dict(ident):
            return False, "its identity is another torch, device or model's"
        expected = _signature(key, ident, str(meta["sha256"]), size)
        if not hmac.compare_digest(expected, str(meta.get("hmac", ""))):
            return False, f"its signature does not match {KEY_ENV} (tampered, or signed with another key)"
        data = fs.cat_file(base + ".tar")
    except (OSError, ValueError, KeyError, TypeError) as e:
        return False, f"unreadable ({type(e).__name__}: {e})"
    # The bytes read are the bytes signed: the digest is checked on what was read, not on the store's word.
    if len(data) != size or not hmac.compare_digest(hashlib.sha256(data).hexdigest(), str(meta["sha256"])):
        return False, "its bytes do not match its signed digest (tampered or torn)"
    folder.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        for member in members:  # all checked before any is written: a refused archive leaves the folder empty
            tarfile.data_filter(member, str(folder))
        tar.extractall(folder, members=members, filter="data")
    return True, f"{len(members)} files from {base}.tar"


class RunCompileCache:
    """A run's side of it: restore before the first compile (a node's local rank 0, into an empty folder),
    save once after the first compiled step (rank 0), each logged. Built only with `train.compile` and the
    key set; a store error while saving or restoring is a warning: the run compiles as without a cache."""

    def __init__(self, fs, root: str, ident: Mapping[str, str], key: bytes, folder: Path):
        self.fs, self.root, self.ident, self.key, self.folder = fs, root, dict(ident), key, folder
        self.restored = False

    @classmethod
    def for_run(cls, fs, root: str, device: torch.device, model: Mapping[str, Any]) -> RunCompileCache | None:
        key = cache_key()
        if key is None:
            log.info("compile cache: node-local (set %s to share compiled kernels through the store)", KEY_ENV)
            return None
        return cls(fs, root, identity(device, model), key, local_folder())

    def restore_if_empty(self) -> None:
        if not is_empty(self.folder):
            log.info("compile cache: %s already holds compiled artifacts; the store's copy is not needed", self.folder)
            return
        try:
            self.restored, why = restore(self.fs, self.root, self.ident, self.key, self.folder)
        except (OSError, tarfile.TarError) as e:
            self.restored, why = False, f"unreadable ({type(e).__name__}: {e})"
        if self.restored:
            log.info("compile cache: restored %s into %s", why, self.folder)
        elif why.startswith("none saved"):
            log.info("compile cache: %s; this worker compiles and saves it", why)
        else:
            log.warning("compile cache: ignored the store's copy: %s; compiling as without it", why)

    def save_once(self) -> None:
        if self.restored:
            return
        try:
            url = save(self.fs, self.root, self.ident, self.key, self.folder)
        except (OSError, tarfile.TarError) as e:
            log.warning("compile cache: not saved (%s: %s); a later worker compiles again", type(e).__name__, e)
            return
        if url is not None:
            log.info("compile cache: saved %s (signed with %s)", url, KEY_ENV)
