"""`kcache reindex` on a live index: while publishes commit, into rows that exist, and run again after
being cut off. On SQLite and PostgreSQL."""

from __future__ import annotations

import threading

from trees import write_tree

from kcache import sources
from kcache.index import Index
from kcache.publish import publish
from kcache.reindex import reindex
from kcache.restore import restore
from kcache.yank import unyank, yank

LAYERS = sources.select()


def _publish(tmp_path, store, index, fp, content: bytes, name: str):
    write_tree(tmp_path / name, {"inductor/a": content, "triton/k/k.cubin": content * 2})
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={})


def _rows(index):
    return sorted((b.id, b.status, b.created_at, b.files) for b in index.list_bundles(limit=1000))


class PublishDuringListing:
    """Wraps a store: listing manifests/ first runs `publish()`, as a publisher committing between
    reindex's listing of packs/ and its listing of manifests/ would."""

    def __init__(self, inner, publish_now):
        self.inner, self.url, self._publish = inner, inner.url, publish_now
        self.published = None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def list(self, prefix):
        if prefix == "manifests/" and self.published is None:
            self.published = self._publish()
        return self.inner.list(prefix)


def test_a_publish_between_the_listings_is_indexed_once(tmp_path, store, index, fp):
    first = _publish(tmp_path, store, index, fp, b"first", "v1")
    racing = PublishDuringListing(store, lambda: _publish(tmp_path, store, index, fp, b"second", "v2"))
    rebuilt = reindex(racing, index)
    second = racing.published
    assert second.new_blobs > 0  # its pack went in after reindex had listed packs/
    assert rebuilt.skipped == ()
    assert rebuilt.bundles == 2 and rebuilt.new_bundles == 0  # the publish's own row came first
    assert [r[0] for r in _rows(index)] == sorted([first.bundle_id, second.bundle_id])
    assert restore(store, index, fp, tmp_path / "dst").bundle_id == second.bundle_id


def test_into_an_index_with_rows_nothing_it_has_changes(tmp_path, store, index, fp):
    _publish(tmp_path, store, index, fp, b"good", "v1")
    bad = _publish(tmp_path, store, index, fp, b"bad", "v2")
    yank(store, index, bad.bundle_id, "NaNs")
    store.delete(f"yanks/{bad.bundle_id}")  # a store writer un-yanks by deleting the marker
    before = _rows(index)
    rebuilt = reindex(store, index)
    assert rebuilt.new_bundles == 0 and rebuilt.skipped == ()
    assert _rows(index) == before  # still yanked, same times


class CutOff(BaseException):
    """Ctrl-C, or the pod running reindex evicted."""


class CutAfter:
    """Wraps a store: the listing of manifests/ stops after `n` objects, as a process killed there."""

    def __init__(self, inner, n: int):
        self.inner, self.url, self.n = inner, inner.url, n

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def list(self, prefix):
        for i, info in enumerate(self.inner.list(prefix)):
            if prefix == "manifests/" and i == self.n:
                raise CutOff()
            yield info


def test_cut_off_and_run_again_gives_what_one_run_gives(tmp_path, store, index, fp):
    from kcache import fingerprint

    publishers = Index.open(f"sqlite:///{tmp_path / 'publishers.db'}")
    for i in range(4):
        model = fingerprint.compute({**fp.facts, "model.id": f"model-{i}"})
        _publish(tmp_path, store, publishers, model, f"content {i}".encode(), f"v{i}")
    yank(store, publishers, publishers.list_bundles()[0].id, "NaNs")
    publishers.close()
    try:
        reindex(CutAfter(store, 2), index)
    except CutOff:
        pass
    assert len(_rows(index)) == 2  # cut off in the bundle pass, two bundles in
    again = reindex(store, index)
    assert again.skipped == () and again.bundles == 4 and again.new_bundles == 2
    one_run = Index.open(f"sqlite:///{tmp_path / 'one-run.db'}")
    reindex(store, one_run)
    assert _rows(index) == _rows(one_run) and sum(r[1] == "yanked" for r in _rows(index)) == 1
    one_run.close()


