"""Large blobs are stored as chunks and fetched in parts, in parallel, each chunk verified by its digest.

Chunk and part sizes are shrunk to a few KiB here, so small files exercise every path a multi-GiB
one takes: seek tables longer than the first tail read, a short last chunk, a short last part.
"""

from __future__ import annotations

import hashlib
import io
import random
import struct
import subprocess
import threading

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kcache import fetch, packs
from kcache.errors import IntegrityError
from kcache.manifest import Entry
from kcache.store import pack_key

CHUNK = 4096


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(packs, "CHUNK_BYTES", CHUNK)
    monkeypatch.setattr(packs, "SEEK_TAIL_GUESS", 64)  # a table of more than 5 frames takes a second read
    monkeypatch.setattr(fetch, "PART_BYTES", 2 * CHUNK + 200)  # two frames of the kernel-like content a part


class Recording:
    """A store that remembers every range read (offset, length) and what else was asked of it."""

    def __init__(self, inner):
        self._inner, self.ranges, self.lock = inner, [], threading.Lock()
        self.url = inner.url

    def open_range(self, key, offset, length):
        with self.lock:
            self.ranges.append((offset, length))
        return self._inner.open_range(key, offset, length)


def content(seed: int, size: int) -> bytes:
    rng = random.Random(seed)
    return b"".join(rng.randbytes(64) + b"kernel " * rng.randrange(20) for _ in range(size // 64 + 1))[:size]


# blob id -> the digests of its CHUNK-byte pieces, as a manifest carries them: publish_blob fills it.
DIGESTS: dict[str, tuple[str, ...]] = {}


def digests_of(data: bytes) -> tuple[str, ...]:
    return tuple(hashlib.sha256(data[i : i + CHUNK]).hexdigest() for i in range(0, len(data), CHUNK))


def publish_blob(store, workdir, data: bytes, pool=None) -> Entry:
    """`data` as the only blob of a pack in `store`; the manifest entry that names it."""
    source = workdir / "src"
    source.write_bytes(data)
    blob = hashlib.sha256(data).hexdigest()
    writer = packs.PackWriter(workdir, pool)
    writer.add(blob, source, len(data))
    pack = writer.finish()
    store.put_file(pack_key(pack.id), pack.path)
    (where,) = pack.blobs
    DIGESTS[blob] = digests_of(data)
    return Entry("triton/big.cubin", 0o644, len(data), blob, pack.id, where.offset, where.length)


def fetch_into(store, entry: Entry, out_path, jobs: int = 8, digests=DIGESTS) -> None:
    def place(_entry, frame):
        with open(out_path, "wb") as out:
            packs.unpack_frame(frame, entry.blob, entry.size, out)

    # Write-only: a split blob is verified as it is decompressed, never read back.
    fetch.fetch_blobs(store, [entry], place, jobs=jobs, open_blob=lambda _e: open(out_path, "wb"), digests=digests)


def test_a_large_file_is_written_as_frames_of_chunk_bytes_with_a_seek_table(tmp_path, store):
    data = content(1, 5 * CHUNK + 100)
    entry = publish_blob(store, tmp_path, data)
    stored = store.get_bytes(pack_key(entry.pack))[entry.offset : entry.offset + entry.length]
    chunks = packs.parse_seek_table(stored, entry.length, entry.size)
    assert [c.size for c in chunks] == [CHUNK] * 5 + [100]
    for chunk in chunks:  # each frame stands alone
        frame = stored[chunk.offset : chunk.offset + chunk.length]
        assert zstandard.ZstdDecompressor().decompress(frame) == data[chunk.start : chunk.start + chunk.size]
    # Read front to back the frames are the file (the table is a skippable frame): for zstd's CLI too.
    assert subprocess.run(["zstd", "-dc"], input=stored, capture_output=True, check=True).stdout == data
    out = io.BytesIO()
    packs.unpack_to(io.BytesIO(stored), entry.blob, entry.size, out)
    assert out.getvalue() == data


def test_a_blob_is_split_into_parts_of_whole_frames_each_its_own_read(tmp_path, store):
    data = content(2, 9 * CHUNK + 1)
    entry = publish_blob(store, tmp_path, data)
    recording = Recording(store)
    fetch_into(recording, entry, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == data
    stored = store.get_bytes(pack_key(entry.pack))[entry.offset :][: entry.length]
    chunks = packs.parse_seek_table(stored, entry.length, entry.size)
    parts = fetch._parts(chunks, 8)
    assert len(parts) >= 2 and sorted(i for part in parts for i in part) == list(range(len(chunks)))
    expected = {(entry.offset + chunks[p[0]].offset, sum(chunks[i].length for i in p)) for p in parts}
    assert expected <= set(recording.ranges)
    # Tails: the first guess, then the whole table (ten frames do not fit in 64 bytes).
    assert len(recording.ranges) == len(parts) + 2


def test_a_blob_within_one_threads_share_is_streamed_whole(tmp_path, store):
    entries = [publish_blob(store, tmp_path, content(30 + i, 5 * CHUNK)) for i in range(4)]
    recording = Recording(store)
    written = []

    def place(entry, frame):
        out = io.BytesIO()
        packs.unpack_frame(frame, entry.blob, entry.size, out)
        written.append(out.getvalue())

    fetch.fetch_blobs(recording, entries, place, jobs=2, open_blob=lambda e: pytest.fail("split a blob"),
                      digests=DIGESTS)  # fmt: skip
    assert len(recording.ranges) == 4  # one read per blob: no tail, no parts
    assert sorted(hashlib.sha256(w).hexdigest() for w in written) == sorted(e.blob for e in entries)


def test_chunks_compressed_in_a_pool_make_the_same_blob(tmp_path, store):
    from concurrent.futures import ThreadPoolExecutor

    data = content(3, 7 * CHUNK + 5)
    alone = publish_blob(store, tmp_path, data)
    with ThreadPoolExecutor(4) as pool:
        pooled = publish_blob(store, tmp_path, data, pool)
    assert pooled == alone  # same pack id: the pool changes the speed, never the bytes


def test_a_large_single_frame_blob_from_a_schema_1_pack_is_still_read(tmp_path, store):
    data = content(4, 3 * CHUNK)
    frame = zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)
    body = b'{"blobs":[["' + hashlib.sha256(data).hexdigest().encode() + b'",0,%d,%d]],"schema":1}' % (
        len(frame), len(data))  # fmt: skip
    pack = frame + body + len(body).to_bytes(8, "big") + packs.MAGIC
    pack_id = hashlib.sha256(pack).hexdigest()
    store.put_bytes(pack_key(pack_id), pack)
    (blob,) = packs.parse_trailer(pack_id, pack, len(pack))
    entry = Entry("triton/old", 0o644, blob.size, blob.id, pack_id, blob.offset, blob.length)
    fetch_into(store, entry, tmp_path / "out")
    assert (tmp_path / "out").read_bytes() == data


def test_a_chunk_whose_content_is_wrong_fails_the_blob(tmp_path, store):
    data = content(5, 4 * CHUNK)
    entry = publish_blob(store, tmp_path, data)
    pack = bytearray(store.get_bytes(pack_key(entry.pack)))
    # Swap the first two frames' content by recompressing them in the other order: every frame
    # and the table stay valid, only the whole-file hash can tell.
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=True)
    swapped = data[CHUNK : 2 * CHUNK] + data[:CHUNK] + data[2 * CHUNK :]
    frames = [cctx.compress(swapped[i : i + CHUNK]) for i in range(0, len(swapped), CHUNK)]
    blob = b"".join(frames) + packs.seek_table([(len(f), CHUNK) for f in frames])
    forged = bytes(pack[: entry.offset]) + blob
    store.put_bytes(pack_key("f" * 64), forged)
    lying = Entry(entry.path, entry.mode, entry.size, entry.blob, "f" * 64, entry.offset, len(blob))
    with pytest.raises(IntegrityError, match="hashes to"):
        fetch_into(store, lying, tmp_path / "out")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(CHUNK + 1, 12 * CHUNK), seed=st.integers(0, 2**16), flip=st.integers(0, 2**32),
       jobs=st.integers(1, 8))  # fmt: skip
