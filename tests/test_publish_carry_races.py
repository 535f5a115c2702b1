"""Carrying publishes (`kcache watch`'s) that overlap other publishes and yanks of their key: the newest
bundle keeps every replica's kernels and never a yanked bundle's, and a donor that cannot be read
fails the publish rather than dropping its files. Interleavings come from wrapped stores and indexes."""

from __future__ import annotations

import pytest
from trees import write_tree

from kcache import manifest as manifests
from kcache import sources
from kcache.errors import IndexDbError, StoreError
from kcache.publish import PublishConfig, publish
from kcache.store import manifest_key
from kcache.store.local import LocalStore

LAYERS = sources.select()


class Wrapped:
    """Everything as `inner` does, but what a test overrides."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _paths(store, bundle_id) -> set[str]:
    return {e.path for e in manifests.parse(store.get_bytes(manifest_key(bundle_id)), bundle_id).entries}


def _publish(tmp_path, store, index, fp, name, files, carry=True):
    write_tree(tmp_path / name, files)
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={},
                   config=PublishConfig(carry_newest=carry, peer_wait=0))  # fmt: skip


@pytest.mark.parametrize("fault", ["store", "index"])
def test_a_donor_that_cannot_be_read_fails_the_publish(tmp_path, index, fp, fault):
    """A store that answers 503 for the donor's manifest, or an index that cannot say whether the
    donor is still active: carrying nothing, the publish committed a newest bundle without the
    other replicas' kernels. It fails instead, and watch publishes again when next due."""
    store = LocalStore(tmp_path / "store")
    theirs = _publish(tmp_path, store, index, fp, "a", {"triton/kA/k.cubin": b"theirs"})
    flaky_store, flaky_index = Wrapped(store), Wrapped(index)
    if fault == "store":
        def size(key):
            if key == manifest_key(theirs.bundle_id):
                raise StoreError(store.url, "503 SlowDown (reached max retries: 6)")
            return store.size(key)

        flaky_store.size = size
    else:
        def get_bundle(id_or_prefix):
            raise IndexDbError(index.url, "server closed the connection unexpectedly")

        flaky_index.get_bundle = get_bundle
    try:
        _publish(tmp_path, flaky_store, flaky_index, fp, "b", {"triton/kB/k.cubin": b"ours"})
    except (StoreError, IndexDbError):
        pass
    else:
        assert fault == "index", "the publish went on without the donor's manifest"
    assert "triton/kA/k.cubin" in _paths(store, index.newest_bundle(fp.bundle_key).id)


@pytest.mark.parametrize("when", ["uploading", "committing"])
def test_a_bundle_committed_after_the_donor_was_chosen_is_carried_too(tmp_path, index, fp, when):
    """Pod C's publish commits while pod B's is under way, after B chose its donor: while B
    uploads (its lease lost or never waited for), or between B's last look at the newest bundle
    and its commit. B's bundle, the newest, dropped C's kernel: no later pod got it."""
    store = LocalStore(tmp_path / "store")
    _publish(tmp_path, store, index, fp, "a", {"triton/kA/k.cubin": b"a"})
    gated_store, gated_index = Wrapped(store), Wrapped(index)
    done = []

    def publish_c():
        if not done:
            done.append(_publish(tmp_path, store, index, fp, "c", {"triton/kC/k.cubin": b"c"}))

    if when == "uploading":
        def put_file(key, path):
            publish_c()
            return store.put_file(key, path)

        gated_store.put_file = put_file
    else:
        def add_bundle(row, **kwargs):
            publish_c()
            return index.add_bundle(row, **kwargs)

        gated_index.add_bundle = add_bundle
    ours = _publish(tmp_path, gated_store, gated_index, fp, "b", {"triton/kB/k.cubin": b"b"})
    newest = index.newest_bundle(fp.bundle_key)
    assert done and newest.id == ours.bundle_id
    assert _paths(store, newest.id) == {"triton/kA/k.cubin", "triton/kB/k.cubin", "triton/kC/k.cubin"}


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_yank_of_the_donor_at_the_commit_keeps_its_files_out(tmp_path, index, fp, when):
    """`kcache yank` of the donor lands just before or just after the carrying publish's commit (its
    look at the donor was earlier: its manifest PUT is slow). The bundle it committed carried the
    yanked bundle's bad kernel, active and the key's newest: every new pod restored it."""
    from kcache.yank import yank

    store = LocalStore(tmp_path / "store")
    _publish(tmp_path, store, index, fp, "a", {"triton/good/k.cubin": b"good"}, carry=False)
    bad = _publish(tmp_path, store, index, fp, "b", {"triton/good/k.cubin": b"good", "triton/BAD/k.cubin": b"NaNs"},
                   carry=False)  # fmt: skip
    yanking = Wrapped(index)

    def add_bundle(row, **kwargs):
        if when == "before":
            yank(store, index, bad.bundle_id, "NaNs")
        created = index.add_bundle(row, **kwargs)
        if when == "after" and not yanking.__dict__.get("done"):
            yanking.done = True
            yank(store, index, bad.bundle_id, "NaNs")
        return created

    yanking.add_bundle = add_bundle
    _publish(tmp_path, store, yanking, fp, "c", {"triton/good/k.cubin": b"good", "triton/mine/k.cubin": b"mine"})
    active = [b for b in index.list_bundles(bundle_key=fp.bundle_key) if b.status == "active"]
    assert all("triton/BAD/k.cubin" not in _paths(store, b.id) for b in active)
    assert _paths(store, index.newest_bundle(fp.bundle_key).id) == {"triton/good/k.cubin", "triton/mine/k.cubin"}


def test_a_carrying_publish_overtaken_many_times_still_commits(tmp_path, index, fp):
    """Replicas stopped together publish at once without the lease, and each round only one of them
    commits: a publish gave up after 8 rounds (4 of 12 pods' kernels in no bundle). It goes on,
    pausing a jittered moment between tries, for as long as other commits keep overtaking it."""
    store = LocalStore(tmp_path / "store")
    _publish(tmp_path, store, index, fp, "a", {"triton/kA/k.cubin": b"a"})
    overtaking = Wrapped(index)
    others: list = []

    def add_bundle(row, **kwargs):
        if len(others) < 12:  # another replica commits first, twelve times over
            n = len(others)
            others.append(_publish(tmp_path, store, index, fp, f"o{n}", {f"triton/k{n}/k.cubin": b"%d" % n}))
        return index.add_bundle(row, **kwargs)

    overtaking.add_bundle = add_bundle
    ours = _publish(tmp_path, store, overtaking, fp, "b", {"triton/kB/k.cubin": b"b"})
    newest = index.newest_bundle(fp.bundle_key)
    assert len(others) == 12 and newest.id == ours.bundle_id
    assert _paths(store, newest.id) >= {"triton/kA/k.cubin", "triton/kB/k.cubin"} | {
        f"triton/k{n}/k.cubin" for n in range(12)}
