"""The node cache against hostile peers and stuck ones: what a pod on the node (or a frozen process)
can plant in DIR or hold there must cost time only, and never keep the node from filling it.

    restore / prefetch ──► NodeCacheStore(DIR) ──► a local store (CountingStore counts pack bytes)
    a peer ─────────────► DIR: links, directories, nested files, locks held forever
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from faulty import CountingStore
from outcome import outcome_within
from trees import nest, write_tree
from unprivileged import run_kcache

from kcache import atomic, filelock, publish
from kcache import prefetch as prefetching
from kcache.cli import main
from kcache.store import pack_key
from kcache.store.local import LocalStore
from kcache.store.nodecache import NodeCacheStore, fill_limit

KiB = 1024


def put_pack(store, data: bytes) -> str:
    pack_id = hashlib.sha256(data).hexdigest()
    store.put_bytes(pack_key(pack_id), data)
    return pack_id


def read(store, pack_id: str, offset: int = 0, length: int | None = None) -> bytes:
    key = pack_key(pack_id)
    with store.open_range(key, offset, store.size(key) - offset if length is None else length) as stream:
        return stream.read()


def cached_path(directory: Path, pack_id: str) -> Path:
    return directory / "packs" / pack_id[:2] / pack_id


def lock_path(directory: Path, pack_id: str) -> Path:
    return directory / "packs" / pack_id[:2] / f".lock-{pack_id}"


@pytest.fixture
def backing(tmp_path):
    return CountingStore(LocalStore(tmp_path / "store"))


def blocked_on(path: Path) -> int:
    """How many flock requests wait (blocked, not polling) on the lock file at `path`: /proc/locks
    lists each as `N: -> FLOCK ADVISORY WRITE PID MAJ:MIN:INODE ...`."""
    inode = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return sum(1 for line in f if "->" in line and line.split()[-3].rsplit(":", 1)[-1] == str(inode))


def wait_for(condition, timeout: float = 60) -> None:
    """Return once `condition()` holds; fail the test after `timeout` seconds (a hang, not slowness)."""
    done, deadline = threading.Event(), time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        done.wait(0.01)


def in_thread(fn, timeout: float = 60):
    """`fn()`'s result, failing the test if it is still running after `timeout` seconds (a hang)."""
    out = outcome_within(fn, timeout)
    if isinstance(out, Exception):
        raise out
    return out


# ---- one fetch per pack per node, also when a corrupt pack is replaced ------------------------------


def test_two_readers_of_a_corrupt_pack_fetch_it_again_once(tmp_path, backing):
    """Both find the damaged copy and queue for the pack's lock; the first replaces it, the second
    must read that replacement, not delete it and fetch again. On ext4 the replacement usually gets
    the freed inode of the damaged file (same number, same size): not a sign that nothing changed."""
    data = os.urandom(300 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    NodeCacheStore(backing, node).warm(pack_id)
    damaged = bytearray(data)
    damaged[1234] ^= 0x01
    cached_path(node, pack_id).write_bytes(bytes(damaged))
    before = backing.read["packs"]
    peer = filelock.acquire(lock_path(node, pack_id), filelock.SHARED, None)  # a pod reading it: no one replaces yet
    results = []

    def reader():
        results.append(read(NodeCacheStore(backing, node), pack_id))  # one wrapper each: its own file locks

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: blocked_on(lock_path(node, pack_id)) >= 2)  # both hashed it, both want to replace it
    finally:
        peer.release()
    for t in threads:
        t.join(60)
    assert results == [data, data]
    assert backing.read["packs"] - before == len(data), "the damaged pack is fetched once for both"
    assert cached_path(node, pack_id).read_bytes() == data


