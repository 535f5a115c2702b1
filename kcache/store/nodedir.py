"""The node cache's directory as a peer may have left it: locks, removal and listing that plants cannot misuse.

Whoever can write DIR (its tree is drawn in kcache.store.nodecache) may plant anything in it, and DIR
outlives every pod on the node. What these helpers guard against, each where the node cache touches DIR:

- A link at packs/ or packs/<hh> would have locks, fills and packs land outside DIR, where the cap never
  sees them; a file or a FIFO there failed every fill below it: `real_directory` replaces either with a
  directory.
- A lock path that holds no regular file (a link, a directory, a socket, a FIFO) would keep every reader
  off a pack, or at DIR/.evict.lock every fill off the node, for good (a FIFO opened for reading blocked
  its reader outright): `lock` removes it and takes the lock.
- Removing a path removes what is at it, never what a link there names: `clear`. A directory there is
  renamed aside first (the one rename here: nothing is renamed into place) and removed with its contents.
  A process killed in between leaves it aside (`.tmp-junk-<hex>`): `remove_junk` removes it later.
- Listing and stat-ing never follow a link (`entries`, `lstat`, `is_directory`), and a file a peer keeps
  appending to is hashed only up to the size that was stat-ed (`sha256`).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import stat
from pathlib import Path
from typing import BinaryIO

from kcache import filelock, removal

log = logging.getLogger(__name__)

_CHUNK = 1024 * 1024
JUNK_PREFIX = ".tmp-junk-"  # + 16 hex digits: a directory `clear` set aside, to be removed
_JUNK = re.compile(re.escape(JUNK_PREFIX) + r"[0-9a-f]{16}\Z")


def sha256(f: BinaryIO, size: int) -> str:
    """The hash of the first `size` bytes: a file a peer keeps appending to is not read forever."""
    digest = hashlib.sha256()
    while size > 0 and (chunk := f.read(min(_CHUNK, size))):
        digest.update(chunk)
        size -= len(chunk)
    f.seek(0)
    return digest.hexdigest()


def lstat(path: Path) -> os.stat_result | None:
    """os.lstat, or None when nothing is at `path`: also where a directory above it is one no more (a
    peer replaced a shard with a file), which had raised out of a prefetch round and ended its loop."""
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def entries(directory: Path) -> list[os.DirEntry]:
    """What `directory` holds; nothing when it cannot be listed (gone, or not ours to look at)."""
    try:
        with os.scandir(directory) as it:
            return list(it)
    except OSError:
        return []


def lock(path: Path, mode: int, deadline: float | None) -> filelock.FileLock | None:
    """filelock.acquire, once what is at `path` is a lock file. A link, a directory, a socket or a FIFO
    planted there (filelock opens with O_NOFOLLOW|O_NONBLOCK and takes regular files only: ELOOP,
    EISDIR, ENXIO) is removed: it would keep every reader off the pack, or at DIR/.evict.lock every
    fill off the node, for good. A regular file that cannot be opened (another user's, a read-only
    volume), or a plant we may not remove, is left: OSError, and the store serves the read."""
    cleared = 0
    while True:
        try:
            return filelock.acquire(path, mode, deadline)
        except OSError:
            st = lstat(path)
            if cleared == 2 or st is None or stat.S_ISREG(st.st_mode):  # twice: peers may race us
                raise
        log.warning("%s is no lock file; replacing it", path)
        clear(path)
        cleared += 1


def clear(path: Path) -> None:
    """Remove what is at `path`, without following a link: a file, a link, a FIFO; a directory is
    first renamed aside (so the path is free at once) and then removed with what it holds
    (never following a link out of it)."""
    try:
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:
        pass
    except PermissionError:  # unlink(2) of a directory says EPERM on some systems
        if not is_directory(path):
            raise
    aside = path.with_name(f"{JUNK_PREFIX}{os.urandom(8).hex()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return
    removal.remove_tree(aside)


def remove_junk(directory: Path) -> int:
    """Remove what `clear` set aside in `directory` and a killed process left there; how many went.

    No liveness check is needed: a junk name is made by one rename to a fresh random name, nothing is
    ever renamed to it again, and what it holds is only ever removed. Its maker may still be removing
    it; two removers of one tree only race to unlink the same names, and each leaves what it finds gone."""
    removed = 0
    for entry in entries(directory):
        if _JUNK.match(entry.name):
            removal.remove_tree(entry.path)  # a link is unlinked, never followed
            removed += not os.path.lexists(entry.path)
    return removed


def is_directory(path: Path) -> bool:
    """A directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def real_directory(path: Path) -> None:
    """Make `path` a directory of its own. A link planted there would have locks, fills and packs
    land outside DIR, where the cap never sees them; a file or a FIFO there failed every fill below it,
    for good. Whatever is there and is no directory is removed (OSError when it is not ours to remove,
    and then the store serves the read)."""
    for _attempt in range(3):  # peers may be replacing the same plant at once
        try:
            os.mkdir(path)
            return
        except FileExistsError:
            pass
        st = lstat(path)
        if st is not None and stat.S_ISDIR(st.st_mode):
            return
        if st is not None:
            log.warning("node cache: %s is no directory; replacing it with one", path)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    raise NotADirectoryError(errno.ENOTDIR, "not a directory of the node cache", str(path))


def touch(fd: int, path: Path) -> None:
    """Mark the open file as used: the inode that was verified, whatever the path names by now."""
    try:
        os.utime(fd)
    except OSError as exc:  # another user's file: LRU order degrades, reads do not
        log.debug("node cache: cannot mark %s as used: %s", path, exc)
