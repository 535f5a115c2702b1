"""Reading blobs out of packs: each blob once, neighbours coalesced into one ranged read, and a
large blob's chunks read, decompressed and written in parallel.

Restore and verify both read this way. A caller hands in `place(entry, frame)`, which consumes
exactly one blob's compressed frame: bytes for a small blob, a stream for a large one (restore
decompresses it into a staged file, verify into nothing); both go through
kcache.packs.unpack_frame, which checks size and SHA-256.

A caller that also hands in `open_blob(entry)` (a file to write at offsets, or None to drop
the bytes) gets every chunked blob (kcache.packs: frames of CHUNK_BYTES plus a seek table) in
two phases, so one 1 GiB file uses every fetch thread and core instead of one stream:

    1. tables   the last bytes of each large blob (its seek table), `jobs` at a time
    2. chunks   each frame a ranged read of its own, decompressed and pwritten at its offset by
                whichever thread has it; the blob's SHA-256 runs over the chunks in order (a
                thread whose chunk is early waits its turn, so at most `jobs` chunks are held)
                and the file is closed once the last chunk hashes to the blob's id

A large blob without a seek table (a schema 1 pack) is streamed as one frame, as before.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import BinaryIO

from kcache import packs
from kcache.errors import IntegrityError
from kcache.manifest import Entry
from kcache.progress import Meter
from kcache.store import Store, pack_key
from kcache.streams import GuardedReader, Resumable, Window, read_exact, skip

COALESCE_GAP = 256 * 1024  # read through gaps smaller than this rather than issue another request
MAX_RANGE = 16 * 1024 * 1024
# A blob is decompressed in memory only when both its frame and its content are this small; any
# other is streamed. The content counts too: 300 MB of zeros compress to a few KiB.
IN_MEMORY_BLOB = 4 * 1024 * 1024
_TURN_POLL = 0.05  # seconds a thread waiting its turn to hash sleeps before it checks for cancellation

Place = Callable[[Entry, "bytes | BinaryIO"], None]
OpenBlob = Callable[[Entry], "BinaryIO | None"]


class Cancelled(Exception):
    """A sibling failed or the caller's budget ran out; this worker stopped at a blob boundary."""


@dataclass(frozen=True)
class Range:
    pack: str
    start: int
    end: int
    entries: tuple[Entry, ...]


def distinct(entries: Iterable[Entry]) -> list[Entry]:
    """One entry per blob (the first path that names it)."""
    firsts: dict[str, Entry] = {}
    for entry in entries:
        firsts.setdefault(entry.blob, entry)
    return list(firsts.values())


def plan_ranges(entries: Iterable[Entry]) -> list[Range]:
    """One read per run of nearby blobs in a pack; each blob once, however many paths use it."""
    by_pack: dict[str, list[Entry]] = defaultdict(list)
    for entry in distinct(entries):
        by_pack[entry.pack].append(entry)
    ranges: list[Range] = []
    for pack, items in by_pack.items():
        items.sort(key=lambda e: e.offset)
        group = [items[0]]
        for entry in items[1:]:
            end = group[-1].offset + group[-1].length
            if entry.offset - end <= COALESCE_GAP and entry.offset + entry.length - group[0].offset <= MAX_RANGE:
                group.append(entry)
            else:
                ranges.append(Range(pack, group[0].offset, end, tuple(group)))
                group = [entry]
        ranges.append(Range(pack, group[0].offset, group[-1].offset + group[-1].length, tuple(group)))
    return ranges


def fetch_blobs(
    store: Store,
    entries: Iterable[Entry],
    place: Place,
    *,
    jobs: int = 16,
    cancelled: Callable[[], bool] = bool,
    open_blob: OpenBlob | None = None,
    meter: Meter | None = None,
) -> None:
    """Hand every distinct blob's frame to `place`, `jobs` reads at a time; the first error wins.

    With `open_blob`, chunked blobs are written through it instead, chunk by chunk in parallel.
    `meter` counts each blob (and each chunk's bytes) once it is verified and placed.
    """
    blobs = distinct(entries)
    stop = threading.Event()
    halt = lambda: stop.is_set() or cancelled()
    meter = meter or Meter("fetching", files=0, bytes=0)
    large = [e for e in blobs if open_blob is not None and e.size > packs.CHUNK_BYTES]
    tables = run_all([partial(read_seek_table, store, e, halt) for e in large], jobs, stop)
    chunked = {e.blob for e, chunks in zip(large, tables) if chunks is not None}
    assemblies = [_Assembly(e, chunks, open_blob, meter) for e, chunks in zip(large, tables) if chunks is not None]
    tasks = [partial(read_chunk, store, a, i, halt) for a in assemblies for i in range(len(a.chunks))]
    counted = _counting(place, meter)
    tasks += [
        partial(read_range, store, rng, counted, halt) for rng in plan_ranges(e for e in blobs if e.blob not in chunked)
    ]
    try:
        run_all(tasks, jobs, stop)
    finally:
        for assembly in assemblies:
            assembly.close()


def _counting(place: Place, meter: Meter) -> Place:
    def counted(entry: Entry, frame) -> None:
        place(entry, frame)
        meter.add(files=1, bytes=entry.size)

    return counted


