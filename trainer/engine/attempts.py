"""Attempts: a deterministic crash after a resume ends in exit 2 instead of an endless restart.

torchrun and Kubernetes restart a worker that exits 1, and gentrain resumes exactly, so a crash that follows
from the checkpoint (a bad sample at step 1203, a preview setting, an out-of-memory step, a bug) happens again
at every restart, forever, each time retraining the steps since the checkpoint. So a training process (an
attempt) that crashes records in the run's store (`<checkpoint.url>/attempts.json`,
trainer.checkpoint.attempts) where it resumed from, where the next attempt will resume from, and the crash's
signature: the exception type and the innermost frame in gentrain's own code (`trainer/engine/step.py:170`;
stable across restarts, unlike a message with addresses or values in it). The third crash in a row with the
same signature, each attempt resuming from where the one before it stopped with nothing saved in between,
exits 2 (`CrashLoop`) with the error and what to do; the orchestrators do not restart exit 2
(docs/contract.md, "Exit codes"). A run that never crashes leaves no record.

The rules, and why:

- Counted: any exception out of the training loop after the resume except the ones that already end the run
  (`ConfigError` and its kinds: exit 2) and a stop (SIGTERM: exit 143). A crash before the resume (building
  the model, reading the checkpoint) has no resume point yet and is not counted.
- "Nothing saved in between": each crash records the step the next attempt should resume from, the newest
  step this process saved (durable or memory tier) or else the one it resumed from. The next attempt keeps
  the count only if it resumed from exactly that step (of the same run); a crash that follows a new save
  starts the count again at 1. A save that failed, or a memory tier lost with its node, makes the next
  attempt resume elsewhere: the count starts again, so the rule errs towards one restart more, never towards
  stopping a run that makes progress.
- Only rank 0 reads and writes the record (the other ranks get its count by broadcast, at the resume): a crash
  every rank has (a replicated step, a collective preview) exits 2 on every rank. A crash of another
  rank alone is not counted: torchrun's agent stops rank 0 (exit 143) before it can record anything.
- The record is advisory: one the store cannot give or take (unreadable, not a regular file, not JSON of its
  schema, a store that refuses writes) is ignored with a warning, and the crash ends as it would have (exit 1).
- An error message can hold a URL or a value of the config: it is redacted (trainer.config.redact) and cut to
  500 characters before it is written.
"""

from __future__ import annotations

import logging
import os
import socket
import traceback
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

import trainer
from trainer.checkpoint.attempts import UnusableRecord, read_attempts, write_attempts
from trainer.checkpoint.store import CheckpointStore
from trainer.checkpoint.validity import AttemptsDoc, CrashRecord
from trainer.config.redact import REDACTED, redact_text
from trainer.elastic import DistEnv, StopRequested, broadcast_object
from trainer.errors import ConfigError, CrashLoop

log = logging.getLogger("gentrain")

LOOP_AFTER = 3  # the third identical crash in a row exits 2
_PACKAGE = os.path.dirname(os.path.abspath(trainer.__file__))
_MAX_ERROR = 500


