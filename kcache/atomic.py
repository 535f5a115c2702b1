"""Writing a file so that a reader sees the old content or the new, never half of either.

Every file kcache writes in place (markers, store objects, keys, the Mega-Cache blob) goes through
`write`: the bytes go to a temp sibling `.tmp-<name>-*` (in the same directory, so the rename
cannot cross file systems; `.tmp*` is junk to publish and skipped by store listings), then

    durability rule: fsync the temp file, rename it into place, fsync the directory.

The first fsync means a crash never leaves a renamed file without its bytes; the last means the
rename itself survives a crash. Without `overwrite`, the rename is a hard link, which fails when
the name exists: create-if-absent for content-addressed objects and keys. The temp file is removed
in every case.
"""

from __future__ import annotations

import os
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
    return write(path, lambda f: f.write(data), mode=mode, overwrite=overwrite)


def write_text(path: Path, text: str, *, mode: int = 0o644, overwrite: bool = True) -> bool:
    return write_bytes(path, text.encode("utf-8"), mode=mode, overwrite=overwrite)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
