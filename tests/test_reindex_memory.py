"""`kcache reindex` holds a bounded number of trailer bytes at once, whatever --jobs.

Any store writer can plant packs whose footers claim trailers of up to 64 MiB; read on 16 threads
at once they (and the blobs parsed from them) took gigabytes. What is measured here is what the
store handed out: every read of a pack's end returns bytes that count themselves while alive.
"""

from __future__ import annotations

import hashlib
import threading

import pytest
from trees import write_tree

from kcache import reindex as reindexing
from kcache import sources
from kcache.index import Index
from kcache.packs import FOOTER, MAGIC
from kcache.publish import publish
from kcache.reindex import TrailerBudget, reindex
from kcache.store import pack_key

MiB = 1024 * 1024
TRAILER = MiB  # each planted trailer: four times the first read of a pack's end


class _Counted(bytes):
    """Bytes that tell their counter when they are freed (CPython frees them on their last reference)."""

    def __del__(self):
        self.counter.freed(len(self))


class _Counter:
    def __init__(self):
        self.live = self.peak = self.reads = 0
        self._lock = threading.RLock()  # __del__ may run in a thread that holds it

    def made(self, data: bytes) -> bytes:
        counted = _Counted(data)
        counted.counter = self
        with self._lock:
            self.live += len(counted)
            self.peak = max(self.peak, self.live)
            self.reads += 1
        return counted

    def freed(self, n: int) -> None:
        with self._lock:
            self.live -= n


class _Stream:
    def __init__(self, inner, counter: _Counter):
        self.inner, self.counter = inner, counter

    def read(self, n: int = -1) -> bytes:
        return self.counter.made(self.inner.read(n))

    def close(self) -> None:
        self.inner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class CountingStore:
    """The real store; reads of a pack's end (where its trailer lies) hand out counted bytes."""

    def __init__(self, inner):
        self.inner, self.counter = inner, _Counter()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_range(self, key: str, offset: int, length: int):
        stream = self.inner.open_range(key, offset, length)
        if key.startswith("packs/") and offset + length == self.inner.size(key):
            return _Stream(stream, self.counter)
        return stream


def _plant_trailer(store, n: int, salt: int) -> str:
    """A pack of junk whose footer names an `n`-byte trailer: any store writer can put one, named by its hash."""
    body = salt.to_bytes(8, "big") + b"\xff" * (n - 8)
    data = body + FOOTER.pack(len(body)) + MAGIC
    pack_id = hashlib.sha256(data).hexdigest()
    assert store.put_bytes(pack_key(pack_id), data)
    return pack_id


@pytest.fixture
def planted(tmp_path, store, sqlite_index, fp):
    """48 junk trailers of 1 MiB and one real bundle's packs."""
    write_tree(tmp_path / "src", {f"inductor/k{i}.py": f"kernel {i}".encode() * 100 for i in range(20)})
    real = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    junk = [_plant_trailer(store, TRAILER, i) for i in range(48)]
    return real, junk


def _reindexed(store, tmp_path, **options):
    """reindex of `store` into a fresh SQLite index."""
    rebuilt = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    try:
        return reindex(store, rebuilt, **options)
    finally:
        rebuilt.close()


def _check_result(result, real, junk, tmp_path):
    assert result.blobs == real.files and result.new_bundles == 1
    assert sum("trailer does not parse" in s for s in result.skipped) == len(junk), result.skipped


def test_the_trailers_reindex_holds_at_once_stay_within_its_budget(tmp_path, store, planted, monkeypatch):
    real, junk = planted
    budget = 3 * TRAILER  # room for two planted trailers and a first read
    monkeypatch.setattr(reindexing, "_TRAILER_BUDGET", budget, raising=False)
    counting = CountingStore(store)
    result = _reindexed(counting, tmp_path, jobs=16)
    _check_result(result, real, junk, tmp_path)
    assert counting.counter.reads >= 2 * len(junk)  # each junk pack: its end, then its whole trailer
    assert counting.counter.peak <= budget, f"{counting.counter.peak / MiB:.1f} MiB of trailers held at once"
    assert counting.counter.live == 0


def test_the_budget_is_taken_for_every_trailer_and_given_back(tmp_path, store, planted):
    real, junk = planted
    budget = TrailerBudget(3 * TRAILER)
    counting = CountingStore(store)
    result = _reindexed(counting, tmp_path, jobs=16, budget=budget)
    _check_result(result, real, junk, tmp_path)
    assert TRAILER < budget.peak <= budget.total  # a whole planted trailer was held, never more than the budget
    assert budget.held == 0
    assert counting.counter.peak <= budget.total


def test_a_trailer_larger_than_the_whole_budget_is_still_read(tmp_path, store, sqlite_index, fp):
    """A budget smaller than one trailer holds it alone, rather than waiting for ever."""
    write_tree(tmp_path / "src", {f"inductor/k{i}.py": f"kernel {i}".encode() * 100 for i in range(20)})
    real = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    junk = [_plant_trailer(store, TRAILER, i) for i in range(4)]
    budget = TrailerBudget(TRAILER // 2)
    result = _reindexed(store, tmp_path, jobs=4, budget=budget)
    _check_result(result, real, junk, tmp_path)
    assert budget.peak == budget.total and budget.held == 0


def test_a_take_is_clamped_to_the_budget_and_given_back():
    budget = TrailerBudget(10)
    assert budget.take(100) == 10 and budget.held == 10
    budget.give(10)
    assert budget.take(4) == 4 and budget.held == 4 and budget.peak == 10


def _plant_json_trailer(store, entries: list) -> str:
    """A pack whose trailer parses: the entries as given, over a body as long as they claim."""
    import json

    doc = json.dumps({"schema": 1, "blobs": entries}, separators=(",", ":")).encode()
    data = b"\0" * 64 + doc + FOOTER.pack(len(doc)) + MAGIC
    pack_id = hashlib.sha256(data).hexdigest()
    assert store.put_bytes(pack_key(pack_id), data)
    return pack_id


def test_a_trailer_denser_than_any_pack_writes_is_refused_before_it_is_parsed(tmp_path, store):
    """`["",0,0,0]` entries: 11 bytes of trailer each, parsed into ~20 times their bytes (a 64 MiB
    trailer took 1.4 GB). A real entry names a 64-digit blob id, so it takes 73 bytes at least."""
    from kcache import packs

    junk = _plant_json_trailer(store, [["", 0, 0, 0]] * 5000)
    with pytest.raises(packs.IntegrityError, match="more entries"):
        packs.parse_trailer(junk, store.get_bytes(pack_key(junk)), store.size(pack_key(junk)))
    result = _reindexed(store, tmp_path)
    assert [s for s in result.skipped if junk[:12] in s] and len(result.skipped) == 1, result.skipped


def test_a_trailer_of_many_bad_entries_is_one_line_of_the_report(tmp_path, store):
    """Every bad entry was a line of reindex's report, held until it ended: millions of them."""
    junk = _plant_json_trailer(store, [["z" * 64, 0, 1, 1]] * 500 + [["0" * 64, 0, 1, 1]] * 500)
    result = _reindexed(store, tmp_path)
    lines = [s for s in result.skipped if junk[:12] in s]
    assert 1 <= len(lines) <= 2 and any("500" in s for s in lines), result.skipped
