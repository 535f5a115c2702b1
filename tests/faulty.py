"""Store wrappers that damage what `open_range` returns (fault injection by wrapping a backend),
or count what a reader takes (CountingStore).

Each wrapper delegates everything to the real store and changes only the bytes (or the failure)
of range reads, so the code under test reads through its ordinary path.
"""

from __future__ import annotations

from collections.abc import Callable


class _DamagedStream:
    """`length` bytes of `inner`, passed through `damage(position, chunk)` on the way out."""

    def __init__(self, inner, damage: Callable[[int, bytes], bytes]):
        self._inner, self._damage, self._position = inner, damage, 0

    def read(self, n: int = -1) -> bytes:
        chunk = self._inner.read(n)
        out = self._damage(self._position, chunk)
        self._position += len(chunk)
        return out

    def close(self) -> None:
        self._inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RangeFaultStore:
    """Wraps a store; every range read goes through `damage(length)` -> a chunk transformer."""

    def __init__(self, inner, make_damage: Callable[[int], Callable[[int, bytes], bytes]]):
        self.inner, self._make_damage, self.url = inner, make_damage, inner.url
        self.reads = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_range(self, key, offset, length):
        self.reads += 1
        return _DamagedStream(self.inner.open_range(key, offset, length), self._make_damage(length))


def corrupting(inner) -> RangeFaultStore:
    """Flips one bit in the middle of every range read."""

    def make(length: int):
        target = length // 2

        def damage(position: int, chunk: bytes) -> bytes:
            if position <= target < position + len(chunk):
                data = bytearray(chunk)
                data[target - position] ^= 0x10
                return bytes(data)
            return chunk

        return damage

    return RangeFaultStore(inner, make)


def truncating(inner) -> RangeFaultStore:
    """Every range read ends (EOF) halfway, as a connection closed early would."""

    def make(length: int):
        keep = length // 2

        def damage(position: int, chunk: bytes) -> bytes:
            return chunk[: max(0, keep - position)]

        return damage

    return RangeFaultStore(inner, make)


def raising(inner, error: Callable[[], BaseException]) -> RangeFaultStore:
    """Every range read raises `error()` once half of it has been delivered."""

    def make(length: int):
        half = length // 2

        def damage(position: int, chunk: bytes) -> bytes:
            if position >= half:
                raise error()
            return chunk[: half - position]  # the first half arrives; the next read fails

        return damage

    return RangeFaultStore(inner, make)


class CountingStore:
    """Wraps a store and counts the bytes each key prefix (refs, manifests, ...) returned."""

    def __init__(self, inner):
        self.inner, self.url = inner, inner.url
        self.read: dict[str, int] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _count(self, key: str, n: int) -> None:
        top = key.split("/", 1)[0]
        self.read[top] = self.read.get(top, 0) + n

    def get_bytes(self, key):
        data = self.inner.get_bytes(key)
        self._count(key, len(data))
        return data

    def get_versioned(self, key, limit=None):
        current = self.inner.get_versioned(key, limit)
        if current:
            self._count(key, len(current[0]))
        return current

    def open_range(self, key, offset, length):
        stream, count = self.inner.open_range(key, offset, length), self._count

        class Counted:
            def read(self, n=-1):
                data = stream.read(n)
                count(key, len(data))
                return data

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                stream.close()

            def close(self):
                stream.close()

        return Counted()