def run_all(tasks: Sequence[Callable[[], object]], jobs: int, stop: threading.Event) -> list:
    """Run `tasks` on `jobs` threads, in order of the list; their results, or the first error.

    Workers are daemon threads: a read hung on the network must not keep the process alive after
    the caller gave up (a ThreadPoolExecutor's threads are joined at interpreter exit).
    """
    todo: queue.Queue[int] = queue.Queue()
    for i in range(len(tasks)):
        todo.put(i)
    results: list = [None] * len(tasks)
    errors: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            try:
                i = todo.get_nowait()
            except queue.Empty:
                return
            try:
                results[i] = tasks[i]()
            except BaseException as exc:  # handed to the caller below
                errors.append(exc)
                stop.set()  # the others stop at their next blob

    threads = [threading.Thread(target=worker, daemon=True, name="kcache-fetch")
               for _ in range(max(1, min(jobs, len(tasks))))]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Report the failure that stopped the others, not a sibling's cancellation.
    for error in sorted(errors, key=lambda e: isinstance(e, Cancelled)):
        raise error
    return results


def open_pack(store: Store, pack: str, offset: int, length: int, cancelled: Callable[[], bool]) -> Resumable:
    """`length` bytes of a pack from `offset`, resumed where a cut connection stopped them."""
    key = pack_key(pack)

    def open_at(at: int, n: int) -> GuardedReader:
        return GuardedReader(store.open_range(key, at, n), store.url, key)

    return Resumable(open_at(offset, length), open_at, offset, length, cancelled=cancelled, name=key)


def read_seek_table(store: Store, entry: Entry, cancelled: Callable[[], bool]) -> tuple[packs.Chunk, ...] | None:
    """The chunks of a large blob from its last bytes, or None when it is one frame."""
    if cancelled():
        raise Cancelled()
    tail = _read_tail(store, entry, min(entry.length, packs.SEEK_TAIL_GUESS), cancelled)
    span = packs.seek_table_span(tail)
    if span is not None and len(tail) < span <= entry.length:  # a table longer than the guess: read all of it
        tail = _read_tail(store, entry, span, cancelled)
    return packs.parse_seek_table(tail, entry.length, entry.size)


def _read_tail(store: Store, entry: Entry, n: int, cancelled: Callable[[], bool]) -> bytes:
    with open_pack(store, entry.pack, entry.offset + entry.length - n, n, cancelled) as stream:
        return read_exact(stream, n, "pack", entry.pack)


def read_chunk(store: Store, assembly: _Assembly, index: int, cancelled: Callable[[], bool]) -> None:
    """Fetch, decompress and write one chunk, then hash it in its turn."""
    if cancelled():
        raise Cancelled()
    entry, chunk = assembly.entry, assembly.chunks[index]
    with open_pack(store, entry.pack, entry.offset + chunk.offset, chunk.length, cancelled) as stream:
        frame = read_exact(stream, chunk.length, "pack", entry.pack)
    data = packs.unpack_chunk(frame, entry.blob, chunk.size)
    del frame  # held no longer than needed: a waiting thread keeps only the content
    assembly.write(chunk.start, data)
    assembly.hash_in_turn(index, data, cancelled)


class _Assembly:
    """One chunked blob: written at offsets by many threads, hashed in order, closed once verified."""

    def __init__(self, entry: Entry, chunks: tuple[packs.Chunk, ...], open_blob: OpenBlob, meter: Meter):
        self.entry, self.chunks, self._open, self._meter = entry, chunks, open_blob, meter
        self._lock = threading.Lock()
        self._turn = threading.Condition()
        self._next = 0
        self._digest = hashlib.sha256()
        self._file: BinaryIO | None = None
        self._opened = False

    def write(self, start: int, data: bytes) -> None:
        with self._lock:  # opened on the first chunk: only blobs in flight hold a descriptor
            if not self._opened:
                self._file, self._opened = self._open(self.entry), True
            fd = None if self._file is None else self._file.fileno()
        if fd is None:
            return
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, start)
            view, start = view[written:], start + written

    def hash_in_turn(self, index: int, data: bytes, cancelled: Callable[[], bool]) -> None:
        with self._turn:
            while self._next != index:
                if cancelled():
                    raise Cancelled()
                self._turn.wait(_TURN_POLL)
        self._digest.update(data)  # only the thread holding turn `index` gets here
        self._meter.add(bytes=len(data))
        if index == len(self.chunks) - 1:
            self._finish()
        with self._turn:
            self._next += 1
            self._turn.notify_all()

    def _finish(self) -> None:
        actual = self._digest.hexdigest()
        if actual != self.entry.blob:
            raise IntegrityError("blob", self.entry.blob, f"content hashes to {actual}")
        self.close()
        self._meter.add(files=1)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_range(store: Store, rng: Range, place: Place, cancelled: Callable[[], bool]) -> None:
    """Hand each blob of one coalesced range to `place`, in pack order."""
    with open_pack(store, rng.pack, rng.start, rng.end - rng.start, cancelled) as stream:
        position = rng.start
        for entry in rng.entries:
            if cancelled():
                raise Cancelled()
            skip(stream, entry.offset - position, "pack", rng.pack)
            if entry.length <= IN_MEMORY_BLOB and entry.size <= IN_MEMORY_BLOB:
                place(entry, read_exact(stream, entry.length, "pack", rng.pack))
            else:
                window = Window(stream, entry.length)
                place(entry, window)
                skip(window, window.remaining, "pack", rng.pack)
            position = entry.offset + entry.length
