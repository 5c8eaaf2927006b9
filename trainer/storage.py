"""Opening fsspec stores: one place that turns "this protocol's package is not installed" into a config error,
one that refuses, before any work, a local output folder or file that cannot be made, and one that turns a
store's own exceptions (botocore, aiohttp, gcsfs: an unreachable endpoint, refused credentials) into one
line (`store_errors`).

fsspec imports a protocol's implementation (s3fs, gcsfs, adlfs, ...) only when a URL first uses it, and
raises ImportError then. Left alone that is a traceback in the middle of a run (exit 1, which torchrun
and Kubernetes retry forever); it is a setup mistake the user fixes with an extra, so it exits 2.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
from fsspec.registry import known_implementations

from trainer.errors import CheckpointError, ConfigError

# Protocol -> the gentrain extra that installs its fsspec implementation.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
GCSFS_ZB_HNS = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"


def filesystem(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path) for `url`, like fsspec.core.url_to_fs; a missing protocol package is a ConfigError."""
    options = dict(storage_options or {})
    try:
        if _gcs_custom_endpoint(url, options):
            return _plain_gcsfs(url, options)
        return fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise ConfigError(_missing(url, e)) from None


def _gcs_custom_endpoint(url: str, options: Mapping[str, Any]) -> bool:
    protocol = fsspec.core.split_protocol(url)[0]
    return protocol in ("gs", "gcs") and bool(options.get("endpoint_url") or os.environ.get("STORAGE_EMULATOR_HOST"))


def _plain_gcsfs(url: str, options: dict[str, Any]) -> tuple[fsspec.AbstractFileSystem, str]:
    """gcsfs's own GCSFileSystem for a GCS endpoint other than Google's (an emulator, a proxy, a private
    endpoint). gcsfs >= 2025.x makes gs:// its ExtendedGcsFileSystem unless GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT
    is false (read when gcsfs is imported); that class asks Google's Storage Control API (gRPC, not the
    endpoint given) for each bucket's layout and waits about 60 s per call for an answer that never comes.
    gentrain sets the variable to false before gcsfs is imported unless the user set it, and if gcsfs was
    imported already, builds the plain class itself; Google's own endpoint is left to gcsfs's default."""
    if GCSFS_ZB_HNS in os.environ:  # the user's choice
        return fsspec.core.url_to_fs(url, **options)
    if "gcsfs" not in sys.modules:
        os.environ[GCSFS_ZB_HNS] = "false"
        return fsspec.core.url_to_fs(url, **options)
    import gcsfs.core

    fs = gcsfs.core.GCSFileSystem(**options)
    return fs, fs._strip_protocol(url)


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
    """(the path that stops a folder being made at `path`, why), or None when `path` is or can be a folder.

    One `stat` per path decides: another process (the other ranks on this machine) may make the folder at any
    moment, and a folder seen missing by one call and present by the next is not a file in the way (two
    calls, isdir then lexists, once refused a run.dir that rank 0 made in between, with exit 2)."""
    probe = path
    while True:
        try:
            mode = os.stat(probe).st_mode  # follows links: a link to a folder is a folder
        except OSError:  # as os.path.isdir does: missing, a dangling link, below a file or an unsearchable folder
            mode = None  # (what stands in the way is found further up)
        if mode is not None and stat.S_ISDIR(mode):
            if not os.access(probe, os.W_OK | os.X_OK):
                return probe, "is a folder this user cannot write in"
            return None
        if os.path.islink(probe):  # to a file, or dangling: links are not made by the ranks
            return probe, f"is a symbolic link to {os.readlink(probe)!r}, which is not a folder"
        if mode is not None:
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
    if os.path.islink(full) and not os.path.exists(full):
        # A dangling link is written through: its target's folder must already be one (only the link's own
        # folder is made), and be writable.
        target = os.path.realpath(full)
        folder = os.path.dirname(target)
        if not os.path.isdir(folder):
            why = "whose folder does not exist"
        elif not os.access(folder, os.W_OK | os.X_OK):
            why = "whose folder this user cannot write in"
        else:
            return
        raise ConfigError(
            f"{what} cannot be written: it is a symbolic link to {os.readlink(full)!r}, {why}; {fix}, or "
            "remove the link"
        )


# Packages whose exceptions are the store's (a connection, a timeout, credentials): none subclass OSError
# reliably (botocore's do not), so they are told by where they come from.
_STORE_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "s3fs", "gcsfs", "google", "fsspec", "adlfs", "azure")


def is_store_error(e: BaseException) -> bool:
    """`e` comes from the store, not from gentrain: an OSError, or an exception of a store package."""
    if isinstance(e, ConfigError | CheckpointError):
        return False
    if isinstance(e, OSError | TimeoutError):
        return True
    return any(c.__module__.split(".")[0] in _STORE_PACKAGES for c in type(e).__mro__ if c is not object)


def describe_store_error(e: BaseException) -> str:
    """One line for a store's exception: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


@contextlib.contextmanager
def store_errors(url: str, doing: str) -> Iterator[None]:
    """Inside it, a store's own exception (`is_store_error`) becomes a CheckpointError of one line naming
    `url` and what was being done (the CLI prints it redacted and exits 1: the store may be back later)."""
    try:
        yield
    except Exception as e:
        if not is_store_error(e):
            raise
        raise CheckpointError(
            f"cannot {doing} {url}: the store failed ({describe_store_error(e)}); check that it is reachable and "
            "that its storage options (endpoint, credentials) are right, then run again"
        ) from None