def test_into_an_index_with_rows_packs_gc_condemned_stay_condemned(tmp_path, store, index, fp):
    """reindex recorded every pack it found as a publish does, and a publish revives the condemned packs
    it names: so each run un-condemned every pack gc had condemned, and with reindex run before each gc
    (as gc's refusal of an index behind the publishers' asks) no pack was ever swept."""
    from datetime import timedelta

    from kcache import gc
    from kcache.index import lifecycle

    _publish(tmp_path, store, index, fp, b"old", "v1")
    _publish(tmp_path, store, index, fp, b"new", "v2")
    policy = gc.Policy(keep_last=1, older_than=timedelta(0), grace=timedelta(hours=6))
    assert gc.execute(store, index, gc.plan(store, index, policy)).packs_condemned
    condemned = {p.id: p.condemned_at for p in lifecycle.packs(index) if p.condemned_at}
    assert reindex(store, index).skipped == ()
    assert {p.id: p.condemned_at for p in lifecycle.packs(index) if p.condemned_at} == condemned
    later = gc.plan(store, index, policy, now=index.now() + timedelta(hours=7))
    assert {p.id for p in later.sweep} == set(condemned)


class PausedAtCommit:
    """Wraps an index: a publish's first commit waits, its manifest already in the store, until `go_on`."""

    def __init__(self, inner):
        self.inner, self.at_commit, self.go_on = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_bundle(self, *args, **kwargs):
        if not self.at_commit.is_set():
            self.at_commit.set()
            assert self.go_on.wait(60)
        return self.inner.add_bundle(*args, **kwargs)


def test_a_publish_committing_while_reindex_runs_is_its_keys_newest(tmp_path, store, index, fp):
    _publish(tmp_path, store, index, fp, b"first", "v1")
    paused, box = PausedAtCommit(index), {}
    publisher = threading.Thread(target=lambda: box.update(r=_publish(tmp_path, store, paused, fp, b"second", "v2")))
    publisher.start()
    assert paused.at_commit.wait(60)
    rebuilt = reindex(store, index)  # its manifest is in the store, its row not yet in the index
    paused.go_on.set()
    publisher.join(60)
    second = box["r"]
    assert rebuilt.publishing == (second.bundle_id,) and rebuilt.skipped == ()
    assert second.created
    assert index.newest_bundle(fp.bundle_key).id == second.bundle_id
    assert restore(store, index, fp, tmp_path / "dst").bundle_id == second.bundle_id
    assert reindex(store, index).publishing == ()  # once the publish let go of its lease


def test_a_yank_undone_while_reindex_runs_stays_undone(tmp_path, store, index, fp):
    _publish(tmp_path, store, index, fp, b"first", "v1")
    second = _publish(tmp_path, store, index, fp, b"second", "v2")
    yank(store, index, second.bundle_id, "a false alarm")
    # The undo lands after reindex listed yanks/, before it reaches the manifests.
    undoing = PublishDuringListing(store, lambda: unyank(store, index, second.bundle_id))
    rebuilt = reindex(undoing, index)
    assert undoing.published.status == "active" and rebuilt.skipped == ()
    assert index.get_bundle(second.bundle_id).status == "active"
    assert restore(store, index, fp, tmp_path / "dst").bundle_id == second.bundle_id


def test_a_held_lease_leaves_only_a_manifest_written_moments_ago_to_its_publish(tmp_path, store, index, fp):
    """A fleet that publishes a key all the time holds its lease most of the time: reindex rebuilding a lost
    index meanwhile must still index the key's older manifests (to gc, a manifest without a row is an
    orphan), leaving only one its publish may be about to commit."""
    import os
    from datetime import datetime, timedelta, timezone

    from kcache.store import manifest_key

    lost = Index.open(f"sqlite:///{tmp_path / 'lost.db'}")  # the index the rows were in
    old = _publish(tmp_path, store, lost, fp, b"old", "v1")
    fresh = _publish(tmp_path, store, lost, fp, b"fresh", "v2")
    lost.close()
    an_hour_ago = (datetime.now(timezone.utc) - timedelta(hours=1)).timestamp()
    os.utime(store.root / manifest_key(old.bundle_id), (an_hour_ago, an_hour_ago))
    assert index.take_lease(fp.bundle_key, "a publish of this key", 60) is None
    rebuilt = reindex(store, index)
    assert rebuilt.publishing == (fresh.bundle_id,)
    assert index.get_bundle(old.bundle_id).status == "active"
