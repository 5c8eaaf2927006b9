"""`<root>/attempts.json`: the last crashed training attempt's resume point and crash, read and written as data
only.

The policy (when a crash is the third of a loop) is the engine's (trainer.engine.attempts); this module only
moves the record in and out of the store, with the same care as every other file there: anyone who can write
to the bucket can put anything at that name.

- Read: on a local disk it is never followed or opened unless it is a regular file (`lstat`, then `open` with
  `O_NOFOLLOW | O_NONBLOCK`, then `fstat`: a link, FIFO, device or directory swapped in is refused, never
  waited on), on an object store it must be an object; at most `MAX_ATTEMPTS_BYTES` are read and parsed
  against a schema (`trainer.checkpoint.validity.parse_attempts`). Anything else is no record (with the
  reason): the record only ever makes gentrain stop earlier, so ignoring a bad one costs a restart at most.
- Write: whole or not at all (the store's small-file write: a temporary file renamed over it on a local
  disk, one PUT on an object store), by rank 0 only.
"""

from __future__ import annotations

import json

from trainer.checkpoint.layout import ATTEMPTS_FILE
from trainer.checkpoint.store import CheckpointStore
from trainer.checkpoint.untrusted import NotRegularFile, read_regular
from trainer.checkpoint.validity import MAX_ATTEMPTS_BYTES, AttemptsDoc, parse_attempts
from trainer.errors import CheckpointCorrupt


class UnusableRecord(Exception):
    """attempts.json is there but is not a record gentrain wrote (the message says why)."""


def read_attempts(store: CheckpointStore) -> AttemptsDoc | None:
    """The record in `store`'s root, None if there is none; UnusableRecord if something else is there; OSError
    if the store cannot be read."""
    path = store._path(ATTEMPTS_FILE)
    raw = _read_local(path) if store._local else _read_object(store, path)
    if raw is None:
        return None
    try:
        return parse_attempts(raw)
    except CheckpointCorrupt as e:
        raise UnusableRecord(str(e)) from None


def write_attempts(store: CheckpointStore, doc: AttemptsDoc) -> None:
    """Replace the record whole (readers see the old one or the new one); OSError if the store refuses."""
    store._put_small(store._path(ATTEMPTS_FILE), json.dumps(doc.model_dump(), indent=1).encode())


def _read_local(path: str) -> bytes | None:
    try:
        return read_regular(path, MAX_ATTEMPTS_BYTES)
    except NotRegularFile as e:
        raise UnusableRecord(f"{e.path} is {e.kind}: not read") from None


def _read_object(store: CheckpointStore, path: str) -> bytes | None:
    try:
        info = store.fs.info(path)
    except FileNotFoundError:
        return None
    if info.get("type") != "file":
        raise UnusableRecord(f"{path} is a {info.get('type') or 'non-file'}, not an object: not read")
    if int(info.get("size") or 0) > MAX_ATTEMPTS_BYTES:
        raise UnusableRecord(f"{path} is {info.get('size')} bytes, more than gentrain writes: not read")
    try:
        return store.fs.cat_file(path, start=0, end=MAX_ATTEMPTS_BYTES + 1)
    except FileNotFoundError:
        return None
