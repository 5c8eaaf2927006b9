"""Opening fsspec stores: one place that turns "this protocol's package is not installed" into a config error,
and one that refuses, before any work, a local output folder or file that cannot be made.

fsspec imports a protocol's implementation (s3fs, gcsfs, adlfs, ...) only when a URL first uses it, and
raises ImportError then. Left alone that is a traceback in the middle of a run (exit 1, which torchrun
and Kubernetes retry forever); it is a setup mistake the user fixes with an extra, so it exits 2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.registry import known_implementations

from trainer.errors import ConfigError

# Protocol -> the gentrain extra that installs its fsspec implementation.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path) for `url`, like fsspec.core.url_to_fs; a missing protocol package is a ConfigError."""
    try:
        return fsspec.core.url_to_fs(url, **dict(storage_options or {}))
    except ImportError as e:
        raise ConfigError(_missing(url, e)) from None


def check_protocol(url: str) -> None:
    """Refuse (exit 2) a URL whose protocol's package is not installed, before anything is opened."""
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        raise ConfigError(_missing(url, e)) from None
    except ValueError:
        raise ConfigError(f"{url}: unknown storage protocol {protocol!r} (fsspec knows none by that name)") from None


def _missing(url: str, error: ImportError) -> str:
    protocol = fsspec.core.split_protocol(url)[0] or "file"
    extra = EXTRAS.get(protocol)
    module = known_implementations.get(protocol, {}).get("class", "").split(".")[0]
    fix = f"pip install 'gentrain[{extra}]'" if extra else f"pip install {module or 'the package for ' + protocol}"
    return f"{url}: {protocol}:// needs a package that is not installed ({error}); {fix}"


def _local_path(url: str) -> str | None:
    """The local path of `url` (a plain path or file://), else None: only a local folder can be checked
    without a round trip, and an object store has no folders that a file could stand in the way of."""
    protocol, path = fsspec.core.split_protocol(url)
    if protocol not in (None, "file", "local"):
        return None
    return os.path.abspath(os.path.expanduser(path))


def _blocker(path: str) -> tuple[str, str] | None:
    """(the path that stops a folder being made at `path`, why), or None when `path` is or can be a folder."""
    probe = path
    while True:
        if os.path.isdir(probe):  # follows links: a link to a folder is a folder
            if not os.access(probe, os.W_OK | os.X_OK):
                return probe, "is a folder this user cannot write in"
            return None
        if os.path.lexists(probe):
            if os.path.islink(probe):
                target = os.readlink(probe)
                return probe, f"is a symbolic link to {target!r}, which is not a folder"
            return probe, "is a file, not a folder"
        parent = os.path.dirname(probe)
        if parent == probe:
            return None
        probe = parent


def check_output_folder(url: str, what: str, fix: str) -> None:
    """Refuse (ConfigError, exit 2) a local output folder that cannot be made: `url` or a folder above it is
    a file or a dangling link. `what` names the setting (`checkpoint.url='/x'`), `fix` says what to do.

    Run before any work, so a run never trains for hours to fail at its first save. Remote URLs pass
    unchecked (writing there is the store's to refuse, and that is reported where it happens)."""
    path = _local_path(url)
    if path is None:
        return
    blocked = _blocker(path)
    if blocked is None:
        return
    where, why = blocked
    raise ConfigError(f"{what} cannot be made a folder: {where} {why}; {fix}")


def check_output_file(path: str, what: str, fix: str) -> None:
    """Refuse (ConfigError, exit 2) a local output file that cannot be written: a folder by that name, or
    a parent that cannot be a folder."""
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full):
        raise ConfigError(f"{what} is a folder, not a file name; {fix}")
    blocked = _blocker(os.path.dirname(full))
    if blocked is not None:
        where, why = blocked
        raise ConfigError(f"{what} cannot be written: {where} {why}; {fix}")
