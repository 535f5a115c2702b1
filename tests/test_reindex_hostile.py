"""`kcache reindex` from a store a writer without the signing key has tampered with: nothing it indexes
may make restore take a bundle it cannot lay out, nor make restore or `kcache ls` fail."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from click.testing import CliRunner
from trees import read_tree, write_tree

from kcache import fingerprint, sources
from kcache import manifest as manifests
from kcache.cli import main
from kcache.errors import KcacheError
from kcache.index import Index
from kcache.publish import publish
from kcache.reindex import reindex
from kcache.restore import restore
from kcache.store import manifest_key, pack_key, ref_key

LAYERS = sources.select()


def _publish(tmp_path, store, index, fp, files, name="src"):
    write_tree(tmp_path / name, files)
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={})


def _fresh(tmp_path, name="rebuilt.db") -> Index:
    return Index.open(f"sqlite:///{tmp_path / name}")


def _entries(store, bundle_id):
    return manifests.parse(store.get_bytes(manifest_key(bundle_id)), bundle_id).entries


def _plant_manifest(store, fp, *, entries=(), facts=None, bundle_key=None) -> str:
    """A manifest in canonical form (its id its hash) under `fp`'s keys, as any store writer can make one."""
    manifest = manifests.build(bundle_key or fp.bundle_key, fp.toolchain_key, fp.workload_key,
                               fp.facts if facts is None else facts, ["inductor"], entries)  # fmt: skip
    assert store.put_bytes(manifest_key(manifest.id), manifest.to_bytes())
    return manifest.id


@pytest.mark.parametrize("planted", [b"\xff not json {", b" " * (1024 * 1024 + 1)])
def test_a_damaged_ref_does_not_drop_its_keys_bundles(tmp_path, store, sqlite_index, fp, planted):
    """A writer who garbles refs/<key> must not make reindex leave out every bundle of that key
    (gc would then delete them as orphans): the bundles are dated by their objects instead."""
    published = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"})
    store.delete(ref_key(fp.bundle_key))
    store.put_bytes(ref_key(fp.bundle_key), planted)
    fresh = _fresh(tmp_path)
    rebuilt = reindex(store, fresh)
    assert rebuilt.bundles == 1 and fresh.newest_bundle(fp.bundle_key).id == published.bundle_id
    assert any(s.startswith(f"refs/{fp.bundle_key}") for s in rebuilt.skipped)
    fresh.close()


def test_a_pack_outside_its_place_is_not_indexed(tmp_path, store, sqlite_index, fp):
    """Restore reads packs/<hh>/<id>: blobs indexed in a pack elsewhere would make publish name a
    pack no restore finds, instead of uploading the file."""
    kernel = b"a kernel" * 100
    _publish(tmp_path, store, sqlite_index, fp, {"inductor/k": kernel})
    (info,) = store.list("packs/")
    pack_id = info.key.rsplit("/", 1)[-1]
    store.put_bytes(f"packs/00/{pack_id}", store.get_bytes(info.key))  # a hand copy to the wrong place
    store.delete(info.key)
    for info in list(store.list("manifests/")) + list(store.list("refs/")):
        store.delete(info.key)  # only the stray copy is left
    fresh = _fresh(tmp_path)
    rebuilt = reindex(store, fresh)
    assert rebuilt.blobs == 0 and any(s.startswith(f"packs/00/{pack_id}") for s in rebuilt.skipped)
    again = _publish(tmp_path, store, fresh, fp, {"inductor/k": kernel}, "again")
    assert again.new_blobs == 1  # uploaded, not named in the stray copy
    assert restore(store, fresh, fp, tmp_path / "dst").status == "hit"
    fresh.close()


def test_a_manifest_outside_its_place_is_not_indexed(tmp_path, store, sqlite_index, fp):
    published = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"})
    key = manifest_key(published.bundle_id)
    store.put_bytes(f"manifests/00/{published.bundle_id}", store.get_bytes(key))
    store.delete(key)
    fresh = _fresh(tmp_path)
    rebuilt = reindex(store, fresh)
    assert rebuilt.bundles == 0 and fresh.newest_bundle(fp.bundle_key) is None
    assert any(s.startswith(f"manifests/00/{published.bundle_id}") for s in rebuilt.skipped)
    fresh.close()


