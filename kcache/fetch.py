"""Reading blobs out of packs: each blob once, neighbours coalesced into one ranged read.

Restore and verify both read this way. A caller hands in `place(entry, frame)`, which consumes
exactly one blob's compressed frame: bytes for a small blob, a stream for a large one (restore
decompresses it into a staged file, verify into nothing); both go through
kcache.packs.unpack_frame, which checks size and SHA-256.
"""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import BinaryIO

from kcache.manifest import Entry
from kcache.store import Store, pack_key
from kcache.streams import GuardedReader, Resumable, Window, read_exact, skip

COALESCE_GAP = 256 * 1024  # read through gaps smaller than this rather than issue another request
MAX_RANGE = 16 * 1024 * 1024
# A blob is decompressed in memory only when both its frame and its content are this small; any
# other is streamed. The content counts too: 300 MB of zeros compress to a few KiB.
IN_MEMORY_BLOB = 4 * 1024 * 1024

Place = Callable[[Entry, "bytes | BinaryIO"], None]


class Cancelled(Exception):
    """A sibling failed or the caller's budget ran out; this worker stopped at a blob boundary."""


@dataclass(frozen=True)
class Range:
    pack: str
    start: int
    end: int
    entries: tuple[Entry, ...]


def plan_ranges(entries: Iterable[Entry]) -> list[Range]:
    """One read per run of nearby blobs in a pack; each blob once, however many paths use it."""
    firsts: dict[str, Entry] = {}
    for entry in entries:
        firsts.setdefault(entry.blob, entry)
    by_pack: dict[str, list[Entry]] = defaultdict(list)
    for entry in firsts.values():
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
    store: Store, entries: Iterable[Entry], place: Place, *, jobs: int = 16, cancelled: Callable[[], bool] = bool
) -> None:
    """Hand every distinct blob's frame to `place`, `jobs` ranges at a time; the first error wins.

    Workers are daemon threads: a read hung on the network must not keep the process alive after
    the caller gave up (a ThreadPoolExecutor's threads are joined at interpreter exit).
    """
    todo: queue.Queue[Range] = queue.Queue()
    for rng in plan_ranges(entries):
        todo.put(rng)
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        while not stop.is_set():
            try:
                rng = todo.get_nowait()
            except queue.Empty:
                return
            try:
                read_range(store, rng, place, lambda: stop.is_set() or cancelled())
            except BaseException as exc:  # handed to the caller below
                errors.append(exc)
                stop.set()  # the others stop at their next blob

    threads = [threading.Thread(target=worker, daemon=True, name="kcache-fetch") for _ in range(max(1, jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # Report the failure that stopped the others, not a sibling's cancellation.
    for error in sorted(errors, key=lambda e: isinstance(e, Cancelled)):
        raise error


def read_range(store: Store, rng: Range, place: Place, cancelled: Callable[[], bool]) -> None:
    key = pack_key(rng.pack)

    def open_at(offset: int, length: int) -> GuardedReader:
        return GuardedReader(store.open_range(key, offset, length), store.url, key)

    length = rng.end - rng.start
    first = open_at(rng.start, length)
    with Resumable(first, open_at, rng.start, length, cancelled=cancelled, name=key) as stream:
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