def error_signature(error: BaseException) -> str:
    """`<exception type> at <file>:<line>` of the innermost frame of `error`'s traceback in gentrain's own code
    (`trainer/...`), or of the innermost frame at all when none is (a task outside gentrain raised it before
    gentrain called anything). Messages are left out: they may hold addresses, sizes or times."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if os.path.abspath(f.filename).startswith(_PACKAGE + os.sep)]
    kind = type(error).__qualname__
    if type(error).__module__ not in ("builtins", "__main__"):
        kind = f"{type(error).__module__}.{kind}"
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return kind
    path = os.path.abspath(frame.filename)
    where = os.path.join("trainer", os.path.relpath(path, _PACKAGE)) if ours else os.path.basename(path)
    return f"{kind} at {where}:{frame.lineno}"


def _one_line(error: BaseException, secrets: Iterable[str]) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    text = redact_text(text)
    for s in sorted(secrets, key=len, reverse=True):
        text = text.replace(s, REDACTED)
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class Attempts:
    """This process's entry in the run's attempt record: `start` after the resume, `crashed` when the training
    loop raises. Collective in `start` only (one broadcast); `crashed` is local to each rank."""

    def __init__(self, store: CheckpointStore, env: DistEnv, secrets: Iterable[str] = ()):
        self.store = store
        self.env = env
        self.secrets = set(secrets)
        self.started = False
        self.resume_step: int | None = None  # the step this attempt resumed from (None: a fresh start)
        self.run: str | None = None
        self.streak: CrashRecord | None = None  # the previous crashes this attempt continues, if any
        self.attempt: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return f"{self.store.url}/attempts.json"

    def start(self, resume_step: int | None, run: str) -> None:
        """Collective, after the resume: rank 0 reads the record and keeps its crash if the attempt that crashed
        left the run where this one resumed; every rank learns the crash kept. Nothing is written unless this
        attempt crashes too (a run that never crashes leaves no record)."""
        self.started, self.resume_step, self.run = True, resume_step, run
        self.attempt = {
            "resume_step": resume_step,
            "run": run,
            "job": self.env.run_id,
            "restart": self.env.restart_count,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_utc": _now(),
        }
        streak = None
        if self.env.is_main:
            previous = self._read()
            crash = previous.crash if previous else None
            if crash is not None and crash.resume_step == resume_step and (resume_step is None or crash.run == run):
                streak = crash
        self.streak = broadcast_object(streak) if self.env.world_size > 1 else streak

    def crashed(self, error: BaseException, step: int, saved_step: int | None) -> CrashLoop | None:
        """This process is about to exit with `error` (raised after `step` training steps; `saved_step`: the newest
        step it saved, durable or memory tier, None if none). Rank 0 records the crash; every rank returns the
        `CrashLoop` to raise instead when it is the `LOOP_AFTER`th in a row, else None (not a crash that
        counts, or not yet a loop)."""
        if not self.started or isinstance(error, ConfigError | StopRequested) or not isinstance(error, Exception):
            return None
        signature = error_signature(error)
        message = _one_line(error, self.secrets)
        known = [s for s in (saved_step, self.resume_step) if s is not None]
        next_resume = max(known) if known else None
        progressed = next_resume != self.resume_step
        streak = self.streak
        same = streak is not None and streak.signature == signature and not progressed
        count = streak.count + 1 if same and streak is not None else 1
        crash = CrashRecord(
            signature=signature,
            error=message,
            step=step,
            resume_step=next_resume,
            run=self.run,
            count=count,
            time_utc=_now(),
        )
        if self.env.is_main:
            self._write(crash)
            log.error(
                "crash %d of %d in a row from %s (%s, after step %d); recorded in %s",
                count,
                LOOP_AFTER,
                _where(next_resume),
                signature,
                step,
                self.url,
            )
        if count < LOOP_AFTER:
            return None
        return CrashLoop(
            f"this run crashed {count} times in a row with the same error at the same place, each time from the "
            f"state of {_where(next_resume)} with no new checkpoint in between: {message} ({signature}, after "
            f"step {step}). Restarting would crash the same way, so gentrain exits 2 and is not restarted. Fix "
            "the cause (the traceback above: the data, the config or the code at that place), then start the run "
            f"again: it resumes from {_where(next_resume)}, and a crash after a new checkpoint counts from 1 "
            f"again. The record is {self.url}"
        )

    # ---------------------------------------------------------------- the record

    def _read(self) -> AttemptsDoc | None:
        try:
            return read_attempts(self.store)
        except UnusableRecord as e:
            log.warning("attempts record %s ignored: %s", self.url, e)
        except OSError as e:
            log.warning("attempts record %s could not be read (%s): crashes are not counted", self.url, e)
        return None

    def _write(self, crash: CrashRecord) -> None:
        try:
            write_attempts(self.store, AttemptsDoc(format_version=1, attempt=self.attempt, crash=crash))
        except OSError as e:
            log.warning("attempts record %s could not be written (%s): crashes are not counted", self.url, e)


def _where(step: int | None) -> str:
    return f"step {step}" if step is not None else "a fresh start"
