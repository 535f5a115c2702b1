"""Reading blobs out of packs: each blob once, neighbours coalesced into one ranged read, and a
large blob's chunks read, decompressed and written in parallel.

Restore and verify both read this way. A caller hands in `place(entry, frame)`, which consumes
exactly one blob's compressed frame: bytes for a small blob, a stream for a large one (restore
decompresses it into a staged file, verify into nothing); both go through
kcache.packs.unpack_frame, which checks size and SHA-256.

A caller that also hands in `open_blob(entry)` (a new file, open for reading and writing) and the
manifest's chunk digests gets each large chunked blob (kcache.packs: frames of CHUNK_BYTES plus a
seek table; kcache.manifest: the SHA-256 of each CHUNK_BYTES of content) split into parts, so one
1 GiB file uses every fetch thread and core instead of one stream:

    1. tables   the last bytes of each blob to split (its seek table), `jobs` at a time
    2. parts    runs of frames of even length, each one ranged read of about PART_BYTES and at most
                `jobs` per blob (every request has a fixed cost, on some servers one that grows with the
                object: moto copies the whole object for each ranged GET); whichever thread has a
                part decompresses its frames one at a time, hashes each chunk's content as it comes
                out of the decoder, pwrites it at its offset, and checks the chunk against its digest
    3. close    the file is closed once its last chunk is verified, whichever thread that is

Each chunk is verified where it is decompressed: no thread waits for another, nothing is read back,
and the work spreads over every core (with one SHA-256 chain over the whole blob, the 156 MB
precompiled header was hashed on one core while the other sat idle: 0.19 s of a restore, now ~0.13 s).
Only a blob too big for one thread's fair share is split (bigger than all the bytes over `jobs`,
and at least two parts): with many large blobs, one stream each keeps every thread busy with
fewer requests. Any other blob is streamed and its whole content hashed to its id, as is one without
a seek table (a schema 1 pack), without chunk digests (a schema 1 or 2 manifest), or whose frames do
not hold CHUNK_BYTES each (a pack some other writer framed differently).
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, BinaryIO

from kcache import packs
from kcache.errors import IntegrityError, StoreError
from kcache.manifest import Entry
from kcache.progress import Meter
from kcache.store import Store, pack_key
from kcache.streams import GuardedReader, Resumable, Window, read_exact, skip

COALESCE_GAP = 256 * 1024  # read through gaps smaller than this rather than issue another request
MAX_RANGE = 16 * 1024 * 1024
# A blob is decompressed in memory only when both its frame and its content are this small; any
# other is streamed. The content counts too: 300 MB of zeros compress to a few KiB.
IN_MEMORY_BLOB = 4 * 1024 * 1024
# Stored bytes per ranged read of a split blob: few requests, yet a 1 GiB file is 64 parallel reads.
PART_BYTES = 16 * 1024 * 1024
# Stored bytes of small blobs read in one piece and placed together (see read_range).
PLACE_BATCH = 2 * 1024 * 1024
# What the fetch threads together hold in read and decoder buffers (see _Memory). Each thread had held its
# own: 4 MiB read whole (twice, while its pieces were joined) or a decoder window of up to 8 MiB and two
# MiB of buffers, so 16 threads beside a manifest at the cap took restore to 315-381 MiB.
FETCH_BUFFER_BYTES = 48 * 1024 * 1024
_READ_PIECE = 1024 * 1024  # a stream's read into memory at a time, and the decoder's read and output buffers

Place = Callable[[Entry, "bytes | BinaryIO"], None]
OpenBlob = Callable[[Entry], "BinaryIO | None"]


class Cancelled(Exception):
    """A sibling failed or the caller's budget ran out; this worker stopped at a blob boundary."""


@dataclass(frozen=True, slots=True)  # one per read: a manifest at the cap may name ~160k packs
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


def pack_extents(entries: Iterable[Entry]) -> dict[str, int]:
    """Per pack, the largest offset+length `entries` name in it: how far into it a restore reads."""
    extents: dict[str, int] = {}
    for entry in entries:
        extents[entry.pack] = max(extents.get(entry.pack, 0), entry.offset + entry.length)
    return extents