def test_any_damaged_byte_fails_the_fetch_or_changes_nothing(tmp_path_factory, size, seed, flip, jobs):
    """A flipped byte anywhere in a chunked blob (frames, table, footer) never yields other content."""
    from kcache.store.local import LocalStore

    work = tmp_path_factory.mktemp("blob")
    store = LocalStore(work / "store")
    data = content(seed, size)
    entry = publish_blob(store, work, data)
    pack = bytearray(store.get_bytes(pack_key(entry.pack)))
    at = entry.offset + flip % entry.length
    pack[at] ^= 1 << (flip % 8)
    store.put_bytes(pack_key("e" * 64), bytes(pack))
    damaged = Entry(entry.path, entry.mode, entry.size, entry.blob, "e" * 64, entry.offset, entry.length)
    out = work / "out"
    try:
        fetch_into(store, damaged, out, jobs)
    except IntegrityError:
        return
    assert out.read_bytes() == data


def test_a_failed_chunk_stops_the_others_and_closes_every_file(tmp_path, store):
    entries = [publish_blob(store, tmp_path, content(10 + i, 8 * CHUNK)) for i in range(4)]
    opened = []

    class Broken(Recording):
        def open_range(self, key, offset, length):
            if key == pack_key(entries[2].pack) and length > 1000:
                raise IntegrityError("pack", key, "injected")
            return super().open_range(key, offset, length)

    def open_blob(entry):
        opened.append(open(tmp_path / entry.blob, "w+b"))
        return opened[-1]

    with pytest.raises(IntegrityError, match="injected"):
        fetch.fetch_blobs(Broken(store), entries, lambda e, f: None, jobs=8, open_blob=open_blob, digests=DIGESTS)
    assert opened and all(f.closed for f in opened)


