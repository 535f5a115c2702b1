"""Pods of one bundle key that publish at once upload each pack once: the second waits for the first's
lease, then finds its blobs in the index. The lease only saves uploads: a holder that died, one
that holds on past the wait, or a publish that fails never stops another publish."""

import threading
import time

import pytest
from trees import write_tree

from kcache import sources
from kcache.errors import IndexDbError, StoreError
from kcache.index import Index
from kcache.publish import PublishConfig, publish
from kcache.store import open_store

LAYERS = sources.select()
TREE = {f"inductor/k/{n}.py": f"kernel {n}\n".encode() * 500 for n in range(40)}
# 17 MiB: packed while it is hashed (publish.LARGE_FILE_BYTES), unless another publish holds the lease
TREE["triton/big/kernel.cubin"] = bytes(range(256)) * 68 * 1024


class GatedStore:
    """A store whose first pack upload waits for `go`, with `uploading` set: its publish holds the
    lease, stopped in the middle of its uploads."""

    def __init__(self, inner):
        self.inner, self.url = inner, inner.url
        self.uploading, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_file(self, key, path):
        if key.startswith("packs/") and not self.uploading.is_set():
            self.uploading.set()
            assert self.go.wait(timeout=120)
        return self.inner.put_file(key, path)


class FailingStore:
    def __init__(self, inner):
        self.inner, self.url = inner, inner.url

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_file(self, key, path):
        raise StoreError(self.url, "the network went away")


def in_thread(work):
    """Run `work()` on a thread; the returned function joins it and gives its result (or raises its error)."""
    outcome = {}

    def run():
        try:
            outcome["result"] = work()
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()

    def joined():
        thread.join(timeout=300)
        assert not thread.is_alive()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    return joined


def second_index(index):
    return Index.open(index.url) if index.url.startswith("postgresql") else Index.open(index.url)


@pytest.fixture
def tree(tmp_path):
    write_tree(tmp_path / "tree", TREE)
    return tmp_path / "tree"


def test_a_publish_of_the_same_key_waits_for_the_first_and_uploads_nothing(tmp_path, index, fp, tree):
    store = open_store(f"file://{tmp_path / 'store'}")
    gated = GatedStore(store)
    first = in_thread(lambda: publish(gated, index, fp, LAYERS, root=tree, env={}))
    assert gated.uploading.wait(timeout=120)  # the first publish is uploading, its lease held

    waiting = threading.Event()
    other = second_index(index)
    try:
        note = lambda msg: waiting.set() if msg.startswith("waiting for another publish") else None  # noqa: E731
        second = in_thread(lambda: publish(store, other, fp, LAYERS, root=tree, env={}, progress=note))
        assert waiting.wait(timeout=120), "the second publish did not wait for the first"
        gated.go.set()
        one, two = first(), second()
    finally:
        gated.go.set()
        other.close()
    assert one.created and not two.created and one.bundle_id == two.bundle_id
    assert one.uploaded_bytes > 0 and (two.uploaded_bytes, two.new_blobs, two.packs) == (0, 0, 0)
    assert len(list(store.list("packs"))) == one.packs  # no second (salted) copy of any pack
    assert index.take_lease(fp.bundle_key, "next", 60) is None  # released


def test_a_lease_whose_holder_died_is_taken_over_at_once(tmp_path, index, fp, tree):
    index.take_lease(fp.bundle_key, "pod-that-died", -1)  # it stopped renewing a second ago
    store = open_store(f"file://{tmp_path / 'store'}")
    notes = []
    result = publish(store, index, fp, LAYERS, root=tree, env={}, progress=notes.append)
    assert result.created and not [n for n in notes if n.startswith("waiting")]
    assert index.take_lease(fp.bundle_key, "next", 60) is None


def test_a_lease_held_past_the_wait_does_not_stop_the_publish(tmp_path, index, fp, tree, caplog):
    index.take_lease(fp.bundle_key, "slow-pod", 600)
    store = open_store(f"file://{tmp_path / 'store'}")
    result = publish(store, index, fp, LAYERS, root=tree, env={}, config=PublishConfig(peer_wait=0))
    assert result.created and result.uploaded_bytes > 0
    assert "still holds its lease" in caplog.text
    assert index.take_lease(fp.bundle_key, "slow-pod", 600) is None  # the holder's lease is untouched


def test_a_failed_publish_releases_its_lease(tmp_path, index, fp, tree):
    store = open_store(f"file://{tmp_path / 'store'}")
    with pytest.raises(StoreError):
        publish(FailingStore(store), index, fp, LAYERS, root=tree, env={})
    notes = []
    assert publish(store, index, fp, LAYERS, root=tree, env={}, progress=notes.append).created
    assert not [n for n in notes if n.startswith("waiting")]


def test_the_holder_renews_its_lease_while_it_uploads(tmp_path, index, fp, tree):
    """A publish that takes longer than a lease keeps it: others go on waiting for it."""
    store = GatedStore(open_store(f"file://{tmp_path / 'store'}"))
    config = PublishConfig(lease_seconds=0.3)  # renewed every 0.1 s
    first = in_thread(lambda: publish(store, index, fp, LAYERS, root=tree, env={}, config=config))
    try:
        assert store.uploading.wait(timeout=120)
        seen = set()
        deadline = time.monotonic() + 60
        # Three different expiry times, each one in force when another publish asked for the lease.
        while len(seen) < 3:
            until = index.take_lease(fp.bundle_key, "other", 60)
            assert until is not None, "the lease lapsed while its publish was still uploading"
            seen.add(until)
            assert time.monotonic() < deadline, "the lease was not renewed"
            threading.Event().wait(0.02)
    finally:
        store.go.set()
    assert first().created


class NoLeases:
    """An index whose lease statements fail (a table it lacks, a connection that drops)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def take_lease(self, *args):
        raise IndexDbError(self.inner.url, "no such table: publish_leases")


def test_an_index_that_keeps_no_leases_costs_no_publish(tmp_path, index, fp, tree, caplog):
    store = open_store(f"file://{tmp_path / 'store'}")
    result = publish(store, NoLeases(index), fp, LAYERS, root=tree, env={})
    assert result.created and result.files == len(TREE)
    assert caplog.text.count("publishing without it") == 1