def plan_ranges(entries: Iterable[Entry]) -> list[Range]:
    """One read per run of nearby blobs in a pack; each stored copy (pack, offset) once, however
    many paths name it. Restore passes one entry a blob (`distinct`); verify passes every copy."""
    # One sorted list, walked once: a dict of copies and a list per pack had held ~300 bytes an
    # entry at once, ~45 MiB for a manifest at the cap whose files name a pack each.
    ordered = sorted(entries, key=lambda e: (e.pack, e.offset, e.blob))
    ranges: list[Range] = []
    group: list[Entry] = []
    for entry in ordered:
        if group and (entry.pack, entry.offset, entry.blob) == (group[-1].pack, group[-1].offset, group[-1].blob):
            continue  # another path of a copy already planned
        if group:
            end = group[-1].offset + group[-1].length
            if (entry.pack == group[0].pack and entry.offset - end <= COALESCE_GAP
                    and entry.offset + entry.length - group[0].offset <= MAX_RANGE):  # fmt: skip
                group.append(entry)
                continue
            ranges.append(Range(group[0].pack, group[0].offset, end, tuple(group)))
        group = [entry]
    if group:
        ranges.append(Range(group[0].pack, group[0].offset, group[-1].offset + group[-1].length, tuple(group)))
    return ranges


def fetch_blobs(
    store: Store,
    entries: Iterable[Entry],
    place: Place,
    *,
    jobs: int = 16,
    cancelled: Callable[[], bool] = bool,
    open_blob: OpenBlob | None = None,
    closed: Callable[[Entry], None] = lambda _entry: None,
    meter: Meter | None = None,
    failed: Callable[[str], None] | None = None,
    digests: Mapping[str, Sequence[str]] | None = None,
) -> None:
    """Hand every distinct blob's frame to `place`, `jobs` reads at a time; the first error wins.

    With `open_blob` and `digests` (blob id -> the SHA-256 of each CHUNK_BYTES of its content, from
    the manifest), a blob worth splitting (see the module docstring) is written through the file it
    returns instead, in parts fetched in parallel, closed once verified and then handed to `closed`
    (for what must follow the last write: permissions, times). `meter`
    counts each blob (a split one also chunk by chunk) once it is verified and placed.
    `failed(pack)` hears of each pack whose read or content failed (StoreError, IntegrityError),
    before the error is raised: restore tells the node cache's bad copies from the store's by it.
    Every pack read goes through `open_pack`.
    """
    blobs = distinct(entries)
    announce = getattr(store, "expect_reads", None)  # the node cache sizes its fills by it
    if callable(announce):
        announce(pack_extents(blobs))
    stop = threading.Event()
    halt = lambda: stop.is_set() or cancelled()
    meter = meter or Meter("fetching", files=0, bytes=0)
    share = sum(e.size for e in blobs) / max(1, jobs)
    digests = digests if open_blob is not None else None
    split = [e for e in blobs if digests and splittable(e, digests) and e.size > share]
    tables = run_all([_telling(failed, e.pack, partial(read_seek_table, store, e, halt)) for e in split], jobs, stop)
    assemblies = [_Assembly(e, chunks, tuple(digests[e.blob]), jobs, open_blob, closed, meter)
                  for e, chunks in zip(split, tables) if _framed_by_chunk(chunks, e, digests[e.blob])]  # fmt: skip
    parts: list[Range | tuple[_Assembly, range]] = [(a, part) for a in assemblies for part in a.parts]
    whole = {a.entry.blob for a in assemblies}
    # Longest reads first: a big blob started last would finish alone.
    ranges = sorted(plan_ranges(e for e in blobs if e.blob not in whole), key=lambda r: r.start - r.end)
    counted = _counting(place, meter)
    placing = threading.Lock()
    memory = _Memory(FETCH_BUFFER_BYTES)

    def read(item: Range | tuple[_Assembly, range]) -> None:
        if isinstance(item, Range):
            task, pack = partial(read_range, store, item, counted, halt, placing, memory), item.pack
        else:
            task, pack = partial(_holding, memory, _part_cost(*item), halt, partial(read_part, store, *item, halt)), \
                item[0].entry.pack
        _telling(failed, pack, task)()

    try:
        run_all(_Calls(read, parts + ranges), jobs, stop)
    finally:
        for assembly in assemblies:
            assembly.close()


