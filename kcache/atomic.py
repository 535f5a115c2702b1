"""Writing a file so that a reader sees the old content or the new, never half of either.

Every file kcache writes in place (markers, store objects, keys, the Mega-Cache blob) goes through
`write`: the bytes go to a temp sibling `.tmp-<name>-*` (in the same directory, so the rename
cannot cross file systems; `.tmp*` is junk to publish and skipped by store listings), then

    durability rule: fsync the temp file, rename it into place, fsync the directory.

The first fsync means a crash never leaves a renamed file without its bytes; the last means the
rename itself survives a crash. Without `overwrite`, the rename is a hard link, which fails when
the name exists: create-if-absent for content-addressed objects and keys. The temp file is removed
in every case. A file that must be written even on a full volume (restore's kcache.env and marker)
can have room set aside beforehand with `reserve`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write(path: Path, fill: Callable[[BinaryIO], object], *, mode: int = 0o644, overwrite: bool = True) -> bool:
    """Write `path` with what `fill(file)` writes. False when `overwrite` is off and `path` exists.
    OSError from the file system propagates (callers know which error to turn it into)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".tmp-{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        _fsync_dir(path.parent)
        return True
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def write_bytes(path: Path, data: bytes, *, mode: int = 0o644, overwrite: bool = True) -> bool:
    """`write` of `data`; on a full volume, into the room `reserve` set aside for `path`, if any."""
    try:
        return write(path, lambda f: f.write(data), mode=mode, overwrite=overwrite)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not overwrite or not _into_spare(Path(path), data, mode):
            raise
        return True


def reserve(path: Path, size: int) -> None:
    """Set `size` bytes aside for a later write of `path`: a file filled now, while there is room,
    whose blocks a write on a full volume takes over (see write_bytes). `release` gives them back.
    Not synced: the space is taken when the bytes are written, and a crash only loses the room.

    Whatever else is at the spare's name (a FIFO, whose open for writing waits for a reader, a
    socket, a device) is removed first; O_NONBLOCK: one planted between the two is refused."""
    spare = _spare(Path(path))
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(os.lstat(spare).st_mode) and not stat.S_ISDIR(os.lstat(spare).st_mode):
            os.unlink(spare)
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(spare))
        view = memoryview(bytes(size))
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def release(path: Path) -> None:
    try:
        os.unlink(_spare(Path(path)))
    except FileNotFoundError:
        pass


def _spare(path: Path) -> Path:
    return path.with_name(f".tmp-{path.name}-reserved")


def _into_spare(path: Path, data: bytes, mode: int) -> bool:
    """`data` written over the reserved blocks (no new ones needed), then renamed into place."""
    try:
        fd = os.open(_spare(path), os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO: ENXIO, never a wait
    except OSError:
        return False
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode) or os.fstat(fd).st_size < len(data):
            return False
        view, done = memoryview(data), 0
        while done < len(data):
            done += os.pwrite(fd, view[done:], done)
        os.ftruncate(fd, len(data))
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(_spare(path), path)
    _fsync_dir(path.parent)
    return True


def write_text(path: Path, text: str, *, mode: int = 0o644, overwrite: bool = True) -> bool:
    return write_bytes(path, text.encode("utf-8"), mode=mode, overwrite=overwrite)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
