"""Packs: many small blobs in one store object, so a 20k-file cache is a few dozen requests.

    pack    := blob* trailer footer
    blob    := frame                         a file of at most CHUNK_BYTES
             | frame+ seek-table             a larger one, CHUNK_BYTES of content per frame
    frame   := one zstd frame (content size in its header)
    seek-table := zstd skippable frame (magic 0x184D2A5E, little-endian u32 length) holding
                  [compressed u32, content u32] per frame, frame count u32, descriptor u8 (0),
                  seekable magic 0x8F92EAB1: zstd's "seekable format", so `zstd -d` reads it too
    trailer := canonical JSON {"schema": 2, "blobs": [[blob_id, offset, length, size], ...]}
    footer  := trailer length (8 bytes, big-endian) + MAGIC

The pack id is the SHA-256 of the whole pack. The trailer makes every pack self-describing, so the
SQL index can be rebuilt from the store alone. Readers fetch blobs by (offset, length) ranges and
never trust a blob until its decompressed bytes hash to its id. A chunked blob's frames can be
fetched and decompressed in parallel (kcache.fetch reads its seek table from the blob's last
bytes); read in order, the frames are the content. Schema 1 packs (every blob one frame) are
still read: a blob without a seek table is one frame.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import stat
import struct
import sys
import tempfile
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import zstandard

from kcache import canonical
from kcache.errors import FileChanged, IntegrityError

MAGIC = b"KCPACK1\n"
TRAILER_SCHEMA = 2
READABLE_TRAILER_SCHEMAS = (1, 2)  # 1: every blob a single frame; packs written by kcache before chunking
FOOTER = struct.Struct(">Q")
FOOTER_SIZE = FOOTER.size + len(MAGIC)
TARGET_PACK_BYTES = 32 * 1024 * 1024
LARGE_FILE_BYTES = 16 * 1024 * 1024  # a file this large gets a pack of its own
ZSTD_LEVEL = 3
# The largest window a streamed frame may ask the decoder to allocate. Ours need 2 MiB (level 3);
# zstd's own limit is 128 MiB, which a hostile frame would get per fetch thread.
MAX_WINDOW = 8 * 1024 * 1024
_CHUNK = 1024 * 1024
# Content per frame of a large blob: small enough that 16 fetch threads hold ~64 MiB of chunks,
# large enough that a frame costs one ranged read of a few MiB (request overhead stays small).
CHUNK_BYTES = 4 * 1024 * 1024
# A chunk a reader will hold in memory; a seek table asking for more is not read in parallel.
MAX_CHUNK_BYTES = 8 * 1024 * 1024
MAX_CHUNK_FRAME = MAX_CHUNK_BYTES + MAX_CHUNK_BYTES // 128 + 1024  # zstd's compress bound, rounded up
# A blob at least this big carries the SHA-256 of each CHUNK_BYTES of its content in its manifest
# (kcache.manifest's "chunks"), computed by the publisher from its own file: restore then verifies
# each part of it on whichever thread decompressed it, not in one sequential chain.
DIGESTED_BYTES = 32 * 1024 * 1024
SKIPPABLE_MAGIC = 0x184D2A5E
SEEKABLE_MAGIC = 0x8F92EAB1
_SKIP_HEADER = struct.Struct("<II")
_SEEK_ENTRY = struct.Struct("<II")
_SEEK_FOOTER = struct.Struct("<IBI")
_U32 = next(code for code in "IL" if array(code).itemsize == 4)  # a seek table's entries, as array holds them
# Content of small files compressed in one batch call: what a pack build holds in memory at most.
SMALL_BATCH_BYTES = 4 * 1024 * 1024
_COMPRESS_AHEAD = 4  # chunks of one file in flight in the pool: ~32 MiB of raw and compressed bytes
SEEK_TAIL_GUESS = 16 * 1024  # the last bytes of a blob read first: a table of ~2000 frames (8 GiB)


@dataclass(frozen=True, slots=True)
class PackedBlob:
    id: str
    offset: int
    length: int  # compressed bytes in the pack
    size: int  # uncompressed bytes


@dataclass(frozen=True)
class Chunk:
    """One frame of a chunked blob: where its bytes lie in the blob and which content they hold."""

    offset: int  # from the blob's first byte
    length: int  # compressed bytes
    start: int  # first content byte
    size: int  # content bytes


@dataclass(frozen=True)
class Hashed:
    """What a file's content hashes to: its blob id and, for a blob of DIGESTED_BYTES or more, the
    SHA-256 of each CHUNK_BYTES of it (a manifest's "chunks"), both taken from the same bytes."""

    blob: str
    size: int  # content bytes hashed
    chunks: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        """Whether it carries the chunk digests its size calls for: one per CHUNK_BYTES, or none."""
        return len(self.chunks) == (chunk_count(self.size) if digests_chunks(self.size) else 0)


def digests_chunks(size: int) -> bool:
    """Whether a blob of `size` bytes carries chunk digests in its manifest."""
    return size >= DIGESTED_BYTES


class ContentHash:
    """The SHA-256 of content fed to it front to back and, when `chunked`, of each CHUNK_BYTES of it:
    one read gives a blob id and chunk digests that describe the very same bytes."""

    def __init__(self, chunked: bool):
        self._whole = hashlib.sha256()
        self._part = hashlib.sha256() if chunked else None
        self._parts: list[str] = []
        self.size = 0

    def update(self, data: bytes) -> None:
        self._whole.update(data)
        if self._part is not None:
            self._update_parts(memoryview(data))
        self.size += len(data)

    def _update_parts(self, view: memoryview) -> None:
        # A piece may straddle a chunk boundary (a short read, a first read sized to the file):
        # each side goes to the digest of its own chunk.
        at = self.size
        while view:
            room = CHUNK_BYTES - at % CHUNK_BYTES
            piece, view = view[:room], view[room:]
            self._part.update(piece)
            at += len(piece)
            if at % CHUNK_BYTES == 0:
                self._parts.append(self._part.hexdigest())
                self._part = hashlib.sha256()

    def result(self) -> Hashed:
        """What was fed so far; the last chunk may be shorter than CHUNK_BYTES."""
        tail = (self._part.hexdigest(),) if self._part is not None and self.size % CHUNK_BYTES else ()
        return Hashed(self._whole.hexdigest(), self.size, tuple(self._parts) + tail)


@dataclass(frozen=True)
class Pack:
    id: str
    path: Path  # the finished pack file on local disk
    size: int
    blobs: tuple[PackedBlob, ...]


class _Digesting:
    """A file written front to back, hashed as it is written: the pack id costs no second read."""

    def __init__(self, file: BinaryIO):
        self.file, self.digest, self.position = file, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.position += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


class PackWriter:
    """Append files to a pack in `workdir`; `finish()` seals it and names it by its hash.

    `pool` compresses the chunks of a large file in parallel (zstd releases the GIL); without one
    they are compressed in this thread.
    """

    def __init__(self, workdir: Path, pool: Executor | None = None):
        fd, name = tempfile.mkstemp(prefix="pack-", suffix=".tmp", dir=workdir)
        self._path = Path(name)
        self._file = os.fdopen(fd, "w+b")
        self._out = _Digesting(self._file)
        self._blobs: list[PackedBlob] = []
        self._pool = pool

    @property
    def blob_count(self) -> int:
        return len(self._blobs)

    def add(self, blob_id: str, source: Path, size: int) -> None:
        """Compress `source` into the pack; it must still hold `size` bytes hashing to `blob_id`.

        Re-hashing while compressing catches a file rewritten between hashing and packing
        (a compile still running), which would otherwise store bytes under the wrong id.
        """
        if size <= CHUNK_BYTES:
            self.add_small([(blob_id, source, size)])
            return
        offset = self._out.position
        with _open_source(source) as src:
            # No chunk digests: the caller has them, from the read that gave `blob_id`.
            hashed = self._add_chunked(src, size, ContentHash(chunked=False))
        if hashed.size != size or hashed.blob != blob_id:
            raise _changed(source)
        self._blobs.append(PackedBlob(blob_id, offset, self._out.position - offset, size))

    def add_unhashed(self, src: BinaryIO, size: int, name: str) -> Hashed | None:
        """`add` for a large file (over CHUNK_BYTES) open as `src`, whose id is not known yet: its
        SHA-256 (and chunk digests, when its size calls for them) is taken from the very bytes
        packed, and returned. None when the file no longer holds `size` bytes (rewritten since the
        walk): no blob is added, but its bytes were written, so the pack must be discarded. `name`
        is for errors."""
        if size <= CHUNK_BYTES:
            raise ValueError(f"{name}: {size} bytes fit one frame; add it with its id")
        offset = self._out.position
        hashed = self._add_chunked(src, size, ContentHash(digests_chunks(size)))
        if hashed.size != size:
            return None
        self._blobs.append(PackedBlob(hashed.blob, offset, self._out.position - offset, size))
        return hashed

    def add_small(self, files: Iterable[tuple[str, Path, int]], threads: int = 1) -> None:
        """`add` for many files of at most CHUNK_BYTES each: (blob id, path, size) in pack order.

        Each file is read whole and checked here; a batch of them is then compressed in one call on
        `threads` threads that hold no GIL (python-zstandard's multi_compress_to_buffer), one frame
        per file. Python threads compressing one small file each spent more time handing the GIL
        to one another than compressing: a 20k-file tree packed in 1.6 s on 5 threads, 0.95 s on one.
        """
        batch: list[tuple[str, bytes]] = []
        held = 0
        for blob_id, source, size in files:
            if size > CHUNK_BYTES:
                raise ValueError(f"{source}: {size} bytes is more than one frame holds")
            data = _read_upto(source, size + 1)  # one byte more shows a file that grew since it was hashed
            if len(data) != size or hashlib.sha256(data).hexdigest() != blob_id:
                raise _changed(source)
            batch.append((blob_id, data))
            held += size
            if held >= SMALL_BATCH_BYTES:
                self._write_frames(batch, threads)
                batch, held = [], 0
        self._write_frames(batch, threads)

    def _write_frames(self, batch: list[tuple[str, bytes]], threads: int) -> None:
        """One frame per (blob id, content), in order, compressed together."""
        if not batch:
            return
        frames = _compress_many([data for _, data in batch], threads)
        position = self._out.position
        for (blob_id, data), frame in zip(batch, frames):
            self._blobs.append(PackedBlob(blob_id, position, len(frame), len(data)))
            position += len(frame)
        self._out.write(b"".join(frames))

    def _add_chunked(self, src: BinaryIO, size: int, digest: ContentHash) -> Hashed:
        """CHUNK_BYTES of content per frame, then the seek table; a few chunks compress at once.
        Each chunk is fed to `digest` as it is read; what it hashed is returned."""
        frames: list[tuple[int, int]] = []
        pending: deque[Future[bytes]] = deque()
        ahead = _COMPRESS_AHEAD if self._pool else 0

        def drain(keep: int) -> None:
            while len(pending) > keep:
                frame = pending.popleft().result()
                self._out.write(frame)
                frames.append((len(frame), zstandard.frame_content_size(frame)))

        while digest.size <= size and (chunk := src.read(CHUNK_BYTES)):
            digest.update(chunk)
            if self._pool is None:
                pending.append(_done(self._compress(chunk)))
            else:
                pending.append(self._pool.submit(self._compress, chunk))
            drain(ahead)
        drain(0)
        if digest.size == size:
            self._out.write(seek_table(frames))
        return digest.result()

    def _compress(self, chunk: bytes) -> bytes:
        """One frame holding `chunk`, its size in the header. Through a stream writer: python-zstandard's
        one-shot compress() takes 1.3-2x the CPU for the same frame (measured at 4 KiB to 4 MiB)."""
        out = io.BytesIO()
        writer = _compressor().stream_writer(out, size=len(chunk), closefd=False)
        writer.write(chunk)
        writer.flush(zstandard.FLUSH_FRAME)
        return out.getvalue()

    def finish(self) -> Pack:
        self._out.write(trailer(self._blobs))
        self._file.close()
        return Pack(self._out.digest.hexdigest(), self._path, self._out.position, tuple(self._blobs))

    def discard(self) -> None:
        self._file.close()
        self._path.unlink(missing_ok=True)


def _open_fd(source: Path) -> int:
    # O_NOFOLLOW: a file swapped for a link since it was hashed is not read through it; O_NONBLOCK
    # and fstat: one swapped for a FIFO (nothing may ever write it) or a directory is not read at all.
    # With a warm hash cache this is the first open of the file since the walk listed it.
    try:
        fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:  # removed or replaced since it was hashed: the next publish sees it as it is
        raise _changed(source, exc.strerror) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _changed(source, "no longer a regular file")
    return fd


def _open_source(source: Path) -> BinaryIO:
    return open(_open_fd(source), "rb")


def _read_upto(source: Path, limit: int) -> bytes:
    """The first `limit` bytes of a file (all of it when shorter), without a buffered file object."""
    fd = _open_fd(source)
    try:
        data = os.read(fd, limit)
        while len(data) < limit and (more := os.read(fd, limit - len(data))):  # a short read: not yet the end
            data += more
        return data
    finally:
        os.close(fd)


def _changed(source: Path, why: str | None = None) -> FileChanged:
    return FileChanged(str(source), "changed while it was being published" + (f" ({why})" if why else ""))


def _compressor() -> zstandard.ZstdCompressor:
    cctx = getattr(_local, "cctx", None)  # one per thread: a context must not be shared between threads
    if cctx is None:
        cctx = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return cctx


def _compress_many(contents: list[bytes], threads: int) -> list[bytes]:
    """One frame per content, in order: the same frames one call at a time would give (content size
    in each header), the non-empty ones compressed on `threads` threads outside the GIL.

    Empty contents never go into the batch: python-zstandard 0.25 drops the output of a thread
    that got only empty inputs (two inputs b"x", b"" on 2 threads give one frame). Every frame
    is checked against its content's size, so a batch that came back wrong is redone one by one.
    """
    one = _compressor().compress
    frames = [one(data) if not data else b"" for data in contents]
    full = [i for i, data in enumerate(contents) if data]
    if not full:
        return frames
    try:
        result = _compressor().multi_compress_to_buffer([contents[i] for i in full], threads=max(1, threads))
        batch = [result[j].tobytes() for j in range(len(result))]
    except NotImplementedError:  # the cffi backend (PyPy) lacks the batch API
        batch = []
    if len(batch) != len(full) or any(zstandard.frame_content_size(f) != len(contents[i]) for i, f in zip(full, batch)):
        batch = [one(contents[i]) for i in full]
    for i, frame in zip(full, batch):
        frames[i] = frame
    return frames


def _done(value: bytes) -> Future[bytes]:
    future: Future[bytes] = Future()
    future.set_result(value)
    return future


def chunk_count(size: int) -> int:
    """How many CHUNK_BYTES pieces (the last one shorter) hold `size` bytes of content."""
    return -(-size // CHUNK_BYTES)


def seek_table(frames: list[tuple[int, int]]) -> bytes:
    """The skippable frame that ends a chunked blob: (compressed, content) bytes of each frame."""
    body = b"".join(_SEEK_ENTRY.pack(c, d) for c, d in frames) + _SEEK_FOOTER.pack(len(frames), 0, SEEKABLE_MAGIC)
    return _SKIP_HEADER.pack(SKIPPABLE_MAGIC, len(body)) + body


def seek_table_span(tail: bytes) -> int | None:
    """How many of a blob's last bytes its seek table takes, from the footer in `tail`; None: no table."""
    if len(tail) < _SEEK_FOOTER.size:
        return None
    count, descriptor, magic = _SEEK_FOOTER.unpack(tail[-_SEEK_FOOTER.size :])
    if magic != SEEKABLE_MAGIC or descriptor != 0:
        return None
    return _SKIP_HEADER.size + count * _SEEK_ENTRY.size + _SEEK_FOOTER.size


def seek_table_limit(size: int) -> int:
    """The longest seek table a blob of `size` content bytes can have: one frame per CHUNK_BYTES, as
    written here. A footer may claim any length; a reader that believed it would hold the blob."""
    frames = max(1, -(-size // CHUNK_BYTES))
    return _SKIP_HEADER.size + frames * _SEEK_ENTRY.size + _SEEK_FOOTER.size


def parse_seek_table(tail: bytes, length: int, size: int) -> SeekTable | None:
    """The frames of a chunked blob of `length` stored bytes and `size` content bytes, from its last bytes.

    None when the blob has no seek table (a single frame, or a schema 1 pack), or one that does
    not add up to the blob, has more frames than CHUNK_BYTES frames need, or whose chunks are
    larger than a reader holds: such a blob is read as one stream. A table can only say where to
    look: every frame is still checked for its size and the whole content for its SHA-256.
    """
    span = seek_table_span(tail)
    if span is None or span > min(len(tail), length, seek_table_limit(size)):
        return None
    magic, body = _SKIP_HEADER.unpack(tail[-span : -span + _SKIP_HEADER.size])
    if magic != SKIPPABLE_MAGIC or body != span - _SKIP_HEADER.size:
        return None
    entries = array(_U32, tail[-span + _SKIP_HEADER.size : -_SEEK_FOOTER.size])  # [compressed, content] a frame
    if sys.byteorder != "little":
        entries.byteswap()
    lengths, sizes = entries[0::2], entries[1::2]
    del entries
    if not all(0 < n <= MAX_CHUNK_FRAME for n in lengths) or not all(0 < n <= MAX_CHUNK_BYTES for n in sizes):
        return None
    offsets = array("Q", itertools.accumulate(lengths, initial=0))  # one more than frames: the last is the end
    starts = array("Q", itertools.accumulate(sizes, initial=0))
    if offsets[-1] + span != length or starts[-1] != size:
        return None
    return SeekTable(offsets, lengths, starts, sizes)


class SeekTable(Sequence[Chunk]):
    """The frames of a chunked blob, as `parse_seek_table` found them: a Chunk for each index, made when
    asked for. Kept as arrays (24 bytes a frame): a manifest at the cap may hold the digests of ~500k
    chunks of one blob, and a store writer's table as many frames; a Chunk object each had cost a
    restore ~100 MiB more, past its bound."""

    def __init__(self, offsets: array, lengths: array, starts: array, sizes: array):
        self._offsets, self._lengths, self._starts, self._sizes = offsets, lengths, starts, sizes

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return Chunk(self._offsets[index], self._lengths[index], self._starts[index], self._sizes[index])

    def lengths(self) -> Sequence[int]:
        """Every frame's compressed length, in order, without a Chunk each."""
        return self._lengths


def trailer(blobs) -> bytes:
    """A pack's last bytes: the canonical JSON trailer, its length, MAGIC (pinned by a golden test)."""
    body = canonical.dumps({"schema": TRAILER_SCHEMA, "blobs": [[b.id, b.offset, b.length, b.size] for b in blobs]})
    return body + FOOTER.pack(len(body)) + MAGIC


def trailer_span(pack_id: str, tail: bytes, pack_size: int) -> int:
    """How many bytes from the pack's end hold trailer and footer, read from the footer in `tail`."""
    if len(tail) < FOOTER_SIZE or not tail.endswith(MAGIC):
        raise IntegrityError("pack", pack_id, "has no kcache pack footer")
    (trailer_len,) = FOOTER.unpack(tail[-FOOTER_SIZE : -len(MAGIC)])
    if trailer_len + FOOTER_SIZE > pack_size:
        raise IntegrityError("pack", pack_id, f"claims a {trailer_len}-byte trailer in a {pack_size}-byte pack")
    return trailer_len + FOOTER_SIZE


# The shortest entry a trailer can hold: `["<64 hex digits>",0,0,0]`.
_MIN_ENTRY_BYTES = 73


def parse_trailer(pack_id: str, tail: bytes, pack_size: int) -> tuple[PackedBlob, ...]:
    """Parse a pack's trailer from its last bytes (`tail` must include trailer and footer)."""
    if len(tail) < FOOTER_SIZE or not tail.endswith(MAGIC):
        raise IntegrityError("pack", pack_id, "has no kcache pack footer")
    (trailer_len,) = FOOTER.unpack(tail[-FOOTER_SIZE : -len(MAGIC)])
    if trailer_len > len(tail) - FOOTER_SIZE:
        raise IntegrityError("pack", pack_id, "trailer is longer than the bytes given")
    body_end = pack_size - FOOTER_SIZE - trailer_len
    body = tail[-FOOTER_SIZE - trailer_len : -FOOTER_SIZE]
    # Counted before parsing: json.loads makes ~20 times the bytes of `["",0,0,0]` entries.
    if body.count(b"[") > len(body) // _MIN_ENTRY_BYTES + 1:
        raise IntegrityError("pack", pack_id, f"trailer claims more entries than its {len(body)} bytes can hold "
                             f"({_MIN_ENTRY_BYTES} bytes an entry at least)")  # fmt: skip
    try:
        doc = json.loads(body)
        if doc["schema"] not in READABLE_TRAILER_SCHEMAS:
            raise ValueError(f"schema {doc['schema']!r} is not one of {READABLE_TRAILER_SCHEMAS}")
        blobs = tuple(PackedBlob(str(i), int(o), int(n), int(s)) for i, o, n, s in doc["blobs"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise IntegrityError("pack", pack_id, f"trailer does not parse: {exc}") from None
    for blob in blobs:
        if blob.offset < 0 or blob.length < 0 or blob.size < 0 or blob.offset + blob.length > body_end:
            raise IntegrityError("pack", pack_id, f"blob {blob.id} lies outside the pack body")
    return blobs


_local = threading.local()


def _decompressor() -> zstandard.ZstdDecompressor:
    # One per thread: a decompression context must not be shared between threads.
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


def unpack_bytes(frame: bytes, blob_id: str, size: int) -> bytes:
    """Decompress one small blob held in memory, verifying size and SHA-256 (restore's fast path)."""
    data = _decompress_bytes(frame, blob_id, size)
    if hashlib.sha256(data).hexdigest() != blob_id:
        raise IntegrityError("blob", blob_id, f"content hashes to {hashlib.sha256(data).hexdigest()}")
    return data


def _decompress_bytes(frame: bytes, blob_id: str, size: int) -> bytes:
    """Decompress one frame held in memory that must hold exactly `size` bytes (the caller hashes).

    The frame's declared content size is checked before anything is allocated: zstd trusts it
    over any output limit, so a hostile header could otherwise ask for gigabytes.
    """
    dctx = _decompressor()
    try:
        declared = zstandard.frame_content_size(frame)
        if declared > size:
            raise IntegrityError("blob", blob_id, f"decompresses past its declared {size} bytes")
        data = dctx.decompress(frame, max_output_size=size + 1)
    except zstandard.ZstdError as exc:
        raise IntegrityError("blob", blob_id, f"is not a valid zstd frame: {exc}") from None
    if len(data) != size:
        raise IntegrityError("blob", blob_id, f"decompresses to {len(data)} bytes, expected {size}")
    return data


def unpack_frame(frame: bytes | BinaryIO, blob_id: str, size: int, dest: BinaryIO) -> None:
    """A blob's stored bytes held in memory (small blobs) or a stream of them (large ones) into `dest`, verified."""
    if isinstance(frame, bytes) and size <= CHUNK_BYTES:  # written as one frame
        dest.write(unpack_bytes(frame, blob_id, size))
    else:
        unpack_to(io.BytesIO(frame) if isinstance(frame, bytes) else frame, blob_id, size, dest)


def unpack_to(stream: BinaryIO, blob_id: str, size: int, dest: BinaryIO) -> None:
    """Decompress one blob's frames, in order, from `stream` into `dest`, verifying size and SHA-256.

    `stream` must yield exactly the blob's stored bytes (a chunked blob's seek table is a
    skippable frame, which the decoder passes over). Output past `size` is refused before it is
    written, so a hostile frame cannot fill the disk.
    """
    digest = hashlib.sha256()

    def write(piece: bytes) -> None:
        digest.update(piece)
        dest.write(piece)

    _decompress(stream, blob_id, size, write, across_frames=True)
    if digest.hexdigest() != blob_id:
        raise IntegrityError("blob", blob_id, f"content hashes to {digest.hexdigest()}")


def unpack_chunk_to(stream: BinaryIO, blob_id: str, size: int, write: Callable[[bytes], None]) -> None:
    """Decompress one frame of a chunked blob from `stream`, handing its content to `write` a piece
    at a time (a MiB at most: nothing holds a whole chunk); it must hold exactly `size` bytes.
    The caller hashes the whole blob."""
    _decompress(stream, blob_id, size, write, across_frames=False)


def _decompress(stream: BinaryIO, blob_id: str, size: int, write: Callable[[memoryview], None], *,
                across_frames: bool) -> None:  # fmt: skip
    """Decompress into one buffer per thread, reused: `write` must be done with each view when it returns.

    A fresh MiB per read cost more than decoding into it (new pages, cold caches): 1 GiB decoded
    and hashed in 1.6-1.8 CPU-seconds that way, 1.15 s through one buffer.
    """
    written = 0
    view = _buffer()
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
        reader = dctx.stream_reader(stream, read_size=_CHUNK, read_across_frames=across_frames)
        while n := reader.readinto(view[: min(_CHUNK, size - written + 1)]):
            written += n
            if written > size:
                raise IntegrityError("blob", blob_id, f"decompresses past its declared {size} bytes")
            write(view[:n])
    except zstandard.ZstdError as exc:
        raise IntegrityError("blob", blob_id, f"is not a valid zstd frame: {exc}") from None
    if written != size:
        raise IntegrityError("blob", blob_id, f"decompresses to {written} bytes, expected {size}")


def _buffer() -> memoryview:
    """This thread's decompression buffer."""
    view = getattr(_local, "buffer", None)
    if view is None:
        view = _local.buffer = memoryview(bytearray(_CHUNK))
    return view
