"""A large file published with chunk digests is restored in parts, each verified on its own thread.

Sizes are scaled down: a "large" file is 40 KiB in chunks of 4 KiB, digested from 16 KiB on, and a
part is a few KiB of stored bytes, so the path a 156 MB precompiled header takes runs in milliseconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import threading

import pytest
from trees import read_tree, write_tree

from kcache import fetch, packs, sources
from kcache import manifest as manifests
from kcache import publish as publishing
from kcache import restore as restoring
from kcache.errors import IntegrityError
from kcache.publish import publish
from kcache.restore import restore
from kcache.store import manifest_key, pack_key
from kcache.verify import verify

CHUNK = 4096


@pytest.fixture(autouse=True)
def small_sizes(monkeypatch):
    for module in (packs, publishing, restoring):
        monkeypatch.setattr(module, "CHUNK_BYTES", CHUNK, raising=False)
    monkeypatch.setattr(packs, "DIGESTED_BYTES", 4 * CHUNK)
    monkeypatch.setattr(publishing, "LARGE_FILE_BYTES", 64 * 1024)
    monkeypatch.setattr(fetch, "PART_BYTES", 2 * CHUNK)


def big(size: int = 10 * CHUNK + 5) -> bytes:
    return b"".join(os.urandom(64) + b"kernel " * (i % 40) for i in range(size // 64 + 1))[:size]


@pytest.fixture
def split_reads(monkeypatch):
    """The threads that read (and so verified) a part of a split blob, per part."""
    readers: list[tuple[int, tuple[int, ...]]] = []
    real = fetch.read_part

    def read_part(store, assembly, part, cancelled):
        readers.append((threading.get_ident(), part))
        real(store, assembly, part, cancelled)

    monkeypatch.setattr(fetch, "read_part", read_part)
    return readers


def published(tmp_path, store, index, fp, tree):
    write_tree(tmp_path / "src", tree)
    result = publish(store, index, fp, sources.select(), root=tmp_path / "src", env={})
    return manifests.fetch(store, result.bundle_id)


def test_a_large_file_is_published_with_its_chunk_digests_and_restored_in_parts(tmp_path, store, sqlite_index, fp,
                                                                               split_reads):  # fmt: skip
    header, small = big(), b"print(1)\n"
    tree = {"inductor/h.gch": header, "inductor/small.py": small}
    manifest = published(tmp_path, store, sqlite_index, fp, tree)
    blob = hashlib.sha256(header).hexdigest()
    assert manifest.chunks == {blob: tuple(hashlib.sha256(header[i : i + CHUNK]).hexdigest()
                                           for i in range(0, len(header), CHUNK))}  # fmt: skip
    result = restore(store, sqlite_index, fp, tmp_path / "dst", jobs=4)
    assert result.status == "hit"
    assert {path: data for path, (data, _mode) in read_tree(tmp_path / "dst" / "inductor").items()} == {
        "h.gch": header, "small.py": small}  # fmt: skip
    assert len(split_reads) >= 2  # the header came in parts


def _lying(store, index, manifest: manifests.Manifest, blob: str) -> manifests.Manifest:
    """The same bundle, stored and indexed anew with the chunk digests of other content."""
    digests = list(manifest.chunks[blob])
    digests[1] = hashlib.sha256(b"other").hexdigest()
    forged = dataclasses.replace(manifest, chunks={blob: tuple(digests)})
    store.put_bytes(manifest_key(forged.id), forged.to_bytes())
    row = index.get_bundle(manifest.id)
    index.add_bundle(dataclasses.replace(row, id=forged.id))
    return forged


def test_a_manifest_whose_chunk_digests_lie_fails_restore_and_verify(tmp_path, store, sqlite_index, fp, split_reads):
    header = big()
    manifest = published(tmp_path, store, sqlite_index, fp, {"inductor/h.gch": header})
    blob = hashlib.sha256(header).hexdigest()
    forged = _lying(store, sqlite_index, manifest, blob)
    with pytest.raises(IntegrityError, match="chunk 1 hashes to"):  # the CLI turns it into a cold start
        restore(store, sqlite_index, fp, tmp_path / "dst", jobs=4, bundle_id=forged.id)
    assert split_reads and not (tmp_path / "dst" / "inductor" / "h.gch").exists()
    assert restoring.read_state(tmp_path / "dst")["status"] == "error"
    found = verify(store, sqlite_index, read_data=True)
    assert [p for p in found.problems if "chunk digests" in p] == [
        f"bundle {forged.id[:12]}: inductor/h.gch: its manifest's chunk digests are not those of blob {blob[:12]}"
    ]


def test_a_seek_table_that_frames_the_blob_wrongly_fails_restore_and_verify_says_so(tmp_path, store, sqlite_index,
                                                                                  fp, split_reads):  # fmt: skip
    """A store writer shifts the seek table's frame lengths and leaves every frame intact: read as one
    stream, the blob still hashes to its id; read in parts, as restore reads it, no part decompresses."""
    header = big()
    manifest = published(tmp_path, store, sqlite_index, fp, {"inductor/h.gch": header})
    (entry,) = manifest.entries
    path = store.root / pack_key(entry.pack)
    pack = bytearray(path.read_bytes())
    end = entry.offset + entry.length
    chunks = packs.parse_seek_table(bytes(pack[entry.offset : end]), entry.length, entry.size)
    frames = [[c.length, c.size] for c in chunks]
    frames[0][0], frames[1][0] = frames[0][0] + 5, frames[1][0] - 5  # the same total: the table still adds up
    table = packs.seek_table([tuple(f) for f in frames])
    pack[end - len(table) : end] = table
    path.write_bytes(bytes(pack))
    with pytest.raises(IntegrityError, match="not a valid zstd frame"):
        restore(store, sqlite_index, fp, tmp_path / "dst", jobs=4)
    assert split_reads
    found = verify(store, sqlite_index, read_data=True)
    assert [p for p in found.problems if "in parts" in p] == [
        f"pack {entry.pack[:12]}: inductor/h.gch: read in parts as restore reads it: blob {entry.blob}: "
        "is not a valid zstd frame: zstd decompress error: Unknown frame descriptor"
    ]


def test_verify_reads_a_sound_split_blob_in_parts_too_and_finds_nothing(tmp_path, store, sqlite_index, fp,
                                                                        split_reads):  # fmt: skip
    published(tmp_path, store, sqlite_index, fp, {"inductor/h.gch": big()})
    found = verify(store, sqlite_index, read_data=True)
    assert found.problems == () and len(split_reads) >= 2
