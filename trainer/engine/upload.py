"""`log.upload_run_dir`: run.dir (log files, previews, tracker files) copied beside the checkpoints.

A pod's local disk goes with the pod; the checkpoints are on durable storage. Rank 0 copies the files of
run.dir that are new or changed since its last copy (by size and modification time) to
`<checkpoint.url>/run/`, in a background thread after each checkpoint and once more at the end, so the
curves (TensorBoard event files, W&B offline runs), the sample grids and the ledger outlive the pod. The
checkpoint store lists only `step-*` folders and LATEST: the `run/` folder beside them is not a
checkpoint. A failed copy is a warning; the next one tries again.
"""

from __future__ import annotations

import logging
import os
import posixpath
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainer.storage import filesystem

if TYPE_CHECKING:
    from trainer.config import Config

log = logging.getLogger("gentrain")

FOLDER = "run"


def run_dir_uploader(cfg: Config) -> RunDirUploader | None:
    """The uploader `log.upload_run_dir` asks for; None when off, or when the checkpoints are in run.dir."""
    if not cfg.log.upload_run_dir:
        return None
    uploader = RunDirUploader(cfg.run_dir, cfg.checkpoint_url, cfg.checkpoint.storage_options)
    if uploader.skip and uploader.skip.startswith(uploader.run_dir + os.sep):
        log.info("log.upload_run_dir: the checkpoints are inside run.dir (%s); nothing to copy", uploader.skip)
        return None
    return uploader


class RunDirUploader:
    def __init__(self, run_dir: str, checkpoint_url: str, storage_options: Mapping[str, Any] | None = None):
        self.run_dir = os.path.abspath(run_dir)
        self.fs, root = filesystem(checkpoint_url, storage_options)
        self.root = root.rstrip("/")
        self.dest = posixpath.join(self.root, FOLDER)
        # A local checkpoint folder inside run.dir is not copied into itself.
        local = fsspec_local_path(self.fs, self.root)
        self.skip = os.path.abspath(local) if local else None
        self.copied: dict[str, tuple[int, int]] = {}
        self._thread: threading.Thread | None = None

    def sync(self) -> int:
        """Copy what is new or changed; the number of files copied."""
        n = 0
        for local in self._files():
            st = os.stat(local)
            stamp = (st.st_size, st.st_mtime_ns)
            if self.copied.get(local) == stamp:
                continue
            rel = os.path.relpath(local, self.run_dir).replace(os.sep, "/")
            remote = posixpath.join(self.dest, rel)
            try:
                self.fs.makedirs(posixpath.dirname(remote), exist_ok=True)
                self.fs.put_file(local, remote)
            except FileNotFoundError:  # deleted while walking (a tracker's temporary file)
                continue
            self.copied[local] = stamp
            n += 1
        return n

    def _files(self) -> list[str]:
        out = []
        for folder, dirs, names in os.walk(self.run_dir):
            if self.skip and os.path.abspath(folder) == self.skip:
                dirs[:] = []
                continue
            dirs[:] = [d for d in dirs if not (self.skip and os.path.join(os.path.abspath(folder), d) == self.skip)]
            out += [os.path.join(folder, name) for name in sorted(names)]
        return out

    def sync_in_background(self) -> None:
        """Start a copy unless one is still running (the next checkpoint's call catches up)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._guarded, name="gentrain-upload", daemon=True)
        self._thread.start()

    def _guarded(self) -> None:
        try:
            self.sync()
        except Exception as e:  # storage outage: training goes on, the next call retries
            log.warning("copying run.dir to %s failed: %r", self.dest, e)

    def close(self, timeout: float = 20.0) -> None:
        """The last copy, waited for at most `timeout` seconds (a preempted pod has little time left)."""
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self.sync_in_background()
            self._thread.join(timeout)


def fsspec_local_path(fs: Any, path: str) -> str | None:
    """`path` on the local disk when `fs` is the local filesystem, else None."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else None
