"""zinc.prepare's two errors, and how it opens a file to read: regular files only (a FIFO would block,
/dev/zero never ends, a folder holds no records). See prepare.py for the tool."""
from __future__ import annotations

import os
import stat
from typing import BinaryIO


class PrepareError(Exception):
    """A failure of the whole run: printed as one line, exit status 1."""


class BadRecord(Exception):
    """One record that cannot be used: counted, skipped, reported with its place."""


def _not_regular(mode: int) -> str:
    """What a file that is not a regular one is, for a message."""
    if stat.S_ISDIR(mode):
        return "is a folder, not a file"
    kinds = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISSOCK, "a socket"))
    return "is " + next((name for test, name in kinds if test(mode)), "something") + ", not a regular file"


def check_regular(path: str, hint: str = "") -> os.stat_result:
    """The stat (symlinks followed) of a file to read; a PrepareError naming it when it is missing or not a
    regular file."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PrepareError(f"{path}: no such file{hint}")
    except OSError as e:
        raise PrepareError(f"{path}: {e.strerror}{hint}")
    if not stat.S_ISREG(st.st_mode):
        raise PrepareError(f"{path}: {_not_regular(st.st_mode)}{hint}")
    return st


def open_regular(path: str, hint: str = "") -> BinaryIO:
    """Opens a file to read (binary), refusing anything but a regular file without blocking: by stat before
    the open, then by fstat of what was opened, with O_NONBLOCK (a FIFO put there in between does not block
    the open)."""
    check_regular(path, hint)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise PrepareError(f"{path}: {e.strerror}{hint}")
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise PrepareError(f"{path}: {_not_regular(mode)}{hint}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")