def test_a_manifest_naming_a_missing_pack_is_not_indexed(tmp_path, store, sqlite_index, fp):
    """A bundle whose packs are gone (a gc cut off, a writer's delete) made newest would fail every
    restore of its key; left out, restore takes the bundle before it."""
    old = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"old"}, "v1")
    new = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"new"}, "v2")
    (gone,) = {e.pack for e in _entries(store, new.bundle_id)} - {e.pack for e in _entries(store, old.bundle_id)}
    store.delete(pack_key(gone))
    fresh = _fresh(tmp_path)
    rebuilt = reindex(store, fresh)
    assert rebuilt.bundles == 1 and fresh.newest_bundle(fp.bundle_key).id == old.bundle_id
    (why,) = [s for s in rebuilt.skipped if new.bundle_id in s]
    assert gone[:12] in why and "missing" in why
    pod = restore(store, fresh, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", old.bundle_id)
    assert read_tree(tmp_path / "dst/inductor")["a"][0] == b"old"
    fresh.close()


def test_a_manifest_naming_ranges_past_a_packs_end_is_not_indexed(tmp_path, store, sqlite_index, fp):
    published = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"})
    (entry,) = _entries(store, published.bundle_id)
    planted = _plant_manifest(store, fp, entries=[manifests.Entry("inductor/b", 0o644, 1, entry.blob, entry.pack,
                                                                  10**9, entry.length)])  # fmt: skip
    fresh = _fresh(tmp_path)
    rebuilt = reindex(store, fresh)
    assert rebuilt.bundles == 1 and any(planted in s and "too short" in s for s in rebuilt.skipped)
    fresh.close()


@pytest.mark.parametrize("case", ["bundle key", "model id", "facts", "another model's facts"])
def test_a_manifest_whose_row_would_lie_or_break_the_index(tmp_path, index, store, fp, case):
    """Keys that are no keys, a model id or facts too big for a row (PostgreSQL refuses the first two,
    and restore and `ls` refuse to load the last), facts of another model under this key: skipped,
    and everything else is indexed."""
    good = _publish(tmp_path, store, index, fp, {"inductor/a": b"a"})
    entries = _entries(store, good.bundle_id)
    if case == "bundle key":
        planted = _plant_manifest(store, fp, entries=entries, bundle_key="k" * 100)
    elif case in ("model id", "facts"):  # under the keys of those facts: only the row's size is wrong
        facts = {**fp.facts, "model.id": "m" * 5000} if case == "model id" else {**fp.facts, "pad": "x" * 2**21}
        planted = _plant_manifest(store, fingerprint.compute(facts), entries=entries, facts=facts)
    else:
        planted = _plant_manifest(store, fp, entries=entries, facts={**fp.facts, "model.id": "victim-model"})
    rebuilt = reindex(store, index)  # into the index that has the good row: nothing else changes
    assert any(s.startswith(manifest_key(planted)) for s in rebuilt.skipped), rebuilt.skipped
    assert [b.id for b in index.list_bundles()] == [good.bundle_id]
    assert restore(store, index, fp, tmp_path / "dst").bundle_id == good.bundle_id


def test_cli_ls_and_restore_after_reindexing_a_hostile_store(tmp_path, isolated_home, monkeypatch):
    monkeypatch.setenv("KCACHE_MODEL", "m1")
    runner = CliRunner()
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    assert runner.invoke(main, ["publish", "--from", str(tmp_path / "src")]).exit_code == 0
    store_path = isolated_home / "store"
    from kcache.store.local import LocalStore

    store = LocalStore(store_path)
    fp = fingerprint.compute(json.loads(runner.invoke(main, ["fingerprint", "--json"]).stdout)["facts"])
    _plant_manifest(store, fp, facts={**fp.facts, "pad": "x" * (2 * 1024 * 1024)})
    store.delete(ref_key(fp.bundle_key))  # the planted manifest is now the newest object of the key
    index = f"sqlite:///{tmp_path / 'rebuilt.db'}"
    out = runner.invoke(main, ["reindex", "--index", index, "--json"])
    assert out.exit_code == 12 and json.loads(out.stdout)["bundles"] == 1
    listed = runner.invoke(main, ["ls", "--index", index, "--json"])
    assert listed.exit_code == 0, listed.output
    pod = runner.invoke(main, ["restore", "--into", str(tmp_path / "dst"), "--index", index, "--json"])
    assert json.loads(pod.stdout)["status"] == "hit", pod.output  # before: the padded row failed every restore


@pytest.mark.parametrize("forgery", ["expired-ref-put-back", "ref-deleted-manifest-reuploaded"])
def test_a_store_writer_cannot_make_an_older_signed_bundle_the_newest_by_reindex(tmp_path, store, sqlite_index, fp,
                                                                                 forgery):  # fmt: skip
    """A replayed ref only holds until it expires, and an object's time is whatever its last upload
    made it: with trusted keys, reindex dates neither by them. The bundle it took for the newest
    was what refresh then signed and what gc kept, deleting the real newest."""
    import os
    import time
    from datetime import timedelta

    from kcache import refs, signing
    from kcache.publish import PublishConfig

    private, public = signing.generate("prod", tmp_path / "keys")
    key = signing.load_signing_key(private)
    write_tree(tmp_path / "v1", {"inductor/a": b"old kernel"})
    hour_ago = time.time() - 3600
    os.utime(tmp_path / "v1/inductor/a", (hour_ago, hour_ago))
    old = publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "v1", env={}, config=PublishConfig(signing_key=key))
    refs.refresh(store, sqlite_index, fp.bundle_key, signer=key, ttl=timedelta(seconds=-1))  # signed, expired
    replayed = store.get_bytes(ref_key(fp.bundle_key))
    write_tree(tmp_path / "v2", {"inductor/a": b"new kernel"})
    new = publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "v2", env={}, config=PublishConfig(signing_key=key))

    store.delete(ref_key(fp.bundle_key))
    if forgery == "expired-ref-put-back":
        assert store.put_bytes(ref_key(fp.bundle_key), replayed)
    else:  # the same bytes again: only the object's time changes
        data = store.get_bytes(manifest_key(old.bundle_id))
        store.delete(manifest_key(old.bundle_id))
        assert store.put_bytes(manifest_key(old.bundle_id), data)
    rebuilt = _fresh(tmp_path)
    try:
        reindex(store, rebuilt, trusted=signing.load_trusted_keys([public]))
        assert rebuilt.newest_bundle(fp.bundle_key).id == new.bundle_id
    finally:
        rebuilt.close()


