"""The operator's commands (gc, verify, reindex, refresh, yank, prefetch, ls, explain, stats) against a
store that a writer without the signing key has tampered with: each ends in a clean kcache error or
a report, never a traceback, holds no more of a planted object than its cap, and deletes nothing a
bundle still names."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from gc_helpers import publish_tree

from kcache import binding, fingerprint, gc, refs
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.index import Index
from kcache.reindex import reindex
from kcache.store import ref_key
from kcache.verify import verify

POLICY = gc.Policy(keep_last=1, older_than=timedelta(days=7), grace=timedelta(hours=6))


def _plant_ref(store, bundle_key: str, signed: dict) -> None:
    store.delete(ref_key(bundle_key))
    store.put_bytes(ref_key(bundle_key), json.dumps({"signed": signed, "signatures": {}}).encode())


def test_reindex_dates_bundles_by_a_ref_from_the_first_day(tmp_path, store, sqlite_index, fp):
    """A ref dated at the earliest time a datetime holds names one bundle: the key's other bundles
    are dated just before it, which no datetime holds (reindex died with OverflowError, exit 70).
    Both are indexed, and gc can plan over the rows."""
    first = publish_tree(tmp_path, store, sqlite_index, fp, b"one", "one")
    second = publish_tree(tmp_path, store, sqlite_index, fp, b"two", "two")
    signed = json.loads(refs.read(store, fp.bundle_key).message())
    signed.update(manifest=first.bundle_id, created_at="0001-01-01T00:00:00+00:00")
    _plant_ref(store, fp.bundle_key, signed)
    fresh = Index.open(f"sqlite:///{tmp_path / 'fresh.db'}")
    try:
        assert reindex(store, fresh).bundles == 2
        assert {b.id for b in fresh.list_bundles(bundle_key=fp.bundle_key)} == {first.bundle_id, second.bundle_id}
        gc.plan(store, fresh, POLICY)
    finally:
        fresh.close()


class _Asked:
    """Counts the objects under manifests/ a command asks the store about, one at a time."""

    def __init__(self, inner):
        self.inner, self.url, self.manifests = inner, inner.url, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def size(self, key):
        self.manifests += key.startswith("manifests/")
        return self.inner.size(key)

    def exists(self, key):
        self.manifests += key.startswith("manifests/")
        return self.inner.exists(key)


def test_gc_asks_nothing_of_a_planted_yank_lists_bundles_the_store_lacks(tmp_path, store, sqlite_index, fp):
    """A ref's yank list is up to 1 MiB of ids (~15k): planted under many keys, one request per id
    had gc ask S3 about millions of manifests no one published. Only stored manifests are looked at."""
    publish_tree(tmp_path, store, sqlite_index, fp, b"kernel" * 100, "v1")
    planted = fingerprint.compute({**fp.facts, "model.id": "planted"}).bundle_key
    yanked = tuple(sorted(hashlib.sha256(b"%d" % n).hexdigest() for n in range(2000)))
    stored = refs.Ref(planted, "f" * 64, datetime.now(timezone.utc), yanked=yanked)
    store.put_bytes(ref_key(planted), stored.to_bytes())
    asked = _Asked(store)
    plan = gc.plan(asked, sqlite_index, POLICY)
    assert plan.yanked_without_rows == () and plan.orphans == ()
    assert asked.manifests < 10


def test_a_ref_compare_and_swap_does_not_read_a_planted_huge_object_whole(tmp_path, store):
    """file://'s compare-and-swap read the object at the key whole to learn its version: a store
    writer who puts a sparse file there while refresh, yank, gc or publish moves the ref (between
    their capped read and the swap) had the command read all of it into memory."""
    key = ref_key("0" * 32)
    store.put_bytes(key, b"{}")
    _data, version = store.get_versioned(key, limit=1024)
    with open(store.root / key, "r+b") as planted:
        planted.truncate(256 * 1024 * 1024)  # sparse: no disk, all of it in memory if read
    tracemalloc.start()
    try:
        assert store.put_if(key, b"new", version) is False
        assert store.put_if(key, b"new", None) is False
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024 * 1024
    assert os.path.getsize(store.root / key) == 256 * 1024 * 1024  # left for the caller to judge


@pytest.mark.parametrize("command", [["verify"], ["gc", "--dry-run"], ["refresh", "--signing-key", "KEY"],
                                     ["publish", "--from", "SRC", "--model", "m"]])  # fmt: skip
def test_a_deeply_nested_store_id_is_a_clean_error(tmp_path, isolated_home, command):
    """kcache-store.json is read before any command that writes or checks its index's binding: 4 KiB
    of `[` made json.loads raise RecursionError, a bug exit (70) for every one of them."""
    runner = CliRunner()
    (tmp_path / "src" / "inductor").mkdir(parents=True)
    (tmp_path / "src" / "inductor" / "k.so").write_bytes(b"kernel")
    assert runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m"]).exit_code == 0
    assert runner.invoke(main, ["keygen", "k", "--dir", str(tmp_path)]).exit_code == 0
    key = str(tmp_path / "k.key")
    store_id = isolated_home / "store" / binding.STORE_ID_KEY
    store_id.unlink()
    store_id.write_bytes(b"[" * 4000)
    args = [{"KEY": key, "SRC": str(tmp_path / "src")}.get(a, a) for a in command]
    out = runner.invoke(main, args)
    assert out.exit_code == ExitCode.CORRUPT, out.output
    assert binding.STORE_ID_KEY in out.output


def test_directories_nested_a_thousand_deep_do_not_break_listings(tmp_path, store, sqlite_index, fp, monkeypatch):
    """Whoever writes a file:// store (an NFS share) can nest directories under packs/: os.walk recursed
    once a level (Python 3.11), so every listing, and gc, verify and reindex with it, hit RecursionError."""
    published = publish_tree(tmp_path, store, sqlite_index, fp, b"kernel" * 100, "v1")
    deep = store.root / "packs" / "ab"
    deep.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(deep)  # each mkdir by a short relative name: the whole path is ~3 KiB, under PATH_MAX
    for _ in range(1500):
        os.mkdir("d")
        os.chdir("d")
    try:
        _listings_still_work(tmp_path, store, sqlite_index, fp, published.bundle_id)
    finally:  # from the bottom up: pytest's own rmtree of tmp_path recurses too
        for _ in range(1500):
            os.chdir("..")
            os.rmdir("d")


def _listings_still_work(tmp_path, store, sqlite_index, fp, bundle_id: str) -> None:
    assert gc.plan(store, sqlite_index, POLICY).delete_bundles == ()
    assert verify(store, sqlite_index).problems == ()
    fresh = Index.open(f"sqlite:///{tmp_path / 'fresh.db'}")
    try:
        assert reindex(store, fresh).new_bundles == 1
        assert fresh.newest_bundle(fp.bundle_key).id == bundle_id
    finally:
        fresh.close()
