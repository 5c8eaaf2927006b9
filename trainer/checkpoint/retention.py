"""CheckpointRetention: which old checkpoints of a root go after a commit, and how a step dir is removed.

Only valid checkpoints count towards `keep` (newest first) and milestones (`keep_every_steps`); the
newest valid one is never deleted, and debris older than it (invalid or uncommitted step dirs) goes too.
A step dir is removed manifest first, so a half-deleted checkpoint looks uncommitted, never valid; a link
named like a step dir loses only the link. A training run prunes on a helper thread after each commit
(`prune_in_background`); `wait_pruned` joins it before the next commit's retention.

It is the middle of the store's three parts: it reads through `CheckpointReader` and is extended by
`CheckpointStore` (store.py), which commits and calls `_retain_after_commit`.
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from trainer.checkpoint.layout import MANIFEST, step_dir_name
from trainer.checkpoint.reader import CheckpointReader
from trainer.errors import CheckpointError

log = logging.getLogger(__name__)


class CheckpointRetention(CheckpointReader):
    """Prunes the checkpoints of one root after a commit: the `keep` newest valid ones and milestones stay."""

    def __init__(
        self, url: str, storage_options: Mapping[str, Any] | None = None, keep: int = 3, keep_every_steps: int = 0
    ):
        super().__init__(url, storage_options)
        self.keep = keep
        self.keep_every_steps = keep_every_steps
        # Training runs set this: old checkpoints are then deleted on a helper thread after the
        # commit (deleting a GB-sized checkpoint took 0.2-0.3 s here, a quarter of a sync save).
        self.prune_in_background = False
        self._pruner: ThreadPoolExecutor | None = None
        self._pruning: Future | None = None

    def _remove_step(self, step: int, committed: bool) -> None:
        """Remove one step dir (`committed`: its manifest first), or only the link if it is one."""
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

    def _retain_after_commit(self) -> list[int]:
        """Retention after a commit: now (the steps deleted), or on the helper thread (none yet)."""
        if not self.prune_in_background:
            return self.apply_retention()
        if self._pruner is None:
            self._pruner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gentrain-prune")
        self._pruning = self._pruner.submit(self._prune_logged)
        return []

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