DAMAGE = {  # what a hand edit, a bad migration or a writer of the index leaves in one bundle row
    "facts": "UPDATE bundles SET facts = '{bad'",
    "created_at": "UPDATE bundles SET created_at = 'garbage'",
    "status": "UPDATE bundles SET status = x'41'",  # a blob, not text
    "oversized": f"UPDATE bundles SET created_by = '{'x' * 5000}'",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_reindex_rewrites_a_bundle_row_that_does_not_read_back_from_its_manifest(tmp_path, store, fp, damage):
    """Every read of the index refuses a row that does not read back (ls, gc, verify stop at it; restores of
    its key start cold) and names `kcache reindex` as the repair; but reindex inserts only missing rows: it
    said ok and left the row as it was. It now puts the manifest's row in its place."""
    import sqlite3

    index = Index.open(f"sqlite:///{tmp_path / 'index.db'}")
    published = _publish(tmp_path, store, index, fp, {"inductor/a": b"a"})
    created = index.get_bundle(published.bundle_id).created_at
    raw = sqlite3.connect(tmp_path / "index.db")  # a writer of the index, without kcache's checks
    raw.execute(DAMAGE[damage])
    raw.commit()
    raw.close()
    with pytest.raises(KcacheError, match="reindex|does not read back"):
        index.get_bundle(published.bundle_id)
    rebuilt = reindex(store, index)
    assert rebuilt.repaired == (published.bundle_id,) and not rebuilt.skipped
    (row,) = index.list_bundles()
    assert (row.id, row.status, row.created_by.startswith("reindex@")) == (published.bundle_id, "active", True)
    assert row.created_at <= created + timedelta(seconds=1)  # dated by its ref, as reindex dates any bundle
    assert restore(store, index, fp, tmp_path / "dst").status == "hit"
    assert reindex(store, index).repaired == ()  # a row that reads back is left as it is
    index.close()


def test_reindex_repairs_a_damaged_row_on_either_index(tmp_path, index, store, fp):
    from sqlalchemy import update

    from kcache.index.models import BundleRow

    published = _publish(tmp_path, store, index, fp, {"inductor/a": b"a"})
    index.transaction(lambda s: s.execute(update(BundleRow).values(facts="{bad")))
    assert reindex(store, index).repaired == (published.bundle_id,)
    assert index.get_bundle(published.bundle_id).facts == dict(fp.facts)