def test_the_meter_counts_every_chunk_and_file(tmp_path, store):
    from kcache.progress import Meter

    entries = [publish_blob(store, tmp_path, content(20 + i, 5 * CHUNK + i)) for i in range(2)]
    entries.append(publish_blob(store, tmp_path, content(22, 100)))  # and one streamed whole
    updates = []
    with Meter("fetching", files=3, bytes=sum(e.size for e in entries), report=updates.append) as meter:
        fetch.fetch_blobs(store, entries, lambda e, f: None, jobs=8, meter=meter,
                          open_blob=lambda e: open(tmp_path / e.blob, "w+b"), digests=DIGESTS)  # fmt: skip
    assert meter.counts == (3, sum(e.size for e in entries))
    assert updates[-1].done and (updates[-1].files, updates[-1].bytes) == meter.counts


def test_a_part_read_cut_once_resumes_and_the_blob_is_whole(tmp_path, store):
    from faulty import RangeFaultStore

    from kcache.errors import StoreError

    data = content(40, 11 * CHUNK + 7)
    entry = publish_blob(store, tmp_path, data)
    cuts = []

    def make(length: int):
        def damage(position: int, chunk: bytes) -> bytes:
            if length > 2 * CHUNK and not cuts and position + len(chunk) > length // 2:
                cuts.append(position)
                raise StoreError(store.url, "connection reset (injected)")
            return chunk

        return damage

    fetch_into(RangeFaultStore(store, make), entry, tmp_path / "out", jobs=4)
    assert cuts and (tmp_path / "out").read_bytes() == data


def test_a_split_blob_is_handed_to_closed_once_its_file_is_verified_and_closed(tmp_path, store):
    entries = [publish_blob(store, tmp_path, content(50 + i, 8 * CHUNK)) for i in range(2)]
    files, handed = {}, []

    def open_blob(entry):
        files[entry.blob] = open(tmp_path / entry.blob, "w+b")
        return files[entry.blob]

    def closed(entry):
        assert files[entry.blob].closed
        assert hashlib.sha256((tmp_path / entry.blob).read_bytes()).hexdigest() == entry.blob
        handed.append(entry.blob)

    fetch.fetch_blobs(store, entries, lambda e, f: pytest.fail("streamed"), jobs=8, open_blob=open_blob, closed=closed,
                      digests=DIGESTS)  # fmt: skip
    assert sorted(handed) == sorted(e.blob for e in entries)


def _small_pack(store, workdir, contents: list[bytes]) -> list[Entry]:
    """`contents` as small blobs of one pack in `store`: their manifest entries, in pack order."""
    writer = packs.PackWriter(workdir)
    files = []
    for i, data in enumerate(contents):
        (workdir / f"s{i}").write_bytes(data)
        files.append((hashlib.sha256(data).hexdigest(), workdir / f"s{i}", len(data)))
    writer.add_small(files)
    pack = writer.finish()
    store.put_file(pack_key(pack.id), pack.path)
    return [Entry(f"inductor/f{i}", 0o644, b.size, b.id, pack.id, b.offset, b.length) for i, b in enumerate(pack.blobs)]


