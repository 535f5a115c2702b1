"""Large files are packed while they are hashed: read once, uploaded when new, counted, restorable.

Sizes are scaled down (a "large" file here is 64 KiB in frames of 16 KiB) so the cases run in
milliseconds; the code paths are the ones a 16 MiB file takes.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest
from trees import read_tree, write_tree

from kcache import packs, sources
from kcache import publish as publishing
from kcache import restore as restoring
from kcache.hashcache import HashCache
from kcache.publish import PublishConfig, publish
from kcache.restore import restore

LARGE = 64 * 1024


@pytest.fixture(autouse=True)
def small_sizes(monkeypatch):
    monkeypatch.setattr(packs, "CHUNK_BYTES", 16 * 1024)
    monkeypatch.setattr(publishing, "CHUNK_BYTES", 16 * 1024)
    monkeypatch.setattr(restoring, "CHUNK_BYTES", 16 * 1024)
    monkeypatch.setattr(publishing, "LARGE_FILE_BYTES", LARGE)


@pytest.fixture
def hashed(monkeypatch):
    """The paths hash_file read (the pass that only hashes)."""
    paths: list[str] = []
    real = publishing.hash_file
    monkeypatch.setattr(publishing, "hash_file", lambda path, *hint: paths.append(str(path)) or real(path, *hint))
    return paths


def big(seed: int, size: int = LARGE * 3 + 123) -> bytes:
    return os.urandom(size // 2) + bytes([seed]) * (size - size // 2)


def packs_in(store) -> list[str]:
    return [o.key for o in store.list("packs")]


def test_a_large_file_is_read_once_uploaded_and_counted(tmp_path, store, sqlite_index, fp, hashed):
    tree = {"vllm/model.bin": big(1), "vllm/other.bin": big(2), "inductor/small.py": b"print(1)\n"}
    write_tree(tmp_path / "src", tree)
    result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    assert not any(p.endswith(".bin") for p in hashed)  # packed and hashed in one read
    assert (result.new_blobs, result.packs) == (3, 3)  # each large file a pack of its own, the small one
    assert result.new_bytes == sum(len(v) for v in tree.values())
    assert result.uploaded_bytes == sum(o.size for o in store.list("packs"))
    restored = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert restored.status == "hit"
    assert read_tree(tmp_path / "dst/vllm") == read_tree(tmp_path / "src/vllm")


def test_large_files_with_the_same_bytes_go_up_once(tmp_path, store, sqlite_index, fp):
    same = big(3)
    write_tree(tmp_path / "src", {"vllm/a.bin": same, "vllm/b.bin": same, "vllm/c.bin": same})
    result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    assert (result.new_blobs, result.packs, len(packs_in(store))) == (1, 1, 1)
    restore(store, sqlite_index, fp, tmp_path / "dst")
    assert read_tree(tmp_path / "dst/vllm") == read_tree(tmp_path / "src/vllm")


def test_a_large_file_the_index_has_is_packed_but_not_uploaded(tmp_path, store, sqlite_index, fp, monkeypatch):
    """A second publish with a cold hash cache (a new pod): the pack built while hashing is dropped."""
    write_tree(tmp_path / "src", {"vllm/model.bin": big(4)})
    publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    before = packs_in(store)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where publish builds its packs
    built = []
    real = packs.PackWriter.finish
    monkeypatch.setattr(packs.PackWriter, "finish", lambda self: built.append(real(self)) or built[-1])
    again = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    assert (again.new_blobs, again.uploaded_bytes, again.packs) == (0, 0, 0)
    assert packs_in(store) == before
    assert len(built) == 1 and not built[0].path.exists()  # packed while hashed, then dropped
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_large_file_gone_since_the_walk_is_skipped(tmp_path, store, sqlite_index, fp, monkeypatch, caplog):
    write_tree(tmp_path / "src", {"vllm/kept.bin": big(5), "vllm/gone.bin": big(6)})
    real = publishing.collect

    def collect_then_remove(*args, **kwargs):
        found = real(*args, **kwargs)
        (tmp_path / "src/vllm/gone.bin").unlink()  # a compile cleaned up after the walk listed it
        return found

    monkeypatch.setattr(publishing, "collect", collect_then_remove)
    result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    assert result.files == 1 and result.new_blobs == 1
    assert "gone.bin" in caplog.text and "removed" in caplog.text


@pytest.mark.parametrize("size", [LARGE * 2, LARGE - 1], ids=["still-large", "now-small"])
def test_a_large_file_whose_size_changed_since_the_walk_is_skipped(tmp_path, store, sqlite_index, fp, monkeypatch,
                                                                     caplog, size):  # fmt: skip
    write_tree(tmp_path / "src", {"vllm/kept.bin": big(5), "vllm/moving.bin": big(6)})
    real = publishing.collect

    def collect_then_rewrite(*args, **kwargs):
        found = real(*args, **kwargs)
        (tmp_path / "src/vllm/moving.bin").write_bytes(big(7, size))  # a compile rewrote it since the walk
        return found

    monkeypatch.setattr(publishing, "collect", collect_then_rewrite)
    result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    assert result.files == 1 and "moving.bin" in caplog.text and "changed size since it was listed" in caplog.text
    assert restore(store, sqlite_index, fp, tmp_path / "dest").status == "hit"
    assert [p.name for p in (tmp_path / "dest/vllm").iterdir()] == ["kept.bin"]


def test_the_hash_cache_remembers_a_file_hashed_by_packing(tmp_path, store, sqlite_index, fp, hashed, monkeypatch):
    write_tree(tmp_path / "src", {"vllm/model.bin": big(7)})
    cache = HashCache(tmp_path / "hashes.db", clock=lambda: time.time_ns() + 60 * 10**9)  # hashed a minute later
    config = PublishConfig(hash_cache=cache)
    first = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={}, config=config)
    packed = []
    real = packs.PackWriter.add_unhashed
    monkeypatch.setattr(packs.PackWriter, "add_unhashed", lambda self, *a: packed.append(a) or real(self, *a))
    again = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={}, config=config)
    cache.close()
    assert again.bundle_id == first.bundle_id and again.uploaded_bytes == 0
    assert packed == [] and hashed == []  # the id came from the cache: the file was not read at all


class RefusingStore:
    """A store whose writes of packs fail with a permission error, as a misconfigured mount would."""

    def __init__(self, inner):
        self._inner = inner

    def put_file(self, key, path):
        raise PermissionError(13, "Permission denied", key)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_failed_upload_of_a_large_file_fails_the_publish_not_the_file(tmp_path, store, sqlite_index, fp):
    """Only a file that cannot be opened since the walk is skipped; an upload error is the publish's."""
    write_tree(tmp_path / "src", {"vllm/model.bin": big(8)})
    with pytest.raises(PermissionError):
        publish(RefusingStore(store), sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
