"""Reading a small file that someone else may have put there: only a regular file, at most N bytes.

Profiles come from a ConfigMap, markers from a directory the model container can write to. A FIFO
in their place would block an open() for good, /dev/zero would fill memory, and a huge file would
be read whole by `read_text`. Opening with O_NONBLOCK never waits for a FIFO's writer; fstat on
the open descriptor (not the path, which can be swapped) decides.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kcache.errors import ConfigError


class NotRegularFile(OSError):
    """The path is a FIFO, a device, a socket or a directory."""


class FileTooLarge(OSError):
    """The file holds more than the caller's limit."""


def read_bytes(path: Path, limit: int) -> bytes:
    """The whole file; raises NotRegularFile, FileTooLarge or the OSError of open/read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFile(f"{path} is not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileTooLarge(f"{path} is over the {limit}-byte limit")
    return data


def read_named(path: Path, limit: int, what: str) -> bytes:
    """`read_bytes` of a file a flag or an environment variable names (`what`): every failure is a
    ConfigError that says which file and why, so a typo or a FIFO is a usage error, not a hang."""
    try:
        return read_bytes(path, limit)
    except NotRegularFile:
        raise ConfigError(
            what, str(path), "is not a regular file (a FIFO, device or directory cannot be read)"
        ) from None
    except FileTooLarge:
        raise ConfigError(what, str(path), f"is over the {limit}-byte limit") from None
    except OSError as exc:
        raise ConfigError(what, str(path), f"cannot be read: {exc.strerror or exc}") from None
