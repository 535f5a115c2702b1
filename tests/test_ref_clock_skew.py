"""A ref stamped by a fast clock does not freeze its key (issue 9.8).

`refs.advance` moves a ref only forward, by the created_at inside the ref it replaces. A ref
written a year ahead (a publisher or an index host with a wrong clock, or a store writer) would
keep every later bundle out of refs/ for that year: refs-mode pods would restore the frozen
bundle forever. A created_at more than refs.MAX_CLOCK_SKEW ahead of the writer's clock does not
block a newer publish; within the bound, forward-only still holds.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from kcache import refs
from kcache.store import ref_key

KEY = "b" * 32
OLD, NEW, OTHER = "1" * 64, "2" * 64, "3" * 64


def now() -> datetime:
    return datetime.now(timezone.utc)


def test_a_ref_from_a_year_ahead_does_not_block_a_newer_publish(store):
    assert refs.advance(store, refs.Ref(KEY, OLD, now() + timedelta(days=365)))
    assert refs.advance(store, refs.Ref(KEY, NEW, now()))
    assert refs.read(store, KEY).manifest == NEW


def test_a_ref_just_ahead_within_the_bound_still_wins(store):
    ahead = now() + refs.MAX_CLOCK_SKEW - timedelta(minutes=1)
    assert refs.advance(store, refs.Ref(KEY, OLD, ahead))
    assert not refs.advance(store, refs.Ref(KEY, NEW, now()))
    assert refs.read(store, KEY).manifest == OLD


def test_forward_only_still_holds_for_honest_clocks(store):
    assert refs.advance(store, refs.Ref(KEY, NEW, now()))
    assert not refs.advance(store, refs.Ref(KEY, OLD, now() - timedelta(hours=1)))
    assert refs.read(store, KEY).manifest == NEW


def test_a_hand_written_future_ref_is_replaced(store):
    """What a store writer (or a broken publisher) leaves: a valid schema-1 ref dated 2999."""
    store.put_bytes(ref_key(KEY), refs.Ref(KEY, OTHER, datetime(2999, 1, 1, tzinfo=timezone.utc)).to_bytes())
    assert refs.advance(store, refs.Ref(KEY, NEW, now()))
    assert refs.read(store, KEY).manifest == NEW


def test_reindex_does_not_take_a_future_created_at_from_a_ref(tmp_path, store, sqlite_index, fp):
    """reindex dates a bundle by its ref: a ref from 2999 would make it the newest, and kept, forever."""
    from trees import write_tree

    from kcache import sources
    from kcache.index import Index
    from kcache.publish import publish
    from kcache.reindex import reindex

    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    bundle = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={}).bundle_id
    store.delete(ref_key(fp.bundle_key))
    far = datetime(2999, 1, 1, tzinfo=timezone.utc)
    store.put_bytes(ref_key(fp.bundle_key), refs.Ref(fp.bundle_key, bundle, far).to_bytes())
    fresh = Index.open(f"sqlite:///{tmp_path / 'fresh.db'}")
    try:
        reindex(store, fresh, jobs=1)
        created = fresh.get_bundle(bundle).created_at
        assert (created if created.tzinfo else created.replace(tzinfo=timezone.utc)) < now() + refs.MAX_CLOCK_SKEW
    finally:
        fresh.close()


def test_a_forged_huge_generation_is_not_carried_forward(store):
    """generation is one more than the replaced ref's: a ref with a 4300-digit generation made the next
    write overflow Python's int-to-text limit, and any huge one would be re-signed forever."""
    doc = (
        refs.Ref(KEY, OLD, now() - timedelta(hours=1))
        .to_bytes()
        .replace(b'"generation":0', b'"generation":' + b"9" * 4300)
    )
    assert b"9" * 4300 in doc
    store.put_bytes(ref_key(KEY), doc)
    assert refs.read(store, KEY).generation > 10**4000  # a valid ref, as far as its shape goes
    assert refs.advance(store, refs.Ref(KEY, NEW, now()))
    written = refs.read(store, KEY)
    assert written.manifest == NEW
    assert written.generation <= (now() + refs.MAX_CLOCK_SKEW).timestamp() * 1000


class _Clock:
    """An index whose clock stamps created_at, as PostgreSQL's does, read by the ref's writer."""

    def __init__(self, at: datetime):
        self.at = at

    def now(self) -> datetime:
        return self.at


def test_a_publisher_whose_clock_runs_behind_the_index_does_not_roll_the_ref_back(store, monkeypatch):
    """A host 15 minutes behind the index took the index-stamped created_at of the newest bundle for a
    fast clock's and replaced it with an older bundle on every unchanged re-publish: ahead is judged
    by the clock that stamped it."""
    index_now = now()
    assert refs.advance(store, refs.Ref(KEY, NEW, index_now))
    behind = index_now - timedelta(minutes=15)
    monkeypatch.setattr(refs, "_host_now", lambda: behind)
    older = refs.Ref(KEY, OLD, index_now - timedelta(hours=1))
    assert not refs.advance_chosen(store, KEY, lambda: older, now=_Clock(index_now).now)
    assert refs.read(store, KEY).manifest == NEW
    # with the index's clock, a ref truly ahead of it is still replaced
    assert refs.advance_chosen(store, KEY, lambda: older, now=_Clock(index_now - timedelta(days=1)).now)
