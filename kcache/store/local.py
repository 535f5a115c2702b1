"""`file://PATH` backend: the embedded default, and the air-gapped one.

Objects are plain files at PATH/<key>, written by `kcache.atomic` without overwrite: it publishes
the temp sibling with `os.link`, which fails if the key exists, so create-if-absent is atomic even
between processes.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from kcache import atomic, filelock
from kcache.errors import ObjectMissing, ObjectTooLarge, StoreError
from kcache.store import nodedir
from kcache.store.base import Leftover, ObjectInfo, is_valid_key
from kcache.streams import Window

_TEMP = ".tmp-"  # kcache.atomic's temp siblings
# Seconds a compare-and-swap waits for another writer's lock on the same key: each holds it for a
# read and an atomic write, milliseconds.
REF_LOCK_WAIT = 60.0


class LocalStore:
    """`create`: the first write may create PATH (a publisher's store). Without it PATH must exist:
    a reader pointed at a typo must hear so, not read an empty store (as S3 names a missing bucket)."""

    def __init__(self, root: Path, *, create: bool = True):
        self.root = Path(root)
        self.url = f"file://{self.root}"
        self.create = create
        try:
            if self.root.exists() and not self.root.is_dir():
                raise StoreError(self.url, "is a file, not a directory")
        except OSError as exc:  # ENAMETOOLONG
            raise StoreError(self.url, f"cannot be looked at: {exc.strerror or exc}") from None
        if not create:
            self._require_root()

    def _require_root(self) -> None:
        if not self.root.is_dir():
            raise StoreError(self.url, "does not exist; `kcache publish` creates a store, no other command does")

    def _before_write(self) -> None:
        if not self.create:  # the writes' mkdir(parents=True) would create PATH itself
            self._require_root()

    def _path(self, key: str) -> Path:
        if not is_valid_key(key):
            raise StoreError(self.url, f"invalid object key {key!r}")
        return self.root / key

    def put_file(self, key: str, path: Path) -> bool:
        with open(path, "rb") as src:
            return self._put(key, lambda dst: _copy(src, dst))

    def put_bytes(self, key: str, data: bytes) -> bool:
        return self._put(key, lambda dst: dst.write(data))

    def _put(self, key: str, write) -> bool:
        final = self._path(key)
        if final.exists():
            return False
        self._before_write()
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            return atomic.write(final, write, overwrite=False)
        except OSError as exc:
            raise StoreError(self.url, f"cannot write {key}: {exc.strerror or exc}") from None

    def get_bytes(self, key: str) -> bytes:
        with self._open(key) as f:
            try:
                return f.read()
            except OSError as exc:
                raise StoreError(self.url, f"cannot read {key}: {exc.strerror}") from None

    def _open(self, key: str) -> BinaryIO:
        """The object's file, open for reading; only a regular file is one.

        Opened without blocking, then checked: whoever writes the directory can put a FIFO or a
        device at a key, and reading one would block the command for good (restore for its budget).
        """
        try:
            fd = os.open(self._path(key), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ObjectMissing(self.url, key) from None
        except OSError as exc:
            raise StoreError(self.url, f"cannot read {key}: {exc.strerror}") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise StoreError(self.url, f"{key} is not a regular file")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        f = self._open(key)
        f.seek(offset)
        return Window(f, length)

    def size(self, key: str) -> int:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            raise ObjectMissing(self.url, key) from None
        except OSError as exc:
            raise StoreError(self.url, f"cannot stat {key}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(self.url, f"{key} is not a regular file")
        return st.st_size

    def exists(self, key: str) -> bool:
        try:
            return self._path(key).is_file()
        except OSError:  # a link loop, a name too long: no object is there
            return False

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self._walk(prefix, lambda name: not name.startswith((_TEMP, ".lock-")))

    def leftovers(self) -> Iterator[Leftover]:
        """Temp files of writes killed before their rename (kcache.atomic names them `.tmp-*`)."""
        for info in self._walk("", lambda name: name.startswith(_TEMP)):
            if is_valid_key(info.key):  # mkstemp's names always are; others are no temp file of ours
                yield Leftover(info.key, info.size, info.modified)

    def remove_leftover(self, leftover: Leftover) -> None:
        if leftover.key.rsplit("/", 1)[-1].startswith(_TEMP):  # never an object's own file
            self.delete(leftover.key)

    def _walk(self, prefix: str, wanted: Callable[[str], bool]) -> Iterator[ObjectInfo]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return
        for dirpath, files in _tree(base):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                key = name if rel == "." else f"{rel}/{name}"
                if not wanted(name) or not is_valid_key(key):  # no command could name it
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except OSError:  # gone since the walk, a link loop, a dangling link
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield ObjectInfo(key, st.st_size, _utc(st.st_mtime))

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        try:
            f = self._open(key)
        except ObjectMissing:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if limit is not None and size > limit:
                raise ObjectTooLarge("object", key, size, limit)
            try:
                data = f.read(limit + 1 if limit is not None else -1)  # it may grow after the fstat
            except OSError as exc:
                raise StoreError(self.url, f"cannot read {key}: {exc.strerror}") from None
        if limit is not None and len(data) > limit:
            raise ObjectTooLarge("object", key, len(data), limit)
        return data, _version(data)

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        final = self._path(key)
        self._before_write()
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            # A lock beside the object serializes compare-and-swap between processes on this host
            # (and on NFS v4, which supports fcntl locks). Whoever writes the directory may plant a
            # FIFO there (opened to lock, it waited for a reader), a directory or a link: nodedir.lock
            # replaces it. A writer frozen while it holds the lock fails the others after REF_LOCK_WAIT.
            name = f".lock-{final.name}"
            lock = nodedir.lock(final.parent / name, filelock.EXCLUSIVE, time.monotonic() + REF_LOCK_WAIT)
            if lock is None:
                raise StoreError(self.url, f"cannot write {key}: another writer has held {name} for "
                                           f"{REF_LOCK_WAIT:g} s")  # fmt: skip
            with lock:
                if not self._at_version(key, version):
                    return False
                atomic.write_bytes(final, data)
                return True
        except OSError as exc:
            raise StoreError(self.url, f"cannot write {key}: {exc.strerror or exc}") from None

    def _at_version(self, key: str, version: str | None) -> bool:
        """Whether `key` holds what `version` (from get_versioned; None: nothing) names. Read only at the
        version's size: between a caller's capped read and its swap, whoever writes PATH can put a huge
        (sparse) file at the key, and reading it whole for its hash would take the command's memory."""
        try:
            f = self._open(key)
        except ObjectMissing:
            return version is None
        with f:
            size = os.fstat(f.fileno()).st_size
            if version is None or not version.startswith(f"{size}-"):
                return False
            try:
                data = f.read(size + 1)  # it may grow after the fstat
            except OSError as exc:
                raise StoreError(self.url, f"cannot read {key}: {exc.strerror}") from None
        return _version(data) == version

    def now(self) -> datetime:
        """This host's clock: the filesystem stamps the mtimes `list` and `leftovers` report with it
        (on NFS the server does; NFS needs its clients' clocks in step with it anyway)."""
        return datetime.now(timezone.utc)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise StoreError(self.url, f"cannot delete {key}: {exc.strerror}") from None


def _tree(base: Path) -> Iterator[tuple[str, list[str]]]:
    """(directory, names of what is not a directory in it) for `base` and every directory under it,
    as os.walk without following links. A stack, not os.walk: before Python 3.12 that recursed once
    a level, and whoever writes PATH can nest directories a thousand deep, a RecursionError in every
    listing (gc, verify, reindex, yank --undo)."""
    pending = [str(base)]
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError:  # gone since it was listed, or unreadable: os.walk passes over it too
            continue
        pending += [e.path for e in entries if e.is_dir(follow_symlinks=False)]
        yield directory, [e.name for e in entries if not e.is_dir(follow_symlinks=False)]


def _version(data: bytes) -> str:
    """An object's version: its size, then its SHA-256 (the size lets a swap refuse a changed object unread)."""
    return f"{len(data)}-{hashlib.sha256(data).hexdigest()}"


def _utc(seconds: float) -> datetime:
    """A modification time as a UTC datetime; one no datetime holds is as late as one can be: never
    "old enough" for gc to delete."""
    try:
        return datetime.fromtimestamp(seconds, timezone.utc)
    except (OverflowError, OSError, ValueError):
        return datetime.max.replace(tzinfo=timezone.utc)


def _copy(src: BinaryIO, dst: BinaryIO) -> None:
    while chunk := src.read(1024 * 1024):
        dst.write(chunk)
