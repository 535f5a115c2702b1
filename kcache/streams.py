"""Bounded reads over byte streams (files, HTTP bodies): a reader can never run past a blob."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import BinaryIO

from kcache.errors import IntegrityError, ObjectMissing, StoreError

log = logging.getLogger(__name__)

# Reopens of one read that failed part-way (a cut connection), each for the bytes not yet read.
RESUMES = 5


class Window:
    """At most `length` bytes of `stream`; closing the window closes the stream."""

    def __init__(self, stream: BinaryIO, length: int):
        self._stream, self._left = stream, length

    @property
    def remaining(self) -> int:
        return self._left

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self._left:
            n = self._left
        data = self._stream.read(n) if n else b""
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> Window:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class GuardedReader:
    """A store stream whose I/O errors (a dropped NFS mount, a reset connection) become StoreError."""

    def __init__(self, stream: BinaryIO, url: str, key: str):
        self._stream, self._url, self._key = stream, url, key

    def read(self, n: int = -1) -> bytes:
        try:
            return self._stream.read(n)
        except OSError as exc:
            raise StoreError(self._url, f"cannot read {self._key}: {exc.strerror or exc}") from None

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> GuardedReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Resumable:
    """`stream`, the `length` bytes at `offset` of an object, reopened where it stopped when a read fails.

    A store retries requests, not bodies: without this, one connection cut mid-body fails the
    whole read. After a StoreError, `open_at(offset, length)` (a ranged GET) asks only for the
    bytes not yet delivered. At most `resumes` reopens, and none once `cancelled()` (the caller's
    budget is spent): then the read's own error is raised.
    """

    def __init__(self, stream: BinaryIO, open_at: Callable[[int, int], BinaryIO], offset: int, length: int, *,
                 name: str, resumes: int = RESUMES, cancelled: Callable[[], bool] = bool):  # fmt: skip
        self._stream, self._open_at, self._offset, self._length = stream, open_at, offset, length
        self._resumes, self._cancelled, self._name = resumes, cancelled, name
        self._done = 0

    def read(self, n: int = -1) -> bytes:
        while self._done < self._length:  # past the end nothing is read: a late error cannot matter
            try:
                data = self._stream.read(n)
            except ObjectMissing:
                raise
            except StoreError as exc:
                self._resume(exc)
                continue
            self._done += len(data)
            return data
        return b""

    def _resume(self, exc: StoreError) -> None:
        if self._resumes <= 0 or self._cancelled():
            raise exc
        self._resumes -= 1
        log.warning("reading %s failed after %d of %d bytes (%s); resuming there",
                    self._name, self._done, self._length, exc.why)  # fmt: skip
        self._close_quietly()
        self._stream = self._open_at(self._offset + self._done, self._length - self._done)

    def _close_quietly(self) -> None:
        try:
            self._stream.close()
        except (OSError, StoreError):  # the connection is already gone
            pass

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> Resumable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Discard:
    """A sink for bytes that are only checked (verify and reindex hash blobs into nowhere)."""

    def write(self, data) -> int:
        return len(data)


def read_exact(stream, n: int, what: str, name: str) -> bytes:
    """Exactly `n` bytes, or IntegrityError naming `what` `name` as truncated."""
    parts, left = [], n
    while left:
        chunk = stream.read(min(left, 1024 * 1024))
        if not chunk:
            raise IntegrityError(what, name, f"is truncated ({n - left} of {n} bytes readable)")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def skip(stream, n: int, what: str, name: str) -> None:
    """Discard exactly `n` bytes (a gap between coalesced blobs)."""
    while n:
        chunk = stream.read(min(n, 1024 * 1024))
        if not chunk:
            raise IntegrityError(what, name, "is truncated")
        n -= len(chunk)
