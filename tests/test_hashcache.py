"""The hash cache skips re-reading unchanged files and never serves a hash for changed ones."""

import os
import time

from trees import write_tree

from kcache import packs, sources
from kcache import publish as publishing
from kcache.hashcache import RACY_NS, HashCache, stat_key
from kcache.packs import CHUNK_BYTES, Hashed
from kcache.publish import PublishConfig, publish


def a_minute_later() -> int:
    """A clock for a publish that hashes a minute after the files were written: they are settled."""
    return time.time_ns() + 60 * 10**9


def test_unchanged_files_are_not_read_again(tmp_path, store, sqlite_index, fp, monkeypatch):
    write_tree(tmp_path / "src", {f"inductor/{i}": f"kernel {i}".encode() for i in range(20)})
    cache = HashCache(tmp_path / "hashes.db", clock=a_minute_later)
    publish(
        store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={}, config=PublishConfig(hash_cache=cache)
    )
    reads = []
    real = publishing.hash_file
    monkeypatch.setattr(publishing, "hash_file", lambda path, *hint: reads.append(path) or real(path, *hint))
    (tmp_path / "src/inductor/3").write_bytes(b"changed in place")
    again = publish(
        store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={}, config=PublishConfig(hash_cache=cache)
    )
    assert [p.name for p in reads] == ["3"]
    assert again.new_blobs == 1


def test_a_rewrite_changes_the_key(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"one")
    before = stat_key(path)
    st = os.stat(path)
    path.write_bytes(b"two")  # same size
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime put back
    assert stat_key(path) != before  # ctime moved
    assert stat_key(tmp_path / "missing") is None


def _changed_ns(path) -> int:
    st = os.stat(path)
    return max(st.st_mtime_ns, st.st_ctime_ns)


def _publish_cached(tmp_path, store, sqlite_index, fp, cache):
    return publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={},
                   config=PublishConfig(hash_cache=cache))  # fmt: skip


def test_a_file_changed_just_before_hashing_is_hashed_again_next_time(tmp_path, store, sqlite_index, fp):
    """git's "racy clean": where timestamps tick once a second (ext2, FAT, kernels before 6.13), a
    rewrite of the same size in the tick the file was hashed leaves its stat key as it was. An entry
    is only kept for a file last changed well before hashing started, so such a rewrite (which must
    come after hashing started) lands in a later tick and changes the key."""
    write_tree(tmp_path / "src", {"inductor/a": b"version one"})
    path = tmp_path / "src/inductor/a"
    changed = _changed_ns(path)
    cache = HashCache(tmp_path / "hashes.db", clock=lambda: changed + RACY_NS - 1)  # hashing began within the margin
    _publish_cached(tmp_path, store, sqlite_index, fp, cache)
    assert cache.lookup({stat_key(path): path.stat().st_size}) == {}
    settled = HashCache(tmp_path / "hashes.db", clock=lambda: changed + RACY_NS + 1)
    _publish_cached(tmp_path, store, sqlite_index, fp, settled)
    assert len(settled.lookup({stat_key(path): path.stat().st_size})) == 1
    cache.close()
    settled.close()


def test_a_file_dated_in_the_future_is_never_remembered(tmp_path, store, sqlite_index, fp):
    """An mtime ahead of this clock (another host's clock on a shared volume, a restore's `utime`)
    is never "safely older" than the moment hashing started."""
    write_tree(tmp_path / "src", {"inductor/a": b"kernel"})
    path = tmp_path / "src/inductor/a"
    ahead = time.time_ns() + 3600 * 10**9
    os.utime(path, ns=(ahead, ahead))
    cache = HashCache(tmp_path / "hashes.db")  # the real clock
    _publish_cached(tmp_path, store, sqlite_index, fp, cache)
    assert cache.lookup({stat_key(path): path.stat().st_size}) == {}
    cache.close()


def _publish_with(tmp_path, store, sqlite_index, fp, cache_path):
    write_tree(tmp_path / "src", {"inductor/a": b"kernel a", "cuda/b": b"sass b"})
    cache = HashCache(cache_path, clock=a_minute_later)
    try:
        return publish(
            store,
            sqlite_index,
            fp,
            sources.select(),
            root=tmp_path / "src",
            env={},
            config=PublishConfig(hash_cache=cache),
        )
    finally:
        cache.close()


def test_a_corrupt_hash_cache_is_started_afresh(tmp_path, store, sqlite_index, fp, caplog):
    path = tmp_path / "hashes.db"
    path.write_bytes(b"not a database, " * 64)  # a disk that filled up, a copy cut short
    with caplog.at_level("WARNING", logger="kcache.hashcache"):
        result = _publish_with(tmp_path, store, sqlite_index, fp, path)
    assert result.files == 2 and "starting a new one" in caplog.text
    cache = HashCache(path)  # the new one works and remembers
    assert len(cache.lookup({stat_key(tmp_path / "src/inductor/a"): len(b"kernel a")})) == 1
    cache.close()


def test_an_unusable_hash_cache_only_costs_the_rehash(tmp_path, store, sqlite_index, fp, caplog):
    blocker = tmp_path / "home"
    blocker.write_bytes(b"")  # KCACHE_HOME is a file: no database can live under it
    with caplog.at_level("WARNING", logger="kcache.hashcache"):
        result = _publish_with(tmp_path, store, sqlite_index, fp, blocker / "hashcache.db")
    assert result.files == 2 and "without a hash cache" in caplog.text


def test_an_entry_remembered_without_chunk_digests_drops_the_old_ones(tmp_path, monkeypatch):
    """Digests kept under a lower DIGESTED_BYTES (another kcache) must not leave the entry incomplete for good."""
    size, sha = 3 * CHUNK_BYTES, "0" * 64
    cache = HashCache(tmp_path / "hashes.db")
    monkeypatch.setattr(packs, "DIGESTED_BYTES", 2 * CHUNK_BYTES)
    cache.remember([("key", Hashed(sha, size, ("a" * 64,) * 3), 0)], hashing_started=10**19)
    assert cache.lookup({"key": size}) == {"key": Hashed(sha, size, ("a" * 64,) * 3)}
    monkeypatch.setattr(packs, "DIGESTED_BYTES", 4 * CHUNK_BYTES)
    assert cache.lookup({"key": size}) == {}  # three digests where none belong
    cache.remember([("key", Hashed(sha, size), 0)], hashing_started=10**19)
    assert cache.lookup({"key": size}) == {"key": Hashed(sha, size)}
    cache.close()