class _Calls(Sequence):
    """`call(item)` for each of `items`, as run_all's tasks: each made when a worker takes it. A
    closure held for every read (~540 bytes) had cost a restore 86 MiB for the ~160k reads of a
    manifest at the cap whose files name a pack each (a store writer's to write), past its bound."""

    def __init__(self, call: Callable[[Any], object], items: Sequence):
        self._call, self._items = call, items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index):  # an int: run_all takes one task at a time
        return partial(self._call, self._items[index])


def splittable(entry: Entry, digests: Mapping[str, Sequence[str]]) -> bool:
    """Whether some restore may split `entry`: it has chunk digests and fills two parts (whether one
    does also depends on the bundle: a blob within one thread's share is streamed)."""
    return entry.blob in digests and entry.size >= 2 * PART_BYTES


def read_split(store: Store, entry: Entry, digests: Sequence[str], *, jobs: int = 16,
               cancelled: Callable[[], bool] = bool) -> bool:  # fmt: skip
    """Read `entry` as a restore that splits it does (every part, each chunk checked against
    `digests`), its content written nowhere; False, with no part read, when no restore would split it
    (too small, or no seek table that frames it by CHUNK_BYTES). Raises what fails such a restore.

    For `kcache verify --read-data`: the whole stream hashing to the blob id says nothing of the
    seek table, and a table whose frame lengths were shifted (the frames themselves intact) fails
    every restore that splits the blob."""
    if not splittable(entry, {entry.blob: digests}):
        return False
    chunks = read_seek_table(store, entry, cancelled)
    if not _framed_by_chunk(chunks, entry, digests):
        return False
    assembly = _Assembly(entry, chunks, tuple(digests), jobs, lambda _entry: open(os.devnull, "wb"),
                         lambda _entry: None, Meter("verifying", files=0, bytes=0))  # fmt: skip
    try:
        run_all([partial(read_part, store, assembly, part, cancelled) for part in assembly.parts], jobs,
                threading.Event())  # fmt: skip
    finally:
        assembly.close()
    return True


def _telling(failed: Callable[[str], None] | None, pack: str, task: Callable[[], object]) -> Callable[[], object]:
    """`task`, which reads `pack`; a read or content failure is told to `failed` first."""
    if failed is None:
        return task

    def run():
        try:
            return task()
        except (StoreError, IntegrityError):
            failed(pack)
            raise

    return run


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


def read_seek_table(store: Store, entry: Entry, cancelled: Callable[[], bool]) -> packs.SeekTable | None:
    """The chunks of a large blob from its last bytes, or None when it is one frame."""
    if cancelled():
        raise Cancelled()
    tail = _read_tail(store, entry, min(entry.length, packs.SEEK_TAIL_GUESS), cancelled)
    span = packs.seek_table_span(tail)
    if span is not None and len(tail) < span <= min(entry.length, packs.seek_table_limit(entry.size)):
        # A table longer than the guess: read all of it, if the blob's size allows such a table.
        tail = _read_tail(store, entry, span, cancelled)
    return packs.parse_seek_table(tail, entry.length, entry.size)


def _read_tail(store: Store, entry: Entry, n: int, cancelled: Callable[[], bool]) -> bytes:
    with open_pack(store, entry.pack, entry.offset + entry.length - n, n, cancelled) as stream:
        return read_exact(stream, n, "pack", entry.pack)


def _framed_by_chunk(chunks: packs.SeekTable | None, entry: Entry, digests: Sequence[str]) -> bool:
    """Whether each frame of the blob holds the CHUNK_BYTES of content that a digest covers."""
    if not chunks or len(chunks) != len(digests):
        return False
    return all(c.start == i * packs.CHUNK_BYTES and c.size == min(packs.CHUNK_BYTES, entry.size - c.start)
               for i, c in enumerate(chunks))  # fmt: skip


