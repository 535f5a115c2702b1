"""Publish under operator faults: cache files swapped for what cannot be read, an index that fails
after the commit point, publishes killed while they stage packs. None may hang, none may report a
committed bundle as a failure, and none may leave what the next publish trips over."""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
from outcome import outcome_within
from trees import read_tree, write_tree

from kcache import packs, sources, workdir
from kcache import publish as publishing
from kcache.errors import FileChanged, IndexDbError
from kcache.hashcache import HashCache
from kcache.index import Index
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.sources import TritonSource
from kcache.store import open_store

SMALL_CHUNK = 16 * 1024


class SwappedAfterTheWalk(TritonSource):
    """The triton layer, with one listed file replaced by `swap(path)` once the walk has listed it."""

    def __init__(self, victim: Path, swap):
        self.victim, self.swap = victim, swap

    def walk(self, top):
        listed = list(super().walk(top))
        self.victim.unlink()
        self.swap(self.victim)
        yield from listed


SWAPS = {"fifo": os.mkfifo, "directory": os.mkdir}


@pytest.mark.parametrize("size", [12, 3 * SMALL_CHUNK + 5], ids=["one-frame", "chunked"])
@pytest.mark.parametrize("swap", list(SWAPS))
def test_a_file_the_hash_cache_knows_swapped_before_it_is_packed_fails_cleanly(tmp_path, store, sqlite_index, fp,
                                                                                monkeypatch, swap, size):  # fmt: skip
    """With a warm hash cache a file is first opened to be packed: one the model container replaced
    by a FIFO meanwhile must not hang publish (nothing will ever write it), nor a directory read as
    a bug (exit 70). It is a file that changed while publish read it (exit 16: publish again)."""
    monkeypatch.setattr(packs, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(publishing, "CHUNK_BYTES", SMALL_CHUNK)
    root = tmp_path / "root"
    write_tree(root, {"triton/k1/a.cubin": os.urandom(size), "triton/k1/b.cubin": b"hello"})
    cache = HashCache(tmp_path / "hashes.db", clock=lambda: time.time_ns() + 60 * 10**9)  # hashed a minute later
    config = PublishConfig(hash_cache=cache)
    other = Index.open(f"sqlite:///{tmp_path / 'other.db'}")  # another store's publish filled the hash cache
    publish(open_store(f"file://{tmp_path / 'other'}"), other, fp, [TritonSource()], root=root, config=config)
    other.close()
    victim = root / "triton/k1/a.cubin"

    unblock = (lambda: os.close(os.open(victim, os.O_WRONLY | os.O_NONBLOCK))) if swap == "fifo" else None
    outcome = outcome_within(lambda: publish(store, sqlite_index, fp, [SwappedAfterTheWalk(victim, SWAPS[swap])],
                                             root=root, config=config), unstick=unblock,
                             hung="publish blocked on a FIFO")  # fmt: skip
    cache.close()
    assert isinstance(outcome, FileChanged) and "a.cubin" in str(outcome), repr(outcome)
    assert sqlite_index.newest_bundle(fp.bundle_key) is None


class EventsFail:
    """An index that goes away after the commit point, as the publish records its event."""

    def __init__(self, inner):
        self.inner = inner

    def record_event(self, event):
        raise IndexDbError(self.inner.url, "server closed the connection unexpectedly")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_event_the_index_cannot_record_does_not_fail_a_committed_publish(tmp_path, store, index, fp, caplog):
    """The event only feeds `kcache stats`: the bundle is committed and its ref moved, so a publish
    reporting failure (exit 5, no bundle id in --json) would send a pipeline into retries for nothing."""
    write_tree(tmp_path / "src", {"inductor/k.py": b"kernel"})
    result = publish(store, EventsFail(index), fp, sources.select(), root=tmp_path / "src", env={})
    assert result.created and "cannot record" in caplog.text
    pod = restore(store, index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", result.bundle_id)


# ---- a publish killed while it stages packs --------------------------------------------------------


class KilledWhileUploading:
    """The OOM killer strikes while the first pack, staged in TMPDIR, is being uploaded."""

    def __init__(self, inner):
        self.inner = inner

    def put_file(self, key, path):
        os.kill(os.getpid(), signal.SIGKILL)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _killed_publisher(root, store_url, index_url, facts, tmp):
    from kcache import fingerprint

    tempfile.tempdir = tmp
    store = KilledWhileUploading(open_store(store_url))
    publish(store, Index.open(index_url), fingerprint.compute(facts), sources.select(), root=root, env={})


def test_a_publish_killed_while_staging_leaves_nothing_for_the_next_one_to_trip_over(tmp_path, store, sqlite_index,
                                                                                      fp, monkeypatch):  # fmt: skip
    """A watch sidecar OOM-killed again and again must not fill its pod's TMPDIR (an emptyDir, often
    memory-backed) with staged packs until every publish fails for room: the next publish removes
    what a killed one left, and never what a running one holds."""
    write_tree(tmp_path / "src", {f"inductor/k{i}.py": os.urandom(4096) for i in range(4)})
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_killed_publisher, args=(tmp_path / "src", store.url, sqlite_index.url,
                                                        dict(fp.facts), str(tmp)))  # fmt: skip
    child.start()
    child.join(120)
    assert child.exitcode == -signal.SIGKILL
    left = [p for p in tmp.rglob("*") if p.is_file()]
    assert left, "the killed publish staged no pack: nothing to test"
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    with workdir.workdir() as running:  # a publish still at work beside ours
        (running / "pack-in-flight.tmp").write_bytes(b"staged")
        result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
        assert (running / "pack-in-flight.tmp").read_bytes() == b"staged"
        assert [p for p in tmp.iterdir()] == [running]
    assert list(tmp.iterdir()) == []
    assert restore(store, sqlite_index, fp, tmp_path / "dst").bundle_id == result.bundle_id
    assert read_tree(tmp_path / "dst/inductor") == read_tree(tmp_path / "src/inductor")


# ---- a directory of the cache swapped for a link to elsewhere --------------------------------------


class LinkedWhileWalked(sources.InductorSource):
    """The inductor layer, its directory `sub/` replaced by a link to `target` once listed as a
    directory, `when` the walk goes down into it or once the whole walk is done."""

    def __init__(self, target: Path, when: str):
        self.target, self.when = target, when

    def _swap(self, path: str) -> None:
        import shutil

        shutil.rmtree(path)
        os.symlink(self.target, path)

    def walk(self, top):
        listed = list(super().walk(top))
        if self.when == "after-the-walk":
            self._swap(os.path.join(top, "sub"))
        yield from listed

    def _walk_dir(self, dirpath, prefix):
        if prefix == "sub/" and self.when == "during-the-walk":
            self._swap(dirpath)
        yield from super()._walk_dir(dirpath, prefix)


@pytest.mark.parametrize("size", [11, 5 * SMALL_CHUNK], ids=["small", "packed-while-hashed"])
@pytest.mark.parametrize("when", ["during-the-walk", "after-the-walk"])
def test_a_cache_directory_swapped_for_a_link_never_publishes_what_it_points_at(tmp_path, store, sqlite_index, fp,
                                                                                 monkeypatch, caplog, when,
                                                                                 size):  # fmt: skip
    """Whoever writes ROOT (the model container, while the watch sidecar publishes it) must not get
    files from outside ROOT into a bundle by swapping a directory for a link at the right moment:
    the walk skips links, but the path it listed is opened later, through whatever is there then."""
    monkeypatch.setattr(packs, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(publishing, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(publishing, "LARGE_FILE_BYTES", 4 * SMALL_CHUNK)
    write_tree(tmp_path / "secret", {"x.py": b"S" * size})  # the name and size of the listed file
    write_tree(tmp_path / "root", {"inductor/a.py": b"a", "inductor/sub/x.py": b"x" * size})
    result = publish(store, sqlite_index, fp, [LinkedWhileWalked(tmp_path / "secret", when)], root=tmp_path / "root")
    assert result.files == 1 and "x.py" in caplog.text and "link" in caplog.text
    restore(store, sqlite_index, fp, tmp_path / "dst")
    assert read_tree(tmp_path / "dst/inductor") == {"a.py": (b"a", 0o644)}


def test_links_above_the_layers_are_the_operators_and_followed(tmp_path, store, sqlite_index, fp, monkeypatch):
    """A ROOT given through a link, and live directories reached through one (a cache dir on another
    disk), publish as before: only links below them are refused."""
    write_tree(tmp_path / "disk", {"root/inductor/a.py": b"a", "triton/k/b.cubin": b"b"})
    (tmp_path / "cache").symlink_to(tmp_path / "disk" / "root")
    (tmp_path / "triton").symlink_to(tmp_path / "disk" / "triton")
    from_root = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "cache", env={})
    live = publish(store, sqlite_index, fp, [TritonSource()], env={"TRITON_CACHE_DIR": str(tmp_path / "triton")})
    assert (from_root.files, live.files) == (1, 1)


# ---- an index that fails to record packs ------------------------------------------------------------


class PackRowsFail:
    """An index that went away after the publish looked up its blobs: every pack's rows fail."""

    def __init__(self, inner):
        self.inner = inner

    def add_pack(self, *args, **kwargs):
        raise IndexDbError(self.inner.url, "server closed the connection unexpectedly")

    def __getattr__(self, name):
        return getattr(self.inner, name)


class CountingPuts:
    def __init__(self, inner):
        self.inner, self.url, self.packs = inner, inner.url, []

    def put_file(self, key, path):
        self.packs.append(key)
        return self.inner.put_file(key, path)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("size", ["large", "small"])
def test_a_publish_whose_index_fails_stops_uploading_what_it_cannot_record(tmp_path, store, sqlite_index, fp,
                                                                            monkeypatch, size):  # fmt: skip
    """Each pack that goes up without its rows is an orphan the next publish cannot name (it writes a
    salted copy instead): once the index fails one pack, the rest must not be read and uploaded too.
    Large files are packed while hashing, small ones after; both stop."""
    monkeypatch.setattr(publishing, "LARGE_FILE_BYTES", packs.CHUNK_BYTES + 1)  # packed while hashing
    monkeypatch.setattr(publishing, "TARGET_PACK_BYTES", 64 * 1024)  # small files: one pack each
    each = packs.CHUNK_BYTES + 4096 if size == "large" else 48 * 1024
    files = {f"inductor/k{i}": os.urandom(16) * (each // 16) for i in range(8)}  # distinct, quick to compress
    write_tree(tmp_path / "src", files)
    counted = CountingPuts(store)
    with pytest.raises(IndexDbError):
        publish(counted, PackRowsFail(sqlite_index), fp, sources.select(), root=tmp_path / "src", env={},
                config=PublishConfig(jobs=1))  # fmt: skip
    assert 1 <= len(counted.packs) <= 2, counted.packs  # the one that failed, and at most one already started

    counted.packs.clear()
    result = publish(counted, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    assert result.files == 8 and len(counted.packs) <= 8 + 2  # the salted copies of those, no more
    restore(store, sqlite_index, fp, tmp_path / "dst")
    assert read_tree(tmp_path / "dst/inductor") == read_tree(tmp_path / "src/inductor")
