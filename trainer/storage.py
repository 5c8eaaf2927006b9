"""Opening fsspec stores: one place that turns "this protocol's package is not installed" into a config error.

fsspec imports a protocol's implementation (s3fs, gcsfs, adlfs, ...) only when a URL first uses it, and
raises ImportError then. Left alone that is a traceback in the middle of a run (exit 1, which torchrun
and Kubernetes retry forever); it is a setup mistake the user fixes with an extra, so it exits 2.
"""

from __future__ import annotations

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
