"""A publish's working directory under TMPDIR, where it builds packs before they go up.

    $TMPDIR/
      kcache-publish-held-<random>/   one per running publish, flock'ed by it until removed
        pack-*.tmp                    packs being built (at most --jobs of 32 MiB, or a large
                                      file's compressed size each)

A publish killed part-way (the OOM killer, SIGKILL) leaves its directory to nobody, and a sidecar
killed again and again would fill its pod's TMPDIR until no publish finds room: so each publish
first removes the directories of its prefix and owner that nobody holds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kcache.errors import StagingError

log = logging.getLogger(__name__)

# What writing packs into the temporary directory fails with when it is full, read-only or not
# ours: the user's to fix (TMPDIR), not a bug. Creating it may also find it missing.
_STAGING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS})
_WORKDIR_ERRNOS = _STAGING_ERRNOS | {errno.ENOENT, errno.ENOTDIR}
# Workdirs whose publish holds a flock on them (see workdir); those of a kcache before the lock
# are named "kcache-publish-" and a random tail without a hyphen, so never taken for ours.
PREFIX = "kcache-publish-held-"


@contextlib.contextmanager
def staging(workdir: Path) -> Iterator[None]:
    """Pack building in `workdir`: a full, read-only or foreign temporary directory is a StagingError.

    Only around writing packs: reading a cache file fails otherwise, and an upload's errors are the store's.
    """
    try:
        yield
    except OSError as exc:
        if exc.errno not in _STAGING_ERRNOS:
            raise
        raise StagingError(str(Path(workdir).parent), exc.strerror or str(exc)) from exc


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    """A fresh temporary directory (under TMPDIR) to build packs in, removed with what it holds.

    The publish building in it holds a flock on it until it is gone: one killed part-way (the OOM
    killer, SIGKILL) leaves its staged packs to nobody, and a sidecar killed again and again would
    fill its pod's TMPDIR until no publish finds room. So each publish first removes those.
    """
    sweep()
    try:
        made = tempfile.TemporaryDirectory(prefix=PREFIX)
    except OSError as exc:
        if exc.errno not in _WORKDIR_ERRNOS:
            raise
        where = os.path.dirname(exc.filename) if isinstance(exc.filename, str) else tempfile.tempdir
        raise StagingError(where or os.environ.get("TMPDIR", "/tmp"), exc.strerror or str(exc)) from exc
    with made as path:
        held = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            fcntl.flock(held, fcntl.LOCK_EX)  # before any file is staged: a sweeper leaves an empty one be
            yield Path(path)
        finally:
            made.cleanup()  # still held: no sweeper removes it under us
            os.close(held)


def sweep() -> None:
    """Remove the workdirs killed publishes left: ours by name and owner, holding files, and held by
    no running publish (the kernel drops a dead process's flocks). Best effort: workdir names a
    TMPDIR that cannot be used."""
    try:
        with os.scandir(tempfile.gettempdir()) as listing:
            paths = [entry.path for entry in listing if entry.name.startswith(PREFIX)]
    except OSError:
        return
    for path in paths:
        try:  # O_NOFOLLOW: a link planted under our name is not ours to follow
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: a running publish's
            if os.listdir(fd):  # empty: one just made, not held yet
                log.info("removing %s, left by a publish that was killed", path)
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue
        finally:
            os.close(fd)
