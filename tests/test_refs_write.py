"""What `refs.repoint` and `refs.refresh` report when their write raced another writer's.

A ref's removal cannot be conditional on the version read, so a publish's ref that lands between
the read and the delete goes with it. The caller (gc) must hear that a ref was removed, whatever
the store holds afterwards, to put the index's newest bundle back.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from kcache import refs
from kcache.store import ref_key

KEY = "b" * 32
OLD, NEW, OTHER = "1" * 64, "2" * 64, "3" * 64


def now() -> datetime:
    return datetime.now(timezone.utc)


class PublishAroundDelete:
    """The store a ref's removal runs on: a publish's ref write lands just before (or just after)
    the first delete of `refs/<KEY>`, as a publisher's compare-and-swap would in between."""

    def __init__(self, inner, when: str):
        self.inner, self.when, self.done = inner, when, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _publish(self) -> None:
        self.done = True
        assert refs.advance(self.inner, refs.Ref(KEY, NEW, now()))

    def delete(self, key):
        racing = key == ref_key(KEY) and not self.done
        if racing and self.when == "before":
            self._publish()
        self.inner.delete(key)
        if racing and self.when == "after":
            self._publish()


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_removal_that_raced_a_publish_reports_that_it_moved_the_ref(store, when):
    assert refs.advance(store, refs.Ref(KEY, OLD, now() - timedelta(minutes=1)))
    racing = PublishAroundDelete(store, when)
    assert refs.repoint(racing, KEY, OLD, None)  # reported "nothing moved" before the fix
    assert racing.done
    ref = refs.read(store, KEY)
    # Before: the publish's ref went with ours (the caller must put it back). After: it stays.
    assert ref is None if when == "before" else ref.manifest == NEW


def test_a_repoint_of_a_ref_that_names_another_bundle_reports_nothing_moved(store):
    assert refs.advance(store, refs.Ref(KEY, NEW, now()))
    assert not refs.repoint(store, KEY, OLD, None)
    assert not refs.repoint(store, KEY, OLD, refs.Ref(KEY, OTHER, now()))
    assert not refs.repoint(store, "c" * 32, OLD, None)  # no ref at all
    assert refs.read(store, KEY).manifest == NEW
