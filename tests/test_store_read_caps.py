"""Objects from the store are read with a cap, wherever kcache reads them (operator verbs too).

A stray object under packs/ or manifests/, or a huge kcache-store.json, could be gigabytes: gc
read an orphan whole into memory (to put it back if a publish raced it), the store id was read
whole before its first 4 KiB were parsed, and reindex read a whole object whose footer claimed a
trailer spanning it. Each now reads at most what a real object of its kind can hold.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
from faulty import CountingStore

from kcache import binding, gc
from kcache.errors import KcacheError
from kcache.reindex import reindex
from kcache.store.local import LocalStore

BIG = 8 << 20


def put_old(store: LocalStore, key: str, data: bytes) -> None:
    path = store.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    old = time.time() - 30 * 86400
    os.utime(path, (old, old))


@pytest.mark.parametrize("key", ["packs/ab/stray-upload", "manifests/ab/" + "a" * 64, "signatures/x/y"])
def test_gc_deletes_a_huge_orphan_without_reading_it_whole(tmp_path, sqlite_index, monkeypatch, key):
    monkeypatch.setenv("KCACHE_MAX_MANIFEST_BYTES", str(1 << 20))
    store = LocalStore(tmp_path / "store")
    put_old(store, key, os.urandom(BIG))
    counting = CountingStore(store)
    plan = gc.plan(counting, sqlite_index, gc.Policy(3, timedelta(days=7), timedelta(hours=6)))
    assert [o.key for o in plan.orphans] == [key]
    gc.execute(counting, sqlite_index, plan)
    assert not (store.root / key).exists()
    assert sum(counting.read.values()) <= 1 << 20, counting.read


def test_a_huge_store_id_object_is_refused_after_a_capped_read(tmp_path):
    store = LocalStore(tmp_path / "store")
    put_old(store, binding.STORE_ID_KEY, b'{"store_id": "' + b"0" * BIG + b'"}')
    counting = CountingStore(store)
    with pytest.raises(KcacheError):
        binding.read_store_id(counting)
    assert sum(counting.read.values()) <= 4096, counting.read


def test_reindex_skips_a_stray_object_under_packs_without_reading_it_whole(tmp_path, sqlite_index):
    from kcache import packs

    store = LocalStore(tmp_path / "store")
    body = os.urandom(BIG)
    # A footer claiming a trailer that spans the whole object.
    put_old(store, "packs/ab/not-a-pack-id", body + packs.FOOTER.pack(BIG) + packs.MAGIC)
    counting = CountingStore(store)
    result = reindex(counting, sqlite_index, jobs=1)
    assert [s.split(":")[0] for s in result.skipped] == ["packs/ab/not-a-pack-id"]
    assert sum(counting.read.values()) <= 256 * 1024, counting.read
