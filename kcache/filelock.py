"""Advisory file locks (flock) that give up at a deadline and survive their lock file being removed.

Shared locks are held by readers, exclusive ones by the writer that fills or removes what the lock
guards. flock locks belong to an open file description, so two threads of one process that each
open the lock file exclude each other as two processes would, and the kernel drops every lock of
a process that dies: a killed pod never leaves a pack locked.

Lock files may be deleted (the node cache removes a pack's lock with the pack). Whoever deletes one
holds it exclusively while doing so; a waiter that then gets the lock of the deleted inode notices
that the path now names another file (or none) and locks again.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from pathlib import Path

SHARED, EXCLUSIVE = fcntl.LOCK_SH, fcntl.LOCK_EX
# How often a waiter with a deadline tries again: flock has no timeout of its own.
_FIRST_POLL, _MAX_POLL = 0.005, 0.1


class FileLock:
    """A held lock; `release()` (or leaving the `with`) unlocks it and closes the file."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path

    def downgrade(self) -> bool:
        """Exclusive to shared, in place: no moment without a lock in which a peer's exclusive try (an
        eviction) gets in; the kernel converts the lock of this open file under its own lock. False if
        the lock was lost instead (a conversion that is not atomic, on some file systems): then none is held."""
        try:
            fcntl.flock(self.fd, SHARED | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            return False

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the last descriptor of the description drops the flock
            self.fd = -1

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(path: Path, mode: int, deadline: float | None) -> FileLock | None:
    """The lock on `path` (created if absent) in `mode`, or None once `deadline` (time.monotonic())
    has passed. A deadline in the past means one try; None waits as long as it takes.
    OSError from the file system propagates."""
    while True:
        fd = _open(path, mode)
        try:
            if not _flock(fd, mode, deadline):
                os.close(fd)
                return None
            if _still_named(fd, path):
                return FileLock(fd, path)
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # we locked a lock file that was deleted meanwhile: lock the one there now


def _open(path: Path, mode: int) -> int:
    """The lock file, created if absent. O_NOFOLLOW: whoever can write the directory must not make us
    create a file elsewhere. O_NONBLOCK: a FIFO planted there must not keep us waiting for a writer
    (opened for reading, it would); anything but a regular file is refused (ENXIO), for the caller to
    replace. Whoever may not write the file (a pod mounting the node cache read-only, or as another
    user; a filler whose peer made the file 0444) takes its lock on the existing file opened for
    reading: flock needs no write access, shared or exclusive, so the lock excludes as it would."""
    flags = os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        try:
            fd = os.open(path, os.O_RDONLY | flags)
        except FileNotFoundError:
            raise exc from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.ENXIO, "not a lock file", str(path))
    return fd


def _flock(fd: int, mode: int, deadline: float | None) -> bool:
    if deadline is None:
        fcntl.flock(fd, mode)
        return True
    pause = _FIRST_POLL
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, _MAX_POLL)


def _still_named(fd: int, path: Path) -> bool:
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)
