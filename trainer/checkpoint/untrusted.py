"""Small files of a checkpoint root read as data only (the lease, attempts.json): anyone who can write to the
store can put anything at those names, so on a local disk nothing there is followed, opened or waited on
unless it is a regular file.

`lstat` first: a link, FIFO, device or directory is never opened. The open then neither follows a link
(`O_NOFOLLOW`) nor blocks (`O_NONBLOCK`: a FIFO swapped in between), and `fstat` checks what was opened. At
most `cap + 1` bytes are read, so a caller can tell a file that is too large from one that fits without
reading /dev/zero until memory runs out.
"""

from __future__ import annotations

import os
import stat


class NotRegularFile(Exception):
    """Something other than a regular file stands at `path`; `kind` says what, for a message."""

    def __init__(self, path: str, kind: str):
        self.path, self.kind = path, kind
        super().__init__(f"{path} is {kind}")


def kind_of(mode: int, path: str) -> str:
    """What a file of `mode` is, in words (a link names its target)."""
    if stat.S_ISLNK(mode):
        try:
            return f"a symbolic link (to {os.readlink(path)!r})"
        except OSError:
            return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe (FIFO)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    return "not a regular file"


def read_regular(path: str, cap: int) -> bytes | None:
    """At most `cap + 1` bytes of the local regular file at `path`; None if there is none (or it went away
    while opening); NotRegularFile for anything else there, which is never opened or waited on."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise NotRegularFile(path, kind_of(st.st_mode, path))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link swapped in since the lstat
        raise NotRegularFile(path, f"not a regular file ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFile(path, kind_of(st.st_mode, path))
        chunks, n = [], 0
        while n <= cap:
            chunk = os.read(fd, cap + 1 - n)
            if not chunk:
                break
            chunks.append(chunk)
            n += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)
