"""Bounded reads over byte streams (files, HTTP bodies): a reader can never run past a blob."""

from __future__ import annotations

from typing import BinaryIO

from kcache.errors import IntegrityError, StoreError


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
