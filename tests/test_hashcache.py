"""The hash cache skips re-reading unchanged files and never serves a hash for changed ones."""

import os

from trees import write_tree

from kcache import publish as publishing
from kcache import sources
from kcache.hashcache import HashCache, stat_key
from kcache.publish import PublishConfig, publish


def test_unchanged_files_are_not_read_again(tmp_path, store, sqlite_index, fp, monkeypatch):
    write_tree(tmp_path / "src", {f"inductor/{i}": f"kernel {i}".encode() for i in range(20)})
    cache = HashCache(tmp_path / "hashes.db")
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


def _publish_with(tmp_path, store, sqlite_index, fp, cache_path):
    write_tree(tmp_path / "src", {"inductor/a": b"kernel a", "cuda/b": b"sass b"})
    cache = HashCache(cache_path)
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
    assert len(cache.lookup([stat_key(tmp_path / "src/inductor/a")])) == 1
    cache.close()


def test_an_unusable_hash_cache_only_costs_the_rehash(tmp_path, store, sqlite_index, fp, caplog):
    blocker = tmp_path / "home"
    blocker.write_bytes(b"")  # KCACHE_HOME is a file: no database can live under it
    with caplog.at_level("WARNING", logger="kcache.hashcache"):
        result = _publish_with(tmp_path, store, sqlite_index, fp, blocker / "hashcache.db")
    assert result.files == 2 and "without a hash cache" in caplog.text
