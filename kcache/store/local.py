"""`file://PATH` backend: the embedded default, and the air-gapped one.

Objects are plain files at PATH/<key>, written by `kcache.atomic` without overwrite: it publishes
the temp sibling with `os.link`, which fails if the key exists, so create-if-absent is atomic even
between processes.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from kcache import atomic
from kcache.errors import ObjectMissing, StoreError
from kcache.store.base import Leftover, ObjectInfo, is_valid_key
from kcache.streams import Window

_TEMP = ".tmp-"  # kcache.atomic's temp siblings


class LocalStore:
    """`create`: the first write may create PATH (a publisher's store). Without it PATH must exist:
    a reader pointed at a typo must hear so, not read an empty store (as S3 names a missing bucket)."""

    def __init__(self, root: Path, *, create: bool = True):
        self.root = Path(root)
        self.url = f"file://{self.root}"
        self.create = create
        if self.root.exists() and not self.root.is_dir():
            raise StoreError(self.url, "is a file, not a directory")
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
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise ObjectMissing(self.url, key) from None
        except OSError as exc:
            raise StoreError(self.url, f"cannot read {key}: {exc.strerror}") from None

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        try:
            f = open(self._path(key), "rb")
        except FileNotFoundError:
            raise ObjectMissing(self.url, key) from None
        except OSError as exc:
            raise StoreError(self.url, f"cannot read {key}: {exc.strerror}") from None
        f.seek(offset)
        return Window(f, length)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise ObjectMissing(self.url, key) from None
        except OSError as exc:
            raise StoreError(self.url, f"cannot stat {key}: {exc.strerror}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

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
        for dirpath, _dirs, files in os.walk(base):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if not wanted(name):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except FileNotFoundError:
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                yield ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, timezone.utc))

    def get_versioned(self, key: str) -> tuple[bytes, str] | None:
        try:
            data = self._path(key).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StoreError(self.url, f"cannot read {key}: {exc.strerror}") from None
        return data, hashlib.sha256(data).hexdigest()

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        final = self._path(key)
        self._before_write()
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            # A lock beside the object serializes compare-and-swap between processes on this host
            # (and on NFS v4, which supports fcntl locks).
            with open(final.parent / f".lock-{final.name}", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                current = self.get_versioned(key)
                if (current[1] if current else None) != version:
                    return False
                atomic.write_bytes(final, data)
                return True
        except OSError as exc:
            raise StoreError(self.url, f"cannot write {key}: {exc.strerror or exc}") from None


    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise StoreError(self.url, f"cannot delete {key}: {exc.strerror}") from None


def _copy(src: BinaryIO, dst: BinaryIO) -> None:
    while chunk := src.read(1024 * 1024):
        dst.write(chunk)