def test_small_blobs_are_read_in_runs_and_placed_one_thread_at_a_time(tmp_path, store, monkeypatch):
    """Runs of at most PLACE_BATCH stored bytes: one ranged read of the pack, several reads of the
    stream each; placing never runs in two threads at once, and every blob arrives once, whole."""
    monkeypatch.setattr(fetch, "PLACE_BATCH", 3000)
    monkeypatch.setattr(fetch, "MAX_RANGE", 9000)  # several ranges, so several threads place
    contents = [content(seed, 700 + seed * 13) for seed in range(60)]
    entries = _small_pack(store, tmp_path, contents)
    recording = Recording(store)
    placed, inside, overlapped = {}, [0], []
    lock = threading.Lock()

    def place(entry, frame):
        with lock:
            inside[0] += 1
            overlapped.append(inside[0] > 1)
        placed[entry.blob] = packs.unpack_bytes(frame, entry.blob, entry.size)
        with lock:
            inside[0] -= 1

    fetch.fetch_blobs(recording, entries, place, jobs=4)
    assert [placed[e.blob] for e in entries] == contents
    assert not any(overlapped)
    assert 1 < len(recording.ranges) < len(entries)


def test_blobs_that_overlap_in_a_pack_are_refused(tmp_path, store, monkeypatch):
    """An honest pack never puts two blobs in the same bytes. A hostile manifest that says so fails
    the fetch: once the stream has passed those bytes it is refused by name (it is never read
    backwards), and within one run its bytes are read as they lie and fail their hash."""
    first, second = _small_pack(store, tmp_path, [content(1, 2000), content(2, 2000)])
    liar = Entry("inductor/liar", 0o644, second.size, second.blob, first.pack, first.offset + 10, second.length)
    check = lambda e, f: packs.unpack_bytes(f, e.blob, e.size)  # noqa: E731
    monkeypatch.setattr(fetch, "PLACE_BATCH", 1)  # one blob a run
    with pytest.raises(IntegrityError, match="overlaps the blob before it"):
        fetch.fetch_blobs(store, [first, liar], check, jobs=1)
    monkeypatch.setattr(fetch, "PLACE_BATCH", 1 << 20)
    with pytest.raises(IntegrityError, match="hashes to|not a valid zstd frame|decompresses"):
        fetch.fetch_blobs(store, [first, liar], check, jobs=1)


def test_a_footer_claiming_a_table_as_long_as_the_blob_costs_no_more_than_an_honest_table(tmp_path, store):
    # A store writer rewrites a big blob's last 9 bytes so the seek table "spans" the whole blob:
    # read whole, that is the blob in memory (twice, while joined) before a byte is verified.
    data = content(11, 40 * CHUNK)
    entry = publish_blob(store, tmp_path, data)
    pack = bytearray(store.get_bytes(pack_key(entry.pack)))
    count = (entry.length - 17) // 8
    end = entry.offset + entry.length
    pack[end - 9 : end] = struct.pack("<IBI", count, 0, packs.SEEKABLE_MAGIC)
    store.put_bytes(pack_key("e" * 64), bytes(pack))
    lying = Entry(entry.path, entry.mode, entry.size, entry.blob, "e" * 64, entry.offset, entry.length)
    recording = Recording(store)
    assert fetch.read_seek_table(recording, lying, bool) is None
    honest = packs.seek_table_limit(entry.size)
    assert honest == len(packs.seek_table([(1, CHUNK)] * 40))
    assert max(n for _, n in recording.ranges) <= max(honest, packs.SEEK_TAIL_GUESS)


