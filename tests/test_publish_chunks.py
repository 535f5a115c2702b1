"""A large blob's chunk digests come from the publisher's own read of its file, on every path that
names the blob: hashing it, packing it while hashing it, and the hash cache.

DIGESTED_BYTES is scaled down to two chunks (8 MiB) so a "large" file is ~12 MiB; CHUNK_BYTES stays
4 MiB, the piece size the manifest's digests describe.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time

import pytest
from trees import read_tree, write_tree

from kcache import manifest as manifests
from kcache import packs, sources
from kcache import publish as publishing
from kcache.hashcache import HashCache, stat_key
from kcache.packs import CHUNK_BYTES
from kcache.publish import PublishConfig, publish
from kcache.restore import restore

DIGESTED = 2 * CHUNK_BYTES
BIG = 3 * CHUNK_BYTES + 12345  # four pieces, the last one short


@pytest.fixture(autouse=True)
def digested_at_two_chunks(monkeypatch):
    monkeypatch.setattr(packs, "DIGESTED_BYTES", DIGESTED)


@pytest.fixture
def reads(monkeypatch) -> dict[str, list[str]]:
    """The files each reading path read: "hashed" (hash_file) and "packed" (packed while hashed)."""
    seen: dict[str, list[str]] = {"hashed": [], "packed": []}
    hash_file, add_unhashed = publishing.hash_file, packs.PackWriter.add_unhashed
    monkeypatch.setattr(publishing, "hash_file",
                        lambda path, *hint: seen["hashed"].append(path.name) or hash_file(path, *hint))  # fmt: skip
    monkeypatch.setattr(packs.PackWriter, "add_unhashed",
                        lambda self, src, size, name: seen["packed"].append(name.rsplit("/", 1)[-1])
                        or add_unhashed(self, src, size, name))  # fmt: skip
    return seen


def early(monkeypatch) -> None:
    """Files of DIGESTED bytes or more are packed while they are hashed (LARGE_FILE_BYTES is 16 MiB)."""
    monkeypatch.setattr(publishing, "LARGE_FILE_BYTES", DIGESTED)


def pieces(data: bytes) -> tuple[str, ...]:
    return tuple(hashlib.sha256(data[i : i + CHUNK_BYTES]).hexdigest() for i in range(0, len(data), CHUNK_BYTES))


def blob(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def published(tmp_path, store, sqlite_index, fp, cache: HashCache | None = None) -> manifests.Manifest:
    result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={},
                     config=PublishConfig(hash_cache=cache))  # fmt: skip
    return manifests.fetch(store, result.bundle_id)


def settled_cache(tmp_path) -> HashCache:
    """A cache whose publishes hash a minute after the files were written: it keeps their entries."""
    return HashCache(tmp_path / "hashes.db", clock=lambda: time.time_ns() + 60 * 10**9)


@pytest.mark.parametrize("path", ["hashed", "packed"])
def test_a_large_file_carries_the_digest_of_each_piece(tmp_path, store, sqlite_index, fp, monkeypatch, reads, path):
    if path == "packed":
        early(monkeypatch)
    tree = {"vllm/model.bin": os.urandom(BIG), "vllm/exact.bin": os.urandom(DIGESTED),
            "vllm/under.bin": os.urandom(DIGESTED - 1), "inductor/small.py": b"print(1)\n"}  # fmt: skip
    write_tree(tmp_path / "src", tree)
    manifest = published(tmp_path, store, sqlite_index, fp)
    other = "packed" if path == "hashed" else "hashed"
    digested = {"model.bin", "exact.bin"}
    assert digested <= set(reads[path]) and not digested & set(reads[other])  # the path under test took them
    assert manifest.chunks == {blob(tree["vllm/model.bin"]): pieces(tree["vllm/model.bin"]),
                               blob(tree["vllm/exact.bin"]): pieces(tree["vllm/exact.bin"])}  # fmt: skip
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"  # restore checks them piece by piece
    assert read_tree(tmp_path / "dst/vllm") == read_tree(tmp_path / "src/vllm")


def test_a_content_hash_cuts_pieces_at_chunk_boundaries_whatever_the_reads(tmp_path):
    data = os.urandom(BIG)
    digest = packs.ContentHash(chunked=True)
    for start, end in [(0, 1), (1, CHUNK_BYTES + 7), (CHUNK_BYTES + 7, 3 * CHUNK_BYTES), (3 * CHUNK_BYTES, BIG)]:
        digest.update(data[start:end])  # straddling, whole-chunk and short reads
    assert digest.result() == packs.Hashed(blob(data), BIG, pieces(data))
    (tmp_path / "f").write_bytes(data)
    assert publishing.hash_file(tmp_path / "f", BIG) == digest.result()
    assert publishing.hash_file(tmp_path / "f", DIGESTED - 1).chunks == ()  # the walk's size decides


@pytest.mark.parametrize("path", ["hashed", "packed"])
def test_a_warm_hash_cache_gives_the_digests_without_a_read(tmp_path, store, sqlite_index, fp, monkeypatch, reads,
                                                            path):  # fmt: skip
    if path == "packed":
        early(monkeypatch)
    data = os.urandom(BIG)
    write_tree(tmp_path / "src", {"vllm/model.bin": data, "inductor/small.py": b"print(1)\n"})
    cache = settled_cache(tmp_path)
    first = published(tmp_path, store, sqlite_index, fp, cache)
    assert "model.bin" in reads[path]
    for paths in reads.values():
        paths.clear()
    again = published(tmp_path, store, sqlite_index, fp, cache)
    key = stat_key(tmp_path / "src/vllm/model.bin")
    assert cache.lookup({key: BIG}) == {key: packs.Hashed(blob(data), BIG, pieces(data))}
    cache.close()
    assert reads == {"hashed": [], "packed": []}  # every id and digest came from the cache
    assert again.id == first.id and again.chunks == {blob(data): pieces(data)}


def old_cache(path, rows: dict[str, str]) -> None:
    """A hash cache as a kcache before chunk digests wrote it: one table, stat key -> SHA-256."""
    db = sqlite3.connect(path)
    with db:
        db.execute("CREATE TABLE hashes (key TEXT PRIMARY KEY, sha256 TEXT NOT NULL)")
        db.executemany("INSERT INTO hashes (key, sha256) VALUES (?, ?)", rows.items())
    db.close()


@pytest.mark.parametrize("digests", [None, "short", "not hex"], ids=["old-cache", "too-few", "damaged"])
def test_a_cached_id_without_its_digests_is_hashed_again(tmp_path, store, sqlite_index, fp, reads, digests):
    data = os.urandom(BIG)
    write_tree(tmp_path / "src", {"vllm/model.bin": data, "inductor/small.py": b"print(1)\n"})
    big, small = stat_key(tmp_path / "src/vllm/model.bin"), stat_key(tmp_path / "src/inductor/small.py")
    old_cache(tmp_path / "hashes.db", {big: blob(data), small: blob(b"print(1)\n")})
    cache = settled_cache(tmp_path)  # adds the chunks table
    if digests is not None:
        kept = pieces(data)[:-1] if digests == "short" else ("x" * 64,) * len(pieces(data))
        cache.remember([(big, packs.Hashed(blob(data), BIG, kept), 0)], hashing_started=10**19)
    manifest = published(tmp_path, store, sqlite_index, fp, cache)
    assert reads["hashed"] == ["model.bin"]  # the small file's old entry still serves
    assert manifest.chunks == {blob(data): pieces(data)}
    assert cache.lookup({big: BIG})[big].chunks == pieces(data)  # kept for next time
    cache.close()
