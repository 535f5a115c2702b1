"""The restore root as restore owns it: one restore at a time, leftovers, and sharing with a group.

    ROOT/.kcache-lock               flock'ed for the whole of a restore
    ROOT/.kcache-staging-<pid>-*    a restore's staging; any found under the lock is a leftover

Ownership of ROOT is the lock, not a pid in a directory name: in a container kcache is often
pid 1, and pids are reused, so "is the owner alive" says nothing. flock belongs to the open
file, so a restore that is killed releases it with its process.

A setgid ROOT (what Kubernetes' fsGroup gives a volume) is shared with its group: the model
container, running as another user of that group, must compile into the restored layers, so
directories restore creates there are group-writable and files group-readable. No restored file
is ever group- or world-writable, shared or not, whatever mode its manifest row names.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kcache import removal
from kcache.errors import RootBusy, RootError

log = logging.getLogger(__name__)

STAGING_PREFIX = ".kcache-staging-"
LOCK_NAME = ".kcache-lock"
# How long restore waits for a directory in the way of its lock, kcache.env or a marker to be deleted.
ASIDE_DELETE_SECONDS = 1.0
SHARED_DIR_MODE = 0o2775  # rwxrwsr-x: the group writes, new entries keep ROOT's group
FILE_MODE_MASK = 0o755  # what a restored file may have of its manifest mode: no g+w, no o+w
_LOCK_POLL = 0.05  # seconds between tries while another restore holds ROOT


def prepare(root: Path) -> None:
    """Create ROOT; RootError when it cannot be a restore root (then nothing can be written there)."""
    try:
        if root.exists() and not root.is_dir():
            raise RootError(str(root), "exists and is not a directory; pass an empty or kcache-managed directory")
        _make_dirs(root)
    except OSError as exc:  # ENAMETOOLONG from exists() too: a path past what the kernel takes
        raise RootError(str(root), f"cannot be created: {exc.strerror or exc}") from None


def _make_dirs(path: Path) -> None:
    """mkdir -p in a loop: Path.mkdir(parents=True) and os.makedirs recurse once a level."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:  # made meanwhile by another restore
            if not directory.is_dir():
                raise


@contextmanager
def staging_removed(root: Path, deadline: float | None) -> Iterator[None]:
    """Under ROOT's lock every staging directory there now is a leftover: of a restore that was killed,
    or of one whose budget ran out while it deleted (the previous layers go into its staging directory).
    They are deleted on a daemon thread while the block runs, waited for when it ends until `deadline`
    (what is left then waits for the next restore). A leftover can be the last start's compiles (a
    hundred thousand files on a slow volume): deleted before the restore, it took the budget the
    bundle's fetch needed, and the pod started cold though a bundle matched."""
    stale = sorted(root.glob(STAGING_PREFIX + "*"))  # listed now: the restore's own come after
    if not stale:  # every fresh pod: no thread for nothing
        yield
        return

    def remove() -> None:
        for path in stale:
            removal.remove_tree(path)

    worker = threading.Thread(target=remove, daemon=True, name="kcache-delete")
    worker.start()
    try:
        yield
    finally:
        join_until(worker, deadline)


_now = time.monotonic  # the clock deadlines are read on


