"""Writes that bypass the page cache (O_DIRECT) where the filesystem allows it, for
sparkform-checkpoint's downloads, and a full disk told apart from other write errors."""

import errno
import fcntl
import os


class DiskFull(Exception):
    """The disk filled while `path` was written."""

    def __init__(self, path):
        super().__init__(path)
        self.path = path


def direct_writes(handle, on):
    """Writes of `handle` bypass the page cache (O_DIRECT), or go through it again; a filesystem
    without O_DIRECT (tmpfs before Linux 6.6, some network ones) keeps them in the page cache."""
    flags = fcntl.fcntl(handle, fcntl.F_GETFL)
    try:
        fcntl.fcntl(handle, fcntl.F_SETFL, (flags | os.O_DIRECT) if on else (flags & ~os.O_DIRECT))
    except OSError as err:
        if err.errno != errno.EINVAL:
            raise


def write_all(handle, view):
    """Write all of `view` to the raw `handle`. A short write, or a filesystem that refuses a
    direct write's alignment (EINVAL), turns O_DIRECT off for the rest: the next write would not
    start on a block boundary, or cannot bypass the page cache there at all."""
    while view:
        try:
            count = handle.write(view)
        except OSError as err:
            if err.errno != errno.EINVAL or not fcntl.fcntl(handle, fcntl.F_GETFL) & os.O_DIRECT:
                raise
            direct_writes(handle, False)
            continue
        if count < len(view):
            direct_writes(handle, False)
        view = view[count:]


def written(path, write, *args):
    """`write(*args)`, a write of `path`'s bytes: a full disk raises DiskFull."""
    try:
        return write(*args)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(path) from None
        raise