def read_part(store: Store, assembly: _Assembly, part: range, cancelled: Callable[[], bool]) -> None:
    """Fetch one run of a split blob's frames with one read; decompress, verify and write each."""
    entry, chunks = assembly.entry, assembly.chunks
    first, last = chunks[part[0]], chunks[part[-1]]
    length = last.offset + last.length - first.offset
    with open_pack(store, entry.pack, entry.offset + first.offset, length, cancelled) as stream:
        for index in part:
            if cancelled():
                raise Cancelled()
            chunk = chunks[index]
            frame = Window(stream, chunk.length)
            digest = hashlib.sha256()
            at = [chunk.start]

            def write(piece: bytes, at=at, digest=digest) -> None:
                digest.update(piece)  # the decoder's buffer, still in cache: nothing is read back
                assembly.write(at[0], piece)
                at[0] += len(piece)

            packs.unpack_chunk_to(frame, entry.blob, chunk.size, write)
            skip(frame, frame.remaining, "pack", entry.pack)  # bytes past the frame's end: not content
            if digest.hexdigest() != assembly.digests[index]:
                raise IntegrityError("blob", entry.blob, f"chunk {index} hashes to {digest.hexdigest()}, "
                                     f"not the manifest's {assembly.digests[index]}")  # fmt: skip
            assembly.verified(index)


def _part_cost(assembly: _Assembly, part: range) -> int:
    """What reading `part` of a split blob holds: one frame decoded at a time."""
    return _decoding(min(packs.CHUNK_BYTES, assembly.entry.size))  # split only where each frame holds CHUNK_BYTES


def _holding(memory: _Memory, size: int, cancelled: Callable[[], bool], task: Callable[[], object]) -> object:
    with memory.hold(size, cancelled):
        return task()


def _decoding(size: int) -> int:
    """What decompressing a frame of `size` content bytes holds: its window (the decoder takes no more than
    the content, nor than packs.MAX_WINDOW) and a read and an output buffer."""
    return min(size, packs.MAX_WINDOW) + 2 * _READ_PIECE


class _Memory:
    """Bytes of buffers the fetch threads may hold together; a thread waits for its share before a read.
    One that asks for more than all of it runs alone."""

    def __init__(self, limit: int):
        self._limit, self._used = limit, 0
        self._changed = threading.Condition()

    @classmethod
    def unbounded(cls) -> _Memory:
        return cls(2**62)

    @contextmanager
    def hold(self, size: int, cancelled: Callable[[], bool]) -> Iterator[None]:
        size = min(size, self._limit)
        with self._changed:
            while self._used and self._used + size > self._limit:
                if cancelled():
                    raise Cancelled()
                self._changed.wait(0.05)  # and look at `cancelled` again: nobody notifies a budget's end
            self._used += size
        try:
            yield
        finally:
            with self._changed:
                self._used -= size
                self._changed.notify_all()