def test_a_table_of_more_frames_than_the_content_needs_is_not_used(tmp_path, store):
    data = content(12, 3 * CHUNK)
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=True)
    pieces = [data[i : i + CHUNK // 2] for i in range(0, len(data), CHUNK // 2)]  # frames half as big as ours
    frames = [cctx.compress(p) for p in pieces]
    blob = b"".join(frames) + packs.seek_table([(len(f), len(p)) for f, p in zip(frames, pieces)])
    assert packs.parse_seek_table(blob, len(blob), len(data)) is None


def chunks_of(lengths):
    """A seek table's chunks with these stored lengths (content 4x each)."""
    chunks, offset, start = [], 0, 0
    for length in lengths:
        chunks.append(packs.Chunk(offset, length, start, 4 * length))
        offset, start = offset + length, start + 4 * length
    return tuple(chunks)


@pytest.mark.parametrize(("lengths", "jobs", "count"), [
    ([1000] * 11, 8, 2),  # 11 frames, parts of at least 8392 stored bytes: two, not 8392 + the rest
    ([1000] * 11, 1, 1),
    ([1000] * 40, 4, 4),  # capped at one part per job
    ([5000, 100, 100, 100, 5000], 8, 2),
    ([100] * 3, 8, 1),
])  # fmt: skip
def test_a_split_blob_is_cut_into_parts_as_even_as_whole_frames_allow(lengths, jobs, count):
    chunks = chunks_of(lengths)
    parts = fetch._parts(chunks, jobs)
    assert [i for part in parts for i in part] == list(range(len(chunks)))  # every frame once, in order
    assert len(parts) == count
    sizes = [sum(chunks[i].length for i in part) for part in parts]
    assert max(sizes) - min(sizes) <= max(lengths)  # no part more than one frame longer than another


def streamed_whole(store, entry: Entry, digests) -> bytes:
    """What fetch_blobs hands `place` for `entry` when it does not split it (and fails the test if it does)."""
    out = io.BytesIO()
    fetch.fetch_blobs(store, [entry], lambda e, frame: packs.unpack_frame(frame, e.blob, e.size, out), jobs=8,
                      open_blob=lambda e: pytest.fail("split a blob"), digests=digests)  # fmt: skip
    return out.getvalue()


def test_a_blob_without_chunk_digests_is_streamed_whole_and_verified_by_its_id(tmp_path, store):
    """A schema 1 or 2 manifest has no chunk digests: the blob is read as before, hashed whole."""
    data = content(60, 9 * CHUNK + 1)
    entry = publish_blob(store, tmp_path, data)
    assert streamed_whole(store, entry, {}) == data


def test_frames_that_do_not_hold_chunk_bytes_each_are_streamed_whole(tmp_path, store, monkeypatch):
    """A pack framed in pieces other than the digests' (another writer's CHUNK_BYTES): the digests
    cannot be matched frame by frame, so the whole content is checked against the blob id."""
    data = content(61, 9 * CHUNK + 1)
    monkeypatch.setattr(packs, "CHUNK_BYTES", CHUNK // 2)
    entry = publish_blob(store, tmp_path, data)
    monkeypatch.setattr(packs, "CHUNK_BYTES", CHUNK)
    assert streamed_whole(store, entry, {entry.blob: digests_of(data)}) == data


def test_a_manifest_whose_chunk_digests_lie_fails_the_blob_at_the_chunk(tmp_path, store):
    """The frames hold the blob's true content; digests of other content (a writer who signed wrong
    digests, or dedup against another file) fail the first chunk they differ in, on its own thread."""
    data = content(62, 6 * CHUNK)
    entry = publish_blob(store, tmp_path, data)
    other = bytearray(data)
    other[4 * CHUNK + 9] ^= 1
    with pytest.raises(IntegrityError, match="chunk 4 hashes to"):
        fetch_into(store, entry, tmp_path / "out", digests={entry.blob: digests_of(bytes(other))})


def test_each_part_is_verified_by_the_thread_that_decompressed_it(tmp_path, store, monkeypatch):
    """No thread waits for another's chunk: every chunk is hashed where it was decompressed."""
    data = content(63, 8 * CHUNK)
    entry = publish_blob(store, tmp_path, data)
    hashed_by: dict[int, int] = {}
    real = fetch._Assembly.verified

    def verified(self, index):
        hashed_by[index] = threading.get_ident()
        real(self, index)

    monkeypatch.setattr(fetch._Assembly, "verified", verified)
    started: list[tuple[int, tuple[int, ...]]] = []
    real_read = fetch.read_part

    def read_part(store_, assembly, part, cancelled):
        started.append((threading.get_ident(), part))
        real_read(store_, assembly, part, cancelled)

    monkeypatch.setattr(fetch, "read_part", read_part)
    fetch_into(store, entry, tmp_path / "out", jobs=4)
    assert (tmp_path / "out").read_bytes() == data
    reader = {i: thread for thread, part in started for i in part}
    assert len(started) >= 2 and sorted(hashed_by) == list(range(8)) and hashed_by == reader
