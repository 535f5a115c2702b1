"""The node cache wrapper: packs from local disk first, verified, filled once, capped by LRU."""

from __future__ import annotations

import hashlib
import os
import threading

import pytest
from faulty import CountingStore, corrupting
from hypothesis import given
from hypothesis import strategies as st

from kcache import filelock, sizes
from kcache.errors import ConfigError, IntegrityError, StoreError
from kcache.store import nodedir, pack_key
from kcache.store.local import LocalStore
from kcache.store.nodecache import NodeCacheStore, max_bytes_from_env

KiB = 1024


def put_pack(store, data: bytes) -> str:
    pack_id = hashlib.sha256(data).hexdigest()
    store.put_bytes(pack_key(pack_id), data)
    return pack_id


def read(store, pack_id: str, offset: int = 0, length: int | None = None) -> bytes:
    key = pack_key(pack_id)
    with store.open_range(key, offset, store.size(key) - offset if length is None else length) as stream:
        return stream.read()


@pytest.fixture
def backing(tmp_path):
    return CountingStore(LocalStore(tmp_path / "store"))


def cached_path(directory, pack_id):
    return directory / "packs" / pack_id[:2] / pack_id


def test_a_pack_is_fetched_once_then_read_from_the_node(tmp_path, backing):
    data = os.urandom(300 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    assert read(NodeCacheStore(backing, node), pack_id, 1000, 5000) == data[1000:6000]
    assert backing.read["packs"] == len(data)  # the whole pack, once
    assert cached_path(node, pack_id).read_bytes() == data
    # another process (a fresh wrapper) reads it from the node: nothing more from the store
    assert read(NodeCacheStore(backing, node), pack_id) == data
    assert backing.read["packs"] == len(data)


def test_a_corrupt_cached_pack_is_detected_refetched_and_replaced(tmp_path, backing):
    data = os.urandom(200 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    read(NodeCacheStore(backing, node), pack_id)
    damaged = bytearray(data)
    damaged[123] ^= 0x01
    cached_path(node, pack_id).write_bytes(bytes(damaged))
    assert read(NodeCacheStore(backing, node), pack_id) == data
    assert backing.read["packs"] == 2 * len(data)
    assert cached_path(node, pack_id).read_bytes() == data


def test_a_pack_that_does_not_hash_to_its_id_in_the_store_is_not_cached(tmp_path, backing):
    data = os.urandom(100 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    # the store returns damaged bytes: the fill refuses them and the reader gets the store's bytes
    got = read(NodeCacheStore(corrupting(backing), node), pack_id)
    assert got != data and len(got) == len(data)
    assert not cached_path(node, pack_id).exists()
    with pytest.raises(IntegrityError):
        NodeCacheStore(corrupting(backing), node).warm(pack_id)
    assert not list((node / "packs").rglob(".tmp-*"))


def test_a_reader_whose_wait_runs_out_reads_the_store(tmp_path, backing):
    data = os.urandom(50 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    lock_path = node / "packs" / pack_id[:2] / f".lock-{pack_id}"
    lock_path.parent.mkdir(parents=True)
    with filelock.acquire(lock_path, filelock.EXCLUSIVE, None):  # another pod is filling it
        assert read(NodeCacheStore(backing, node, wait=0.0), pack_id) == data
    assert not cached_path(node, pack_id).exists()


def finished_fills() -> None:
    """Wait for the fills this process left running in the background (they give the lock back, not
    the download): what they read from the store counts too."""
    for thread in threading.enumerate():
        if thread.name == "kcache-node-fill":
            thread.join(60)
            assert not thread.is_alive(), "a fill hung"


@pytest.mark.parametrize("parts", [1, 4])
def test_past_the_wait_a_pack_is_read_from_the_store_once(tmp_path, backing, parts):
    """Once a restore's node-cache wait had run out, each pack whose lock was free still started a fill
    with no time left: downloaded whole in the background, given up on at once, and read from the store
    again, range by range (a pack read in 8 ranges: 8 downloads at once, 9 times the pack)."""
    data = os.urandom(2 * 1024 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    cache = NodeCacheStore(backing, node, wait=0.0)  # restore's wait, already spent
    part = len(data) // parts
    assert b"".join(read(cache, pack_id, i * part, part) for i in range(parts)) == data
    finished_fills()
    assert backing.read["packs"] == len(data), "each byte once, from the store"
    assert not list(node.rglob(pack_id)), "no fill started with no time left"


def test_waiters_read_what_the_first_reader_fetched(tmp_path, backing):
    data = os.urandom(400 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    results, barrier = [], threading.Barrier(6)

    def reader():
        store = NodeCacheStore(backing, node)  # one per thread: each its own file locks, as processes
        barrier.wait()
        results.append(read(store, pack_id))

    threads = [threading.Thread(target=reader) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [data] * 6
    assert backing.read["packs"] == len(data)


def test_least_recently_used_packs_are_evicted_over_the_cap(tmp_path, backing):
    packs = [put_pack(backing, os.urandom(100 * KiB)) for _ in range(4)]
    node = tmp_path / "node"
    cache = NodeCacheStore(backing, node, max_bytes=250 * KiB)
    for pack_id in packs[:2]:
        cache.warm(pack_id)
    os.utime(cached_path(node, packs[0]), ns=(1, 1))  # packs[0] was used long ago
    os.utime(cached_path(node, packs[1]), ns=(2, 2))
    read(NodeCacheStore(backing, node), packs[0])  # ...and now again: packs[1] is the oldest
    cache.warm(packs[2])
    assert sorted(p for p in packs if cached_path(node, p).exists()) == sorted([packs[0], packs[2]])
    assert not (node / "packs" / packs[1][:2] / f".lock-{packs[1]}").exists()
    assert cache.usage().bytes <= 250 * KiB


def test_packs_kept_by_the_caller_are_not_evicted_by_its_fills(tmp_path, backing):
    """prefetch keeps what its round warmed: a later fill of the round evicts other packs first, even
    ones used since, or overshoots the cap; it had evicted the round's own least recently used."""
    node = tmp_path / "node"
    cache = NodeCacheStore(backing, node, max_bytes=250 * KiB)
    warmed, other, later = (put_pack(backing, os.urandom(100 * KiB)) for _ in range(3))
    cache.warm(warmed)
    cache.warm(other)  # used after it: LRU alone would evict `warmed`
    with cache.keeping({warmed}):
        cache.warm(later)
        cache.trim()
    assert [cached_path(node, p).exists() for p in (warmed, other, later)] == [True, False, True]


def test_a_pack_evicted_between_its_reads_is_not_fetched_whole_again(tmp_path, backing):
    """A reader lets go of a pack between the ranges it reads of it: under cap pressure a fill (its own
    or a peer's) evicted it in between, and the next range fetched the whole pack again, evicting the
    other, whose next range did the same: a pack read in k ranges came from the store k times whole,
    more than reading its ranges from the store with no node cache at all."""
    one, two = (os.urandom(100 * KiB) for _ in range(2))
    a, b = put_pack(backing, one), put_pack(backing, two)
    cache = NodeCacheStore(backing, tmp_path / "node", max_bytes=150 * KiB)
    got = []
    for at in range(0, 100 * KiB, 25 * KiB):  # both packs read a quarter at a time, taking turns
        got += [read(cache, a, at, 25 * KiB), read(cache, b, at, 25 * KiB)]
    assert b"".join(got[0::2]) == one and b"".join(got[1::2]) == two
    assert backing.read["packs"] <= 2 * 200 * KiB  # at most each pack once whole and once by ranges


def test_a_pack_being_read_is_never_evicted(tmp_path, backing):
    packs = [put_pack(backing, os.urandom(100 * KiB)) for _ in range(2)]
    node = tmp_path / "node"
    reader = NodeCacheStore(backing, node, max_bytes=150 * KiB)
    stream = reader.open_range(pack_key(packs[0]), 0, 10)
    try:
        NodeCacheStore(backing, node, max_bytes=150 * KiB).warm(packs[1])
        assert cached_path(node, packs[0]).exists()  # held: the cap waits
    finally:
        stream.close()
    NodeCacheStore(backing, node, max_bytes=150 * KiB).trim()
    assert not cached_path(node, packs[0]).exists() and cached_path(node, packs[1]).exists()


def test_a_pack_just_filled_is_not_evicted_before_its_reader_reads_it(tmp_path, backing, monkeypatch):
    """A peer's fill that makes room as soon as the filler lets go of the pack's exclusive lock must not
    take the pack just written (the newest, under a cap that holds one pack): the filler let go and took
    the lock again shared to read it, the peer evicted it in between, and the reader fetched it from the
    store again (twice, then read the store as well)."""
    packs = [put_pack(backing, os.urandom(100 * KiB)) for _ in range(2)]
    node = tmp_path / "node"
    reader, peer = (NodeCacheStore(backing, node, max_bytes=150 * KiB) for _ in range(2))
    lock, peer_started, peer_read = nodedir.lock, [], []

    class PeerFillsOnRelease(filelock.FileLock):
        def release(self) -> None:
            super().release()
            if cached_path(node, packs[0]).exists() and not peer_started:
                peer_started.append(True)
                peer_read.append(read(peer, packs[1]))  # another pod's fill makes room for its own pack

    def lock_watched(path, mode, deadline):
        held = lock(path, mode, deadline)
        if held is None or mode != filelock.EXCLUSIVE or path.name != f".lock-{packs[0]}":
            return held
        return PeerFillsOnRelease(held.fd, held.path)

    monkeypatch.setattr(nodedir, "lock", lock_watched)
    data = read(reader, packs[0])
    assert peer_read and hashlib.sha256(data).hexdigest() == packs[0]
    assert backing.read["packs"] == 200 * KiB  # each pack from the store once


def test_a_pack_over_the_cap_is_read_from_the_store(tmp_path, backing):
    data = os.urandom(100 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    assert read(NodeCacheStore(backing, node, max_bytes=10 * KiB), pack_id) == data
    assert not cached_path(node, pack_id).exists()



MiB = 1024 * KiB
PADDED = 64 * MiB  # past any pack its bundle's 50 KiB could be in, well under the cap


def pad(backing, pack_id: str, size: int) -> None:
    """What a store writer can do: grow the object, junk after the real pack."""
    path = backing.inner.root / pack_key(pack_id)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(size)  # sparse: costs no disk here


@pytest.mark.parametrize("how", ["read-as-restore", "read-without-hint", "warm-as-prefetch"])
def test_a_padded_pack_is_refused_unread_and_evicts_nothing(tmp_path, backing, how):
    """The fill sizes a pack by what its bundle needs, not by the store's object: a pack padded to
    just under the cap would evict every other pack and then fail its hash, on every pod."""
    node = tmp_path / "node"
    cache = NodeCacheStore(backing, node, max_bytes=PADDED + 64 * KiB)
    kept = put_pack(backing, os.urandom(100 * KiB))
    cache.warm(kept)
    data = os.urandom(50 * KiB)
    padded = put_pack(backing, data)
    pad(backing, padded, PADDED)
    before = backing.read["packs"]
    if how == "warm-as-prefetch":
        with pytest.raises(IntegrityError, match="more than"):
            cache.warm(padded, need=len(data))
    else:
        if how == "read-as-restore":
            cache.expect_reads({padded: len(data)})
        assert read(cache, padded, 0, 1000) == data[:1000]  # from the store
    assert backing.read["packs"] - before <= 1000  # the padding was never downloaded
    assert cached_path(node, kept).exists()
    assert sorted(p.name for p in node.rglob("*") if p.is_file() and padded in p.name) in ([], [f".lock-{padded}"])


def test_a_large_pack_read_from_its_start_is_cached_when_its_bundle_needs_it_whole(tmp_path, backing):
    """The hint restore gives (the largest offset+length it will read from each pack) is what lets a
    pack larger than the slack for unnamed blobs be cached at all."""
    data = b"\0" * (48 * MiB)  # one large file's pack
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    assert read(NodeCacheStore(backing, node), pack_id, 0, 10) == data[:10]
    assert not cached_path(node, pack_id).exists()  # 10 bytes asked for: 48 MiB is more than a pack's slack
    cache = NodeCacheStore(backing, node)
    cache.expect_reads({pack_id: len(data) - 100})  # the trailer lies past the last blob
    assert read(cache, pack_id, 0, 10) == data[:10]
    assert cached_path(node, pack_id).stat().st_size == len(data)


def test_restore_through_the_node_cache_keeps_other_packs_when_a_pack_is_padded(tmp_path, store, sqlite_index):
    """The reviewer's case end to end: restore hits, the node keeps what it had, no junk is written."""
    from fixed_facts import FACTS
    from trees import write_tree

    from kcache import fingerprint, sources
    from kcache import manifest as manifests
    from kcache.publish import publish
    from kcache.restore import restore
    from kcache.store import manifest_key

    def packs_of(bundle_id: str) -> set[str]:
        return {e.pack for e in manifests.parse(store.get_bytes(manifest_key(bundle_id)), bundle_id).entries}

    backing = CountingStore(store)
    node = tmp_path / "node"
    published = {}
    for model in ("a", "b"):
        fp = fingerprint.compute({**FACTS, "model.id": model})
        write_tree(tmp_path / model, {f"inductor/{model}": os.urandom(4096)})
        published[model] = (fp, packs_of(publish(store, sqlite_index, fp, sources.select(), root=tmp_path / model,
                                                 env={}).bundle_id))  # fmt: skip
    restore(NodeCacheStore(backing, node, max_bytes=PADDED + MiB), sqlite_index, published["a"][0], tmp_path / "ra")
    (padded,) = published["b"][1]
    pad(backing, padded, PADDED)
    before = backing.read["packs"]
    result = restore(NodeCacheStore(backing, node, max_bytes=PADDED), sqlite_index, published["b"][0], tmp_path / "rb")
    assert result.status == "hit"
    assert {p.name for p in (node / "packs").rglob("*") if p.is_file() and "." not in p.name} == published["a"][1]
    assert backing.read["packs"] - before < 64 * KiB  # B's blobs by their range, none of the padding

def test_temp_files_of_killed_fills_are_removed(tmp_path, backing):
    pack_id = put_pack(backing, os.urandom(10 * KiB))
    node = tmp_path / "node"
    stale = node / "packs" / pack_id[:2] / f".tmp-{pack_id}-abc123"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a pack")
    NodeCacheStore(backing, node).trim()
    assert not stale.exists()


@pytest.mark.parametrize("whose", ["another pack's", "its own"])
def test_a_disk_filled_by_killed_fills_is_cleared_by_the_next_fill(tmp_path, backing, tmpfs, whose):
    """Temp files of fills killed part-way (restores out of budget, OOM kills) can fill the node's disk:
    the next fill removes them before it judges the room left, or no fill would ever run there again.
    Its own pack's too, though it holds that pack's lock (which kept them from being removed): a pod
    killed while it filled the one pack left room for nothing, and every later pod read it from the store."""
    data = os.urandom(200 * KiB)
    pack_id = put_pack(backing, data)
    node = tmpfs(tmp_path / "node", "512k")
    other = pack_id if whose == "its own" else "ab" + "0" * 62
    stale = node / "packs" / other[:2] / f".tmp-{other}-killed"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(os.urandom(400 * KiB))
    assert read(NodeCacheStore(backing, node), pack_id) == data
    assert not stale.exists() and cached_path(node, pack_id).read_bytes() == data
    assert backing.read["packs"] == 200 * KiB


def test_an_unusable_node_cache_only_costs_time(tmp_path, backing):
    data = os.urandom(10 * KiB)
    pack_id = put_pack(backing, data)
    (tmp_path / "node").write_text("a file, not a directory")
    assert read(NodeCacheStore(backing, tmp_path / "node"), pack_id) == data


def read_bounded(store, pack_id: str, offset: int, length: int) -> bytes | None:
    """`read` in a thread; None if it is still running after 10 s: a hang, not a slow read."""
    out = {}

    def run():
        out["data"] = read(store, pack_id, offset, length)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(10)
    return None if thread.is_alive() else out.get("data")


@pytest.mark.parametrize("planted", ["fifo", "link-to-/dev/zero", "link-to-a-good-copy", "directory"])
def test_what_is_not_a_regular_file_at_a_packs_path_is_never_read(tmp_path, backing, planted):
    """A peer can put anything at a pack's path; reading it must not hang past the wait or leave DIR."""
    data = os.urandom(10 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    path = cached_path(node, pack_id)
    path.parent.mkdir(parents=True)
    (tmp_path / "copy").write_bytes(data)
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "directory":
        path.mkdir()
    else:
        target = tmp_path / "copy" if planted == "link-to-a-good-copy" else "/dev/zero"
        os.symlink(target, path)
    assert read_bounded(NodeCacheStore(backing, node, wait=0.5), pack_id, 0, 100) == data[:100]
    if planted != "directory":  # a corrupt entry: replaced by the real pack
        assert not path.is_symlink() and path.read_bytes() == data
    assert (tmp_path / "copy").read_bytes() == data


def test_a_cached_file_larger_than_the_pack_can_be_is_not_hashed(tmp_path, backing):
    """A sparse 4 GiB file costs its planter nothing; hashing it would cost every reader its wait."""
    data = os.urandom(10 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    path = cached_path(node, pack_id)
    path.parent.mkdir(parents=True)
    with open(path, "wb") as f:
        f.truncate(4 * 1024**3)
    cache = NodeCacheStore(backing, node, wait=0.5)
    cache.expect_reads({pack_id: len(data)})
    assert read_bounded(cache, pack_id, 0, 100) == data[:100]
    assert backing.read["packs"] == 100  # from the store, by its range


@pytest.mark.parametrize("linked", ["packs", "shard"])
def test_a_linked_directory_in_the_cache_is_replaced_not_written_through(tmp_path, backing, linked):
    """A peer that plants packs/ or packs/<hh> as a link must not make fills write outside DIR,
    where the cap never sees them."""
    data = os.urandom(10 * KiB)
    pack_id = put_pack(backing, data)
    node, outside = tmp_path / "node", tmp_path / "outside"
    outside.mkdir()
    (node / "packs").mkdir(parents=True)
    link = node / "packs" if linked == "packs" else node / "packs" / pack_id[:2]
    if linked == "packs":
        (node / "packs").rmdir()
    os.symlink(outside, link)
    cache = NodeCacheStore(backing, node)
    assert cache.usage().packs == 0  # not counted through the link either
    assert read(cache, pack_id, 0, 10) == data[:10]
    assert list(outside.iterdir()) == []
    assert not link.is_symlink() and link.is_dir()
    assert cache.usage().packs == 1 and cached_path(node, pack_id).read_bytes() == data


def test_keys_other_than_packs_pass_through(tmp_path, backing):
    backing.put_bytes("manifests/ab/abc", b"m")
    backing.put_bytes("packs/ab/not-a-sha256", b"p")
    store = NodeCacheStore(backing, tmp_path / "node")
    for key in ("manifests/ab/abc", "packs/ab/not-a-sha256"):
        with store.open_range(key, 0, 1) as stream:
            assert stream.read()
    with pytest.raises(StoreError):  # the store's own refusal, never a path under the node cache
        store.open_range("packs/../../etc/passwd", 0, 1)
    assert not (tmp_path / "node").exists()


@pytest.mark.parametrize("text, expected", [("", 32 * 1024**3), ("1048576", 1024**2), ("50Gi", 50 * 1024**3),
                                            ("512MiB", 512 * 1024**2)])  # fmt: skip
def test_the_cap_comes_from_the_environment(text, expected):
    assert max_bytes_from_env({"KCACHE_NODE_CACHE_MAX_BYTES": text}) == expected


@pytest.mark.parametrize("text", ["lots", "-5", "0", "12b", "1.5x", "9" * 5000, "9" * 5000 + "Gi", "1." + "9" * 5000])
def test_a_bad_cap_is_a_config_error(text):
    with pytest.raises(ConfigError):
        max_bytes_from_env({"KCACHE_NODE_CACHE_MAX_BYTES": text})


@given(st.integers(min_value=1, max_value=2**70), st.sampled_from([("", 1), ("Ki", 1024), ("Mi", 1024**2),
                                                                   ("GiB", 1024**3), ("T", 1024**4)]))  # fmt: skip
def test_sizes_read_every_unit_as_binary(n, unit):
    suffix, factor = unit
    assert sizes.parse(f"{n}{suffix}", "--max-bytes") == n * factor