def _parts(chunks: Sequence[packs.Chunk], jobs: int) -> tuple[range, ...]:
    """Consecutive chunks in as many runs as PART_BYTES of stored bytes each makes, `jobs` at most,
    as even as whole frames allow: 21 MiB in two reads is 10.5 + 10.5, not 16 + 5, which on two
    cores left one thread decompressing alone for most of the blob's time. Each run is a range of
    chunk indices: a list of them had cost ~36 bytes a frame, and a table may hold ~500k frames."""
    lengths = chunks.lengths() if isinstance(chunks, packs.SeekTable) else [c.length for c in chunks]
    total = sum(lengths)
    count = max(1, min(jobs, -(-total // PART_BYTES)))
    firsts = [0] * count  # the first chunk of each part; a part no frame falls in is empty
    seen = [False] * count
    done = 0
    for i, length in enumerate(lengths):  # a frame goes to the part its middle byte falls in
        part = min(count - 1, (2 * done + length) * count // (2 * max(1, total)))
        if not seen[part]:
            firsts[part], seen[part] = i, True
        done += length
    starts = [firsts[p] for p in range(count) if seen[p]]
    return tuple(range(a, b) for a, b in zip(starts, [*starts[1:], len(lengths)]))


class _Assembly:
    """One split blob: written at offsets by many threads, each chunk verified by the thread that
    wrote it, closed once all of them are."""

    def __init__(self, entry: Entry, chunks: Sequence[packs.Chunk], digests: tuple[str, ...], jobs: int,
                 open_blob: OpenBlob, closed: Callable[[Entry], None], meter: Meter):  # fmt: skip
        self.entry, self.chunks, self.digests, self.parts = entry, chunks, digests, _parts(chunks, jobs)
        self._open, self._closed, self._meter = open_blob, closed, meter
        self._lock = threading.Lock()
        self._left = len(chunks)  # chunks not yet verified
        self._file: BinaryIO | None = None
        self._opened = False

    def write(self, start: int, data: bytes) -> None:
        with self._lock:  # opened on the first chunk: only blobs in flight hold a descriptor
            if not self._opened:
                self._file, self._opened = self._open(self.entry), True
            fd = self._file.fileno()
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, start)
            view, start = view[written:], start + written

    def verified(self, index: int) -> None:
        """Chunk `index` is written and matches its digest; after the last one, close the file."""
        self._meter.add(bytes=self.chunks[index].size)
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self.close()
            self._closed(self.entry)
            self._meter.add(files=1)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_range(store: Store, rng: Range, place: Place, cancelled: Callable[[], bool],
               placing: threading.Lock | None = None, memory: _Memory | None = None) -> None:  # fmt: skip
    """Hand each blob of one coalesced range to `place`, in pack order.

    Small blobs go in runs: one read of up to PLACE_BATCH bytes, then every blob of the run placed
    while holding `placing`. Placing small blobs is Python's work per file (decompress, hash, create,
    write); threads doing it side by side only hand the GIL and the directories' locks to one another
    (20k files restored in 5.5 s on 16 threads, 2.5 s on one), while those waiting keep reading.
    """
    placing = placing or threading.Lock()
    memory = memory or _Memory.unbounded()
    entries = rng.entries
    with open_pack(store, rng.pack, rng.start, rng.end - rng.start, cancelled) as stream:
        position, i = rng.start, 0
        while i < len(entries):
            if cancelled():
                raise Cancelled()
            entry = entries[i]
            if entry.offset < position:  # an honest pack never has two blobs in the same bytes
                raise IntegrityError("pack", rng.pack, f"blob {entry.blob[:12]} overlaps the blob before it")
            if not _in_memory(entry):
                skip(stream, entry.offset - position, "pack", rng.pack)
                window = Window(stream, entry.length)
                with memory.hold(_decoding(entry.size), cancelled):
                    place(entry, window)
                skip(window, window.remaining, "pack", rng.pack)
                position, i = entry.offset + entry.length, i + 1
                continue
            run = _small_run(entries, i, position)
            end = max(e.offset + e.length for e in run)
            with memory.hold(end - position + _READ_PIECE, cancelled):
                _place_run(stream, rng.pack, run, position, end, place, cancelled, placing)
            position, i = end, i + len(run)


def _place_run(stream, pack: str, run: Sequence[Entry], position: int, end: int, place: Place,
               cancelled: Callable[[], bool], placing: threading.Lock) -> None:  # fmt: skip
    """Read a run's bytes into one buffer (a piece at a time: pieces joined had held them twice), then place
    each of its blobs while holding `placing`."""
    data = bytearray(end - position)
    view, got = memoryview(data), 0
    while got < len(data):
        piece = stream.read(min(len(data) - got, _READ_PIECE))
        if not piece:
            raise IntegrityError("pack", pack, f"is truncated ({got} of {len(data)} bytes readable)")
        view[got : got + len(piece)] = piece
        got += len(piece)
    with placing:
        for item in run:
            if cancelled():
                raise Cancelled()
            place(item, bytes(data[item.offset - position : item.offset - position + item.length]))


def _in_memory(entry: Entry) -> bool:
    return entry.length <= IN_MEMORY_BLOB and entry.size <= IN_MEMORY_BLOB


def _small_run(entries: Sequence[Entry], first: int, position: int) -> Sequence[Entry]:
    """The blobs from `first` on (a range's, in offset order) read in one piece: small, ending within
    PLACE_BATCH of `position`."""
    last = first + 1
    while (last < len(entries) and _in_memory(entries[last])
           and entries[last].offset + entries[last].length - position <= PLACE_BATCH):  # fmt: skip
        last += 1
    return entries[first:last]