def test_a_damaged_pack_repaired_while_a_reader_waits_to_replace_it_is_kept(tmp_path, backing):
    """What decides that a pack must be fetched again is its content, not its inode and size: a copy
    put right in place (`cp`, or a peer's fill that got the damaged file's freed inode) is the pack."""
    data = os.urandom(200 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    NodeCacheStore(backing, node).warm(pack_id)
    path = cached_path(node, pack_id)
    damaged = bytearray(data)
    damaged[99] ^= 0x01
    path.write_bytes(bytes(damaged))
    before = backing.read["packs"]
    peer = filelock.acquire(lock_path(node, pack_id), filelock.SHARED, None)
    results = []
    thread = threading.Thread(target=lambda: results.append(read(NodeCacheStore(backing, node), pack_id)), daemon=True)
    thread.start()
    try:
        wait_for(lambda: blocked_on(lock_path(node, pack_id)) >= 1)  # it hashed the damaged copy
        with open(path, "r+b") as f:  # the peer repairs it, same inode, same size
            f.write(data)
    finally:
        peer.release()
    thread.join(60)
    assert results == [data]
    assert backing.read["packs"] == before, "the repaired pack is read, not deleted and fetched again"


def test_a_file_put_at_the_path_right_after_a_fill_is_hashed_not_trusted(tmp_path, backing, monkeypatch):
    """A fill trusts the inode it wrote and renamed, not whatever the path names a moment later."""
    data = os.urandom(100 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    path = cached_path(node, pack_id)
    planted = bytearray(data)
    planted[-1] ^= 0xFF
    fsync_dir, planted_once = atomic._fsync_dir, []

    def peer_swaps_the_pack(directory):
        fsync_dir(directory)
        if not planted_once and path.exists():  # a peer replaces the just-renamed pack with its own
            planted_once.append(True)
            other = path.with_name("planted")
            other.write_bytes(bytes(planted))
            os.replace(other, path)

    monkeypatch.setattr(atomic, "_fsync_dir", peer_swaps_the_pack)
    assert read(NodeCacheStore(backing, node), pack_id) == data
    assert planted_once


# ---- what a peer plants where a lock file should be ----------------------------------------------------


def plant(path: Path, what: str, outside: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if what == "directory":
        path.mkdir()
    elif what == "directory-with-files":
        path.mkdir()
        (path / "junk").write_bytes(b"x")
        (path / "sub").mkdir()
        os.symlink(outside, path / "sub" / "out")  # removing the junk must not reach through this
    elif what == "directory-nested-past-the-recursion-limit":  # shutil.rmtree recursed once a level
        nest(path, ["d"] * 1100, "junk", b"x")
        os.symlink(outside, path / "out")
    elif what == "dangling-link":
        os.symlink("/nonexistent/kcache-lock", path)
    elif what == "link-to-a-file-outside":
        os.symlink(outside / "precious", path)


PLANTS = ["directory", "directory-with-files", "directory-nested-past-the-recursion-limit", "dangling-link",
          "link-to-a-file-outside"]


def outside_the_cache(tmp_path: Path) -> Path:
    """A directory beside the node cache holding one file, "precious", that no cleanup may reach."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"not the node cache's")
    return outside


@pytest.mark.parametrize("what", PLANTS)
@pytest.mark.parametrize("where", ["evict-lock", "pack-lock", "lock-of-the-victim"])
def test_a_lock_path_that_is_no_lock_file_is_replaced_and_the_node_still_fills(tmp_path, backing, what, where):
    """One link or directory at DIR/.evict.lock kept every fill on the node off it, for good (every
    fill makes room first); one at a pack's lock kept that pack off it, and once that pack was the
    least recently used, every fill that had to evict it."""
    outside = outside_the_cache(tmp_path)
    node = tmp_path / "node"
    old = put_pack(backing, os.urandom(100 * KiB))
    NodeCacheStore(backing, node).warm(old)
    data = os.urandom(100 * KiB)
    pack_id = put_pack(backing, data)
    target = {"evict-lock": node / ".evict.lock", "pack-lock": lock_path(node, pack_id),
              "lock-of-the-victim": lock_path(node, old)}[where]  # fmt: skip
    if target.exists():
        target.unlink()
    plant(target, what, outside)
    cache = NodeCacheStore(backing, node, max_bytes=150 * KiB, wait=5)  # room for one: `old` must go
    assert read(cache, pack_id, 0, 1000) == data[:1000]
    assert cached_path(node, pack_id).read_bytes() == data, "filled, despite what was planted"
    assert not cached_path(node, old).exists()  # and evicted to the cap
    assert (outside / "precious").read_bytes() == b"not the node cache's"
    assert sorted(p.name for p in outside.iterdir()) == ["precious"]
    assert not target.is_symlink() and not target.is_dir()
    assert cache.warm(pack_id).bytes == len(data)


@pytest.mark.parametrize("what", ["directory", "directory-with-files", "directory-nested-past-the-recursion-limit"])
def test_a_directory_at_a_packs_path_is_replaced_by_the_pack(tmp_path, backing, what):
    """A directory where a pack should be failed every fill of that pack (unlink said EISDIR), so
    every pod on the node read it from the store for good, and prefetch failed on it each round."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_bytes(b"keep")
    data = os.urandom(10 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    plant(cached_path(node, pack_id), what, outside)
    assert read(NodeCacheStore(backing, node, wait=5), pack_id, 0, 100) == data[:100]
    assert cached_path(node, pack_id).read_bytes() == data
    assert (outside / "precious").read_bytes() == b"keep" and sorted(os.listdir(outside)) == ["precious"]
    assert not list((node / "packs" / pack_id[:2]).glob(".tmp-*"))  # the directory went with its whole tree


@pytest.mark.parametrize("what", ["file", "fifo"])
@pytest.mark.parametrize("where", ["packs", "shard"])
def test_what_is_no_directory_at_packs_or_a_shard_is_replaced_by_one(tmp_path, backing, what, where):
    """Two bytes written to DIR/packs (or a FIFO made there) switched the node cache off for good: every
    read went to the store and every prefetch round failed. At packs/<hh> it did so for 1/256 of packs."""
    data = os.urandom(10 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    planted = node / "packs" if where == "packs" else node / "packs" / pack_id[:2]
    planted.parent.mkdir(parents=True)
    if what == "file":
        planted.write_bytes(b"x\n")
    else:
        os.mkfifo(planted)
    assert read(NodeCacheStore(backing, node, wait=5), pack_id, 0, 100) == data[:100]
    assert cached_path(node, pack_id).read_bytes() == data
    assert NodeCacheStore(backing, node).warm(pack_id).bytes == len(data)


# ---- the cap counts what eviction can remove ----------------------------------------------------------


def test_files_below_the_shard_directories_are_neither_counted_nor_cause_evictions(tmp_path, backing):
    """Packs live in packs/<hh>/. A file deeper down, named like a pack, was counted against the cap
    but never removed (eviction deletes packs/<hh>/<id>): the node evicted every real pack on each
    fill, for good."""
    node = tmp_path / "node"
    cache = NodeCacheStore(backing, node, max_bytes=1024 * KiB)
    kept = [put_pack(backing, os.urandom(100 * KiB)) for _ in range(2)]
    for pack_id in kept:
        cache.warm(pack_id)
    phantom_id = "ab" + "0" * 62
    phantom = node / "packs" / "ab" / "ab" / phantom_id
    phantom.parent.mkdir(parents=True)
    with open(phantom, "wb") as f:
        f.truncate(4 * 1024**3)  # sparse: costs its planter nothing
    os.utime(phantom, ns=(2**62, 2**62))  # "used" far in the future: the last to go
    assert cache.usage().packs == 2 and cache.usage().bytes == 200 * KiB
    cache.warm(put_pack(backing, os.urandom(100 * KiB)))
    assert all(cached_path(node, p).exists() for p in kept), "room for all three: nothing evicted"


@pytest.mark.parametrize("where", ["another-shard", "a-nested-directory"])
def test_junk_named_like_a_killed_fills_temp_file_does_not_keep_fills_off_the_node(tmp_path, backing, where):
    """Every fill cleans up temp files first; one in a shard its pack id does not name (whose own
    shard does not exist) failed that clean-up, and with it every fill on the node."""
    node = tmp_path / "node"
    NodeCacheStore(backing, node).warm(put_pack(backing, os.urandom(10 * KiB)))
    temp_id = "ee" + "1" * 62
    junk = (node / "packs" / "cd" if where == "another-shard" else node / "packs" / "cd" / "ee") / f".tmp-{temp_id}-x"
    junk.parent.mkdir(parents=True, exist_ok=True)
    junk.write_bytes(b"junk")
    data = os.urandom(10 * KiB)
    pack_id = put_pack(backing, data)
    assert read(NodeCacheStore(backing, node), pack_id) == data
    assert cached_path(node, pack_id).read_bytes() == data


def test_what_a_killed_removal_set_aside_is_removed_by_the_next_trim(tmp_path, backing):
    """A directory at a lock or pack path is renamed aside to .tmp-junk-<hex> and then removed; a process
    killed in between (a restore whose budget ran out, an OOM kill) left it for good: 200 MB aside from a
    planted .evict.lock stayed through every later trim, counted nowhere. Prefetch's trim removes it now,
    without following a link out of it; packs and a fill's temp file are no junk."""
    outside = outside_the_cache(tmp_path)
    node = tmp_path / "node"
    pack_id = put_pack(backing, os.urandom(10 * KiB))
    NodeCacheStore(backing, node).warm(pack_id)
    shard = cached_path(node, pack_id).parent
    aside = [node / ".tmp-junk-0123456789abcdef", shard / ".tmp-junk-fedcba9876543210"]
    for junk in aside:  # what nodedir.clear leaves when it is killed part-way
        nest(junk, ["d"] * 3, "f", os.urandom(64 * KiB))
        os.symlink(outside, junk / "out")
    os.symlink(outside, shard / ".tmp-junk-00112233445566aa")  # a link by that name: unlinked, not followed
    temp = shard / f".tmp-{pack_id}-x"  # a fill's temp file: fills remove it under the pack's lock
    temp.write_bytes(b"partial")
    NodeCacheStore(backing, node).trim()
    assert not any(os.path.lexists(p) for p in [*aside, shard / ".tmp-junk-00112233445566aa"])
    assert (outside / "precious").read_bytes() == b"not the node cache's"
    assert cached_path(node, pack_id).is_file() and not temp.exists()


# ---- prefetch against a peer that holds a lock and never lets go ------------------------------------


@pytest.fixture
def published(tmp_path, monkeypatch):
    """A bundle of several small packs in a local store."""
    monkeypatch.setattr(publish, "TARGET_PACK_BYTES", 256 * KiB)
    write_tree(tmp_path / "src", {f"inductor/fx/{i:02d}": os.urandom(200 * KiB) for i in range(4)})
    store = tmp_path / "store"
    result = CliRunner().invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m", "--store",
                                       str(store), "--index", f"sqlite:///{tmp_path / 'pub.db'}"],
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    packs = sorted(p.name for p in (store / "packs").rglob("*") if p.is_file() and not p.name.startswith("."))
    assert len(packs) >= 3
    return store, packs


def run_prefetch(store: Path, node: Path, *extra: str):
    args = ["prefetch", "--node-cache", str(node), "--model", "m", "--store", str(store), "--index", "none",
            "--once", "--json", *extra]  # fmt: skip
    return in_thread(lambda: CliRunner().invoke(main, args, catch_exceptions=False))


@pytest.mark.parametrize("held", ["a-packs-lock", "the-evict-lock"])
def test_prefetch_outlasts_a_peer_that_holds_a_lock_forever(tmp_path, published, monkeypatch, held):
    """A frozen pod (or a hostile one) that holds a lock in DIR kept `kcache prefetch` waiting for
    ever: no round ended, no new bundle was followed, SIGTERM was not heard. A round now waits a
    bounded time, warms everything else, and the next round tries again."""
    store, packs = published
    node = tmp_path / "node"
    monkeypatch.setattr(prefetching, "LOCK_WAIT", 0.5)
    stuck = packs[0]
    path = node / ".evict.lock" if held == "the-evict-lock" else lock_path(node, stuck)
    path.parent.mkdir(parents=True)
    with filelock.acquire(path, filelock.EXCLUSIVE, None):  # the peer, for as long as this test runs
        result = run_prefetch(store, node)
    (target,) = json.loads(result.stdout)["targets"]
    cached = {p for p in packs if cached_path(node, p).exists()}
    if held == "the-evict-lock":  # nobody can evict now: fills go on (over the cap if need be)
        assert result.exit_code == 0, result.output + result.stderr
        assert (target["status"], target["fetched"], cached) == ("cached", len(packs), set(packs))
    else:
        assert result.exit_code != 0 and target["status"] == "error" and "locked" in target["reason"]
        assert cached == set(packs) - {stuck}
    again = run_prefetch(store, node)  # the peer let go: the next round completes the node
    assert again.exit_code == 0, again.output + again.stderr
    assert {p for p in packs if cached_path(node, p).exists()} == set(packs)


@pytest.mark.parametrize(("where", "mode"), [("the-evict-lock", 0o444), ("a-packs-lock", 0o444),
                                           ("the-evict-lock", 0o000)])  # fmt: skip
def test_a_lock_file_the_filler_may_not_write_keeps_no_fill_off_the_node(tmp_path, published, where, mode):
    """A peer of the DaemonSet's own user that chmods .evict.lock 0444 made every fill fail (EACCES: only
    shared locks fell back to opening the file for reading), every prefetch round exit 7 with no
    target in its report, and every restore read the store; at one pack's lock, that pack for good.
    flock takes an exclusive lock on a file open for reading as well; and eviction, best-effort, goes
    on without an .evict.lock it cannot open at all."""
    if os.geteuid() != 0:
        pytest.skip("drops root's powers over file modes: needs root")
    store, packs = published
    node = tmp_path / "node"
    planted = node / ".evict.lock" if where == "the-evict-lock" else lock_path(node, packs[0])
    planted.parent.mkdir(parents=True)
    planted.touch(mode=mode)
    planted.chmod(mode)
    args = ["prefetch", "--node-cache", node, "--model", "m", "--store", store, "--index", "none", "--once",
            "--json"]  # fmt: skip
    for _round in range(2):
        proc = run_kcache(args)
        assert proc.returncode == 0, proc.stderr.decode()
        (target,) = json.loads(proc.stdout)["targets"]
        assert (target["status"], target["packs"]) == ("cached", len(packs))
    assert {p for p in packs if cached_path(node, p).exists()} == set(packs)


def test_an_evict_lock_the_filler_cannot_open_is_warned_about_once(tmp_path, published):
    """Eviction goes on without an .evict.lock it cannot open, and said so twice a fill (before the
    download and after it): a prefetch of four packs printed the same warning eight times."""
    if os.geteuid() != 0:
        pytest.skip("drops root's powers over file modes: needs root")
    store, packs = published
    node = tmp_path / "node"
    node.mkdir()
    (node / ".evict.lock").touch(mode=0o000)
    (node / ".evict.lock").chmod(0o000)
    proc = run_kcache(["prefetch", "--node-cache", node, "--model", "m", "--store", store, "--index", "none",
                       "--once", "--json"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["targets"][0]["fetched"] == len(packs)
    warnings = [line for line in proc.stderr.decode().splitlines() if ".evict.lock" in line]
    assert len(warnings) == 1, warnings


def test_a_file_too_large_to_be_the_pack_is_named_as_the_reason_prefetch_could_not_cache_it(tmp_path, published):
    """A file at a pack's path larger than the pack can be is left alone (it may be another bundle's
    larger pack), and prefetch reported the target as failed because the pack "is larger than the cap
    or stayed locked": neither was true, and the operator was sent after the cap or a frozen pod."""
    store, packs = published
    node = tmp_path / "node"
    planted = cached_path(node, packs[0])
    planted.parent.mkdir(parents=True)
    with open(planted, "wb") as f:
        f.truncate(fill_limit(0) + 1)  # sparse: larger than any pack this bundle names can be
    result = run_prefetch(store, node)
    (target,) = json.loads(result.stdout)["targets"]
    assert target["status"] == "error" and result.exit_code != 0
    assert str(planted) in target["reason"] and "larger than the pack can be" in target["reason"], target
    assert "cap" not in target["reason"] and "locked" not in target["reason"]
    assert {p for p in packs if cached_path(node, p).exists()} == set(packs)  # the others are cached


def test_one_pack_that_cannot_be_cached_keeps_none_of_the_others_out(tmp_path, published):
    """prefetch warmed a target's packs with pool.map, which cancels the packs not yet started once one
    fails: with one job, a bad file at the first pack's path kept every other pack out of the cache."""
    store, packs = published
    node = tmp_path / "node"
    planted = cached_path(node, packs[0])  # packs are warmed in this (sorted) order
    planted.parent.mkdir(parents=True)
    with open(planted, "wb") as f:
        f.truncate(fill_limit(0) + 1)
    (target,) = json.loads(run_prefetch(store, node, "--jobs", "1").stdout)["targets"]
    assert target["status"] == "error" and str(planted) in target["reason"], target
    assert {p for p in packs[1:] if cached_path(node, p).exists()} == set(packs[1:])


def test_a_held_evict_lock_costs_a_fill_no_wait(tmp_path, backing):
    """Eviction is best-effort, yet every fill waited for .evict.lock up to its whole deadline: one
    frozen or hostile pod holding it cost every restore on the node half its --timeout."""
    node = tmp_path / "node"
    old = put_pack(backing, os.urandom(100 * KiB))
    NodeCacheStore(backing, node).warm(old)
    data = os.urandom(100 * KiB)
    pack_id = put_pack(backing, data)
    with filelock.acquire(node / ".evict.lock", filelock.EXCLUSIVE, None):  # the peer
        cache = NodeCacheStore(backing, node, max_bytes=150 * KiB, wait=300)  # restore's default half
        assert in_thread(lambda: read(cache, pack_id), timeout=30) == data
    assert cached_path(node, pack_id).read_bytes() == data  # filled, over the cap while nobody could evict
    cache.trim()
    assert not cached_path(node, old).exists(), "the next eviction brings the node under its cap"


def test_a_held_evict_lock_costs_a_prefetch_round_one_wait_not_one_a_pack(tmp_path, published, monkeypatch):
    """Each fill waited LOCK_WAIT (300 s) for .evict.lock: 20 minutes for 9 packs, a day for 1000. Only
    the round's trim, which exists to evict, waits for it now."""
    store, packs = published
    node = tmp_path / "node"
    monkeypatch.setattr(prefetching, "LOCK_WAIT", 5.0)
    args = ["prefetch", "--node-cache", str(node), "--model", "m", "--store", str(store), "--index", "none",
            "--once", "--json", "--jobs", "1"]  # fmt: skip
    node.mkdir()
    with filelock.acquire(node / ".evict.lock", filelock.EXCLUSIVE, None):
        result = in_thread(lambda: CliRunner().invoke(main, args, catch_exceptions=False),
                           timeout=len(packs) * prefetching.LOCK_WAIT)  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    (target,) = json.loads(result.stdout)["targets"]
    assert (target["status"], target["fetched"]) == ("cached", len(packs))


def publish_model(tmp_path: Path, store: Path, model: str, files: int) -> list[str]:
    """Publish `files` files of 200 KiB (a pack each) as `model`; its pack ids."""
    src = tmp_path / f"src-{model}"
    write_tree(src, {f"inductor/fx/{i:02d}": os.urandom(200 * KiB) for i in range(files)})
    before = {p.name for p in (store / "packs").rglob("*")} if (store / "packs").exists() else set()
    result = CliRunner().invoke(main, ["publish", "--from", str(src), "--model", model, "--store", str(store),
                                       "--index", f"sqlite:///{tmp_path / 'pub.db'}"],
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    return sorted(p.name for p in (store / "packs").rglob("*")
                  if p.is_file() and not p.name.startswith(".") and p.name not in before)  # fmt: skip


def test_a_target_over_the_cap_is_reported_over_cap_and_fetched_no_more(tmp_path, monkeypatch):
    """Under a cap smaller than its targets, prefetch evicted the packs it had just warmed to warm the
    next, reported every target cached (exit 0), and fetched them all again each round, for ever. Now
    targets are fitted in their order before anything is fetched; what does not fit is over_cap and
    left alone (exit 7 with --once), and nothing one round warmed is evicted by that round."""
    monkeypatch.setattr(publish, "TARGET_PACK_BYTES", 256 * KiB)
    store = tmp_path / "store"
    first, second = publish_model(tmp_path, store, "a", 3), publish_model(tmp_path, store, "b", 3)
    node = tmp_path / "node"
    args = ["prefetch", "--node-cache", str(node), "--model", "a", "--model", "b", "--store", str(store),
            "--index", "none", "--once", "--json", "--max-bytes", str(1000 * KiB)]  # room for a's 3, not b's too
    for round_ in range(2):
        result = in_thread(lambda: CliRunner().invoke(main, args, catch_exceptions=False))
        assert result.exit_code == 7, result.output + result.stderr
        report = json.loads(result.stdout)
        a, b = report["targets"]
        assert (report["status"], a["status"], b["status"]) == ("error", "cached", "over_cap")
        assert a["fetched"] == (3 if round_ == 0 else 0) and b["fetched"] == 0
        assert "max-bytes" in b["reason"] or "cap" in b["reason"]
        assert {p for p in first + second if cached_path(node, p).exists()} == set(first)


# ---- a long-lived process (the prefetch DaemonSet) and fills at once --------------------------------


def test_each_warm_hashes_the_pack_again(tmp_path, backing):
    """The DaemonSet's one NodeCacheStore remembered every pack it had hashed by (device, inode, size):
    a copy damaged in place afterwards was reported cached round after round, and every pod on the node
    read that pack from the store until the DaemonSet restarted."""
    data = os.urandom(64 * KiB)
    pack_id = put_pack(backing, data)
    node = tmp_path / "node"
    daemon = NodeCacheStore(backing, node)
    assert daemon.warm(pack_id).fetched
    with open(cached_path(node, pack_id), "r+b") as f:  # same inode, same size
        f.seek(1000)
        f.write(bytes([data[1000] ^ 0xFF]))
    assert daemon.warm(pack_id).fetched, "the damaged copy was trusted"
    assert cached_path(node, pack_id).read_bytes() == data
    assert not daemon.warm(pack_id).fetched  # a good copy is kept


def test_a_fill_that_lands_beside_another_leaves_the_cache_under_its_cap(tmp_path, backing, monkeypatch):
    """A fill made room for itself before it downloaded, counting only the packs already in place: fills
    at once each found room, and together left the cache over its cap (4 x 2 MiB under 3 MiB: 8 MiB).
    Here one pod's fill lands while another's is downloading."""
    node = tmp_path / "node"
    first, second = (put_pack(backing, os.urandom(100 * KiB)) for _ in range(2))
    pod_a, pod_b = (NodeCacheStore(backing, node, max_bytes=150 * KiB) for _ in range(2))
    download = pod_b._download

    def meanwhile_a_fills(key, pack_id, size, dst):
        if pack_id == second:
            assert pod_a.warm(first).fetched  # lands after pod_b made room, before its rename
        return download(key, pack_id, size, dst)

    monkeypatch.setattr(pod_b, "_download", meanwhile_a_fills)
    assert pod_b.warm(second).fetched
    usage = pod_b.usage()
    assert usage.bytes <= usage.max_bytes, usage
    assert cached_path(node, second).exists()  # the newest fill stays; the least recently used went


class StallingReads:
    """The real store; a pack's body stalls once it started (a store trickling a byte at a time,
    which no per-read socket timeout catches), until released."""

    def __init__(self, inner):
        self.inner, self.release, self.stalled = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_range(self, key, offset, length):
        stream, outer = self.inner.open_range(key, offset, length), self

        class Stalling:
            def read(self, n=-1):
                outer.stalled.set()
                assert outer.release.wait(120)
                return stream.read(n)

            def close(self):
                stream.close()

        return Stalling()


def test_a_fill_that_stalls_gives_the_pack_back_to_the_store_and_its_lock_to_the_node(tmp_path, backing,
                                                                                       monkeypatch):  # fmt: skip
    """prefetch's fill held the pack's lock for as long as the store trickled: every pod on the node
    waited half its budget on that lock, and the DaemonSet's round never ended."""
    from kcache.errors import StoreError
    from kcache.store import nodecache

    monkeypatch.setattr(nodecache, "FILL_GRACE", 0.5)
    pack_id = put_pack(backing, os.urandom(64 * KiB))
    stalling = StallingReads(backing)
    try:
        with pytest.raises(StoreError, match="too slowly"):
            NodeCacheStore(stalling, tmp_path / "node").warm(pack_id, wait=300)
        assert stalling.stalled.is_set()
        again = NodeCacheStore(backing, tmp_path / "node").warm(pack_id, wait=0)  # the lock is free
        assert again.fetched
    finally:
        stalling.release.set()