def delete_until(path: Path, deadline: float | None) -> bool:
    """rm -rf `path`, waiting for it until `deadline` (time.monotonic) at most; True when it is gone.

    A layer being replaced can be a hundred thousand files, and the budget is the pod's: past the
    deadline the deletion goes on in a daemon thread for as long as the process lives, and the
    next restore deletes what is left (`staging_removed`). A link is removed, never followed.
    """
    if os.path.islink(path) or not os.path.isdir(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    if deadline is None:
        removal.remove_tree(path)
        return not os.path.lexists(path)
    if deadline - _now() <= 0:
        return False
    join_until(delete_in_background(path), deadline)
    return not os.path.lexists(path)


def join_until(worker: threading.Thread, deadline: float | None) -> None:
    """Wait for `worker` until `deadline` (time.monotonic) at most; None: as long as it takes."""
    if deadline is None:
        worker.join()
    elif (left := deadline - _now()) > 0:
        worker.join(left)


def delete_in_background(path: Path) -> threading.Thread:
    """rm -rf `path` on a daemon thread (it ends with the process, whatever is left)."""
    worker = threading.Thread(target=removal.remove_tree, args=(path,), daemon=True, name="kcache-delete")
    worker.start()
    return worker


def group_shared(root: Path) -> bool:
    """A setgid ROOT (what Kubernetes' fsGroup gives a volume) is shared with the group: the model
    container, running as another user of that group, must compile into the restored layers."""
    try:
        return bool(root.stat().st_mode & stat.S_ISGID)
    except OSError:
        return False


def make_dirs(top: Path, path: Path, shared: bool) -> None:
    """mkdir -p `path` below `top`; with `shared`, every directory on the way is group-writable."""
    if path != top:
        make_tree(top, [path.relative_to(top).as_posix()], shared)


def make_tree(top: Path, relative: Iterable[str], shared: bool) -> None:
    """mkdir -p each of the POSIX paths `relative` below `top` (with `shared`, group-writable): each
    directory one mkdir, as strings (pathlib cost ~40 us a directory, 0.2 s for a 5k-directory cache).

    Sorted component by component (a path's "/" as the lowest character: no path holds a NUL), the
    paths under a directory come together, so what is already made is what the path before shares
    with this one: nothing is kept but that path. A set of every directory made held each one's full
    path, quadratic in the depth: a manifest's paths come from the store, and at the manifest cap
    ~10,000 paths of 200 levels (3 KB each) had made that set ~3 GB."""
    base = str(top)
    made: list[str] = []  # the components of the last path made
    for rel in sorted(set(relative), key=lambda rel: rel.replace("/", "\x00")):
        if not rel:
            continue
        parts = rel.split("/")
        same = 0
        while same < min(len(made), len(parts)) and made[same] == parts[same]:
            same += 1
        made = parts
        for depth in range(same + 1, len(parts) + 1):
            path = f"{base}/{'/'.join(parts[:depth])}"
            try:
                os.mkdir(path)
            except FileExistsError:
                pass
            if shared:
                _share(path)


def _share(path: str) -> None:
    """chmod `path` to SHARED_DIR_MODE if it is a directory itself, never through a link: a link
    left in ROOT (say ROOT/vllm -> a private directory of the node) keeps its target's mode."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # a link (ELOOP), not a directory, or not ours to open: not ours to share
        return
    try:
        os.fchmod(fd, SHARED_DIR_MODE)
    except PermissionError:  # another user's directory: theirs to share
        pass
    finally:
        os.close(fd)


def file_mode(mode: int, shared: bool) -> int:
    """The mode a restored file gets from its manifest row's `mode` (the publisher's bits).

    Never group- or world-writable, whatever the row asks: a kernel that another user of the
    volume may rewrite runs as the model. Engines replace their cache files (temp file, rename),
    which needs the directory's write bit, not the file's. With a shared ROOT the group may read
    (and run) what the owner may: copy u+r, u+x to g."""
    if shared:
        mode |= (mode & 0o500) >> 3
    return mode & FILE_MODE_MASK


@contextmanager
def locked(root: Path, timeout: float | None, deadline: float | None) -> Iterator[None]:
    """Hold ROOT/.kcache-lock; wait for another restore until the deadline, then RootBusy.

    flock belongs to the open file: a restore that is killed releases it with its process.
    """
    fd = _open_lock(root / LOCK_NAME)
    try:
        waiting = False
        while not _try_lock(fd):
            if deadline is not None and time.monotonic() >= deadline:
                raise RootBusy(str(root), timeout or 0.0)
            if not waiting:
                log.warning("another restore into %s is running; waiting for it", root)
                waiting = True
            time.sleep(_LOCK_POLL)
        yield
    finally:
        os.close(fd)  # releases the lock


def _open_lock(path: Path) -> int:
    # No lock can be taken on a directory, a link or a socket; a FIFO or a device opens and locks,
    # and is left (another restore may hold it).
    clear(path, _unlockable)
    flags = os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | flags, 0o644)
    except PermissionError:  # left by a restore as another user: flock needs no write access
        try:
            return os.open(path, os.O_RDONLY | flags)
        except OSError as exc:
            raise RootError(str(path.parent), f"cannot open {LOCK_NAME}: {exc.strerror}") from None
    except OSError as exc:
        raise RootError(str(path.parent), f"cannot create {LOCK_NAME}: {exc.strerror}") from None


def clear(path: Path, unwanted: Callable[[int], bool] = lambda _mode: True, deadline: float | None = None) -> None:
    """Remove what is at `path` when `unwanted(its lstat mode)`, never following a link. ROOT outlives
    pods on a node-local volume and others may write it: a directory where restore's lock, kcache.env
    or a marker goes (a link or a socket, for the lock) would keep every pod from its start. A directory
    is renamed aside under a staging name, so the path is free at once, and deleted for a second at
    most, and never past `deadline` (the next restore deletes what is left); anything else is unlinked."""
    try:
        mode = os.lstat(path).st_mode
        if not unwanted(mode):
            return
        if not stat.S_ISDIR(mode):
            os.unlink(path)
            return
        aside = path.with_name(f"{STAGING_PREFIX}{path.name.lstrip('.')}-{os.getpid()}-{os.urandom(4).hex()}")
        os.rename(path, aside)
    except FileNotFoundError:  # none there, or another restore cleared it first
        return
    except OSError as exc:  # the write or open that follows says why
        log.warning("cannot remove %s: %s", path, exc.strerror or exc)
        return
    log.warning("%s was a directory; moved it out of the way", path)
    until = _now() + ASIDE_DELETE_SECONDS
    delete_until(aside, until if deadline is None else min(until, deadline))


def _unlockable(mode: int) -> bool:
    return stat.S_ISDIR(mode) or stat.S_ISLNK(mode) or stat.S_ISSOCK(mode)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:  # a filesystem without flock (some FUSE and NFS mounts): go on unserialized
        log.warning("cannot lock the restore root (%s); concurrent restores into it are not serialized", exc)
    return True
