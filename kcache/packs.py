"""Packs: many small blobs in one store object, so a 20k-file cache is a few dozen requests.

    pack    := blob* trailer footer
    blob    := one zstd frame holding one file's content
    trailer := canonical JSON {"schema": 1, "blobs": [[blob_id, offset, length, size], ...]}
    footer  := trailer length (8 bytes, big-endian) + MAGIC

The pack id is the SHA-256 of the whole pack. The trailer makes every pack self-describing, so the
SQL index can be rebuilt from the store alone. Readers fetch blobs by (offset, length) ranges and
never trust a blob until its decompressed bytes hash to its id.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import zstandard

from kcache import canonical
from kcache.errors import IntegrityError

MAGIC = b"KCPACK1\n"
TRAILER_SCHEMA = 1
FOOTER = struct.Struct(">Q")
FOOTER_SIZE = FOOTER.size + len(MAGIC)
TARGET_PACK_BYTES = 32 * 1024 * 1024
LARGE_FILE_BYTES = 16 * 1024 * 1024  # a file this large gets a pack of its own
ZSTD_LEVEL = 3
# The largest window a streamed frame may ask the decoder to allocate. Ours need 2 MiB (level 3);
# zstd's own limit is 128 MiB, which a hostile frame would get per fetch thread.
MAX_WINDOW = 8 * 1024 * 1024
_CHUNK = 1024 * 1024


@dataclass(frozen=True)
class PackedBlob:
    id: str
    offset: int
    length: int  # compressed bytes in the pack
    size: int  # uncompressed bytes


@dataclass(frozen=True)
class Pack:
    id: str
    path: Path  # the finished pack file on local disk
    size: int
    blobs: tuple[PackedBlob, ...]


class PackWriter:
    """Append files to a pack in `workdir`; `finish()` seals it and names it by its hash."""

    def __init__(self, workdir: Path):
        fd, name = tempfile.mkstemp(prefix="pack-", suffix=".tmp", dir=workdir)
        self._path = Path(name)
        self._file = os.fdopen(fd, "w+b")
        self._blobs: list[PackedBlob] = []
        self._cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)

    @property
    def blob_count(self) -> int:
        return len(self._blobs)

    def add(self, blob_id: str, source: Path, size: int) -> None:
        """Compress `source` into the pack; it must still hold `size` bytes hashing to `blob_id`.

        Re-hashing while compressing catches a file rewritten between hashing and packing
        (a compile still running), which would otherwise store bytes under the wrong id.
        """
        offset = self._file.tell()
        digest = hashlib.sha256()
        read = 0
        try:  # O_NOFOLLOW: a file swapped for a link since it was hashed is not read through it
            src = open(os.open(source, os.O_RDONLY | os.O_NOFOLLOW), "rb")
        except OSError as exc:  # removed or replaced since it was hashed: the next publish sees it as it is
            why = f"changed while it was being published ({exc.strerror})"
            raise IntegrityError("file", str(source), why) from None
        with src:
            writer = self._cctx.stream_writer(self._file, size=size, closefd=False)
            while chunk := src.read(_CHUNK):
                digest.update(chunk)
                read += len(chunk)
                if read > size:
                    break
                writer.write(chunk)
            if read == size:
                writer.flush(zstandard.FLUSH_FRAME)
        if read != size or digest.hexdigest() != blob_id:
            raise IntegrityError("file", str(source), "changed while it was being published")
        self._blobs.append(PackedBlob(blob_id, offset, self._file.tell() - offset, size))

    def finish(self) -> Pack:
        self._file.write(trailer(self._blobs))
        self._file.flush()
        size = self._file.tell()
        self._file.seek(0)
        digest = hashlib.sha256()
        while chunk := self._file.read(_CHUNK):
            digest.update(chunk)
        self._file.close()
        return Pack(digest.hexdigest(), self._path, size, tuple(self._blobs))

    def discard(self) -> None:
        self._file.close()
        self._path.unlink(missing_ok=True)


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


def parse_trailer(pack_id: str, tail: bytes, pack_size: int) -> tuple[PackedBlob, ...]:
    """Parse a pack's trailer from its last bytes (`tail` must include trailer and footer)."""
    if len(tail) < FOOTER_SIZE or not tail.endswith(MAGIC):
        raise IntegrityError("pack", pack_id, "has no kcache pack footer")
    (trailer_len,) = FOOTER.unpack(tail[-FOOTER_SIZE : -len(MAGIC)])
    if trailer_len > len(tail) - FOOTER_SIZE:
        raise IntegrityError("pack", pack_id, "trailer is longer than the bytes given")
    body_end = pack_size - FOOTER_SIZE - trailer_len
    try:
        doc = json.loads(tail[-FOOTER_SIZE - trailer_len : -FOOTER_SIZE])
        if doc["schema"] != TRAILER_SCHEMA:
            raise ValueError(f"schema {doc['schema']!r} is not {TRAILER_SCHEMA}")
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
    """Decompress one small blob held in memory, verifying size and SHA-256 (restore's fast path).

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
    if hashlib.sha256(data).hexdigest() != blob_id:
        raise IntegrityError("blob", blob_id, f"content hashes to {hashlib.sha256(data).hexdigest()}")
    return data


def unpack_frame(frame: bytes | BinaryIO, blob_id: str, size: int, dest: BinaryIO) -> None:
    """A frame held in memory (small blobs) or a stream of one (large ones) into `dest`, verified."""
    if isinstance(frame, bytes):
        dest.write(unpack_bytes(frame, blob_id, size))
    else:
        unpack_to(frame, blob_id, size, dest)


def unpack_to(stream: BinaryIO, blob_id: str, size: int, dest: BinaryIO) -> None:
    """Decompress one blob frame from `stream` into `dest`, verifying size and SHA-256.

    `stream` must yield exactly the blob's compressed bytes. Output past `size` is refused
    before it is written, so a hostile frame cannot fill the disk.
    """
    digest = hashlib.sha256()
    written = 0
    try:
        reader = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW).stream_reader(stream, read_across_frames=False)
        while chunk := reader.read(min(_CHUNK, size - written + 1)):
            written += len(chunk)
            if written > size:
                raise IntegrityError("blob", blob_id, f"decompresses past its declared {size} bytes")
            digest.update(chunk)
            dest.write(chunk)
    except zstandard.ZstdError as exc:
        raise IntegrityError("blob", blob_id, f"is not a valid zstd frame: {exc}") from None
    if written != size:
        raise IntegrityError("blob", blob_id, f"decompresses to {written} bytes, expected {size}")
    if digest.hexdigest() != blob_id:
        raise IntegrityError("blob", blob_id, f"content hashes to {digest.hexdigest()}")
