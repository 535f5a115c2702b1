"""The publish lease of a bundle key, on SQLite and PostgreSQL: taken, renewed, waited for, taken over
once expired (by one of two racing takers), released only by its holder."""

import threading
from datetime import datetime

from sqlalchemy import select

from kcache.index import Index
from kcache.index.models import PublishLeaseRow

KEY = "ab" * 16


def expiry(index: Index) -> datetime | None:
    return index.read(lambda s: s.scalar(select(PublishLeaseRow.expires_at).where(PublishLeaseRow.bundle_key == KEY)))


def test_a_free_lease_is_taken_and_renewed_by_its_holder_only(index):
    assert index.take_lease(KEY, "a", 60) is None
    first = expiry(index)
    until = index.take_lease(KEY, "b", 60)
    assert until is not None and abs((until - index.now()).total_seconds() - 60) < 30  # a's, about a minute away
    assert index.take_lease(KEY, "a", 600) is None  # renewed: a minute became ten
    assert expiry(index) > first
    assert index.take_lease("cd" * 16, "b", 60) is None  # another bundle key is another lease


def test_an_expired_lease_is_taken_over_and_its_old_holder_knows(index):
    assert index.take_lease(KEY, "dead", -1) is None  # expired a second ago: a holder that stopped renewing
    assert index.take_lease(KEY, "b", 60) is None
    assert index.take_lease(KEY, "dead", 60) is not None  # its renewal finds the lease gone to b


def test_only_the_holder_releases(index):
    index.take_lease(KEY, "a", 60)
    index.release_lease(KEY, "b")
    assert index.take_lease(KEY, "b", 60) is not None
    index.release_lease(KEY, "a")
    assert expiry(index) is None
    assert index.take_lease(KEY, "b", 60) is None


def test_of_racing_takers_of_an_expired_lease_one_wins(index):
    index.take_lease(KEY, "dead", -1)
    takers = 8
    start, results = threading.Barrier(takers), {}
    url = index.url

    def take(name):
        other = Index.open(url) if url.startswith("postgresql") else index
        try:
            start.wait(timeout=60)
            results[name] = other.take_lease(KEY, name, 60)
        finally:
            if other is not index:
                other.close()

    threads = [threading.Thread(target=take, args=(f"t{i}",)) for i in range(takers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    winners = [name for name, until in results.items() if until is None]
    assert len(results) == takers and len(winners) == 1
    assert index.take_lease(KEY, winners[0], 60) is None
