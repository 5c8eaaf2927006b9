"""Keep freed host memory for reuse instead of handing it back to the kernel every step.

glibc's malloc serves large blocks with mmap and returns them with munmap on
free, and trims the top of its heap once enough of it is free. A training
step on CPU allocates and frees the same activation and gradient buffers
(hundreds of kB to a few MB each) every step, so each step faults them in
again: on the digits UNet 12-16k minor page faults and 30-36 ms of system time
per step, against 0.1k faults and under 1 ms with the limits below (measured
with one thread, `bench/vs_diffusers.py` has the whole-process figures). The
limits are the largest glibc accepts for mmap (32 MiB) and twice that for
trimming, so memory is kept up to the step's working set plus 64 MiB, not
grown without bound.

Written by hand because no maintained Python package sets these: the
alternatives are process-wide, set before start (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, `GLIBC_TUNABLES`, or jemalloc/tcmalloc through
`LD_PRELOAD`); a user who set any of those keeps their choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_chose_allocator(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """True when the process was started with its own malloc settings or allocator."""
    if any(k in environ for k in _USER_SETTINGS):
        return True
    if "malloc" in environ.get("GLIBC_TUNABLES", ""):
        return True
    preload = environ.get("LD_PRELOAD", "")
    return any(name in preload for name in ("jemalloc", "tcmalloc", "mimalloc"))


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (and workers it forks). True if set."""
    if not sys.platform.startswith("linux") or user_chose_allocator():
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not ok:
        log.debug("mallopt refused the thresholds; keeping glibc's defaults")
    return ok
