"""gc and yanks together: what a yank records must outlive any gc run that cannot see it.

A yanked bundle is named by its index row (status), its `yanks/<id>` marker and, when its key has
another active bundle, its key's ref (`yanked`). A key whose only bundle is yanked has no ref at
all, so gc's check that its index covers the store's refs cannot catch an index that lacks it.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from gc_helpers import packs_of, publish_tree

from kcache import fingerprint, gc, refs, signing
from kcache.cli import main
from kcache.index import Index
from kcache.restore import restore
from kcache.store import manifest_key, pack_key, ref_key
from kcache.yank import unyank, yank

POLICY = gc.Policy(keep_last=1, older_than=timedelta(days=7), grace=timedelta(hours=6))


def _backup(tmp_path, name: str) -> str:
    """A copy of the publishers' index as it is now (a backup, a replica that lags), as a URL."""
    with sqlite3.connect(tmp_path / "index.db") as source, sqlite3.connect(tmp_path / name) as copy:
        source.backup(copy)
    return f"sqlite:///{tmp_path / name}"


def _gc_twice(store, index) -> None:
    """One run past --older-than and --grace (orphans go, packs are condemned), one a grace later (swept)."""
    later = datetime.now(timezone.utc) + timedelta(days=8)
    gc.execute(store, index, gc.plan(store, index, POLICY, now=later))
    gc.execute(store, index, gc.plan(store, index, POLICY, now=later + timedelta(hours=7)))


@pytest.mark.parametrize(("only", "marker"), [(True, True), (False, True), (False, False)],
                         ids=["only-bundle", "older-active", "older-active-marker-deleted"])  # fmt: skip
def test_gc_through_a_lagging_index_keeps_a_yanked_bundle_it_has_no_row_for(tmp_path, store, sqlite_index, fp,
                                                                            only, marker):  # fmt: skip
    """The index gc runs with was backed up before the bundle was published (or lags behind the
    publishers'); the bundle was yanked since. gc took its manifest for an orphan and its packs for
    a crashed publish's, so `yank --undo` on the publishers' index brought back a bundle with nothing."""
    other = fingerprint.compute({**fp.facts, "model.id": "other"})
    publish_tree(tmp_path, store, sqlite_index, other, b"other kernel" * 100, "o1")  # a ref the backup covers
    if not only:
        publish_tree(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v1")
    lagging = Index.open(_backup(tmp_path, "lagging.db"))
    bad = publish_tree(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v2")
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    ref = refs.read(store, fp.bundle_key)
    assert ref is None if only else bad.bundle_id in ref.yanked
    if not marker:
        store.delete(refs.yank_key(bad.bundle_id))  # the ref's yank list still names it
    try:
        _gc_twice(store, lagging)
    finally:
        lagging.close()

    assert store.exists(manifest_key(bad.bundle_id))
    assert all(store.exists(pack_key(p)) for p in packs_of(store, bad.bundle_id))
    unyank(store, sqlite_index, bad.bundle_id)
    pod = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", bad.bundle_id), pod.reason


def test_the_plan_names_the_yanked_bundles_its_index_lacks(tmp_path, store, sqlite_index, fp):
    lagging = Index.open(_backup(tmp_path, "empty.db"))
    bad = publish_tree(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v1")
    yank(store, sqlite_index, bad.bundle_id)
    try:
        plan = gc.plan(store, lagging, POLICY, now=datetime.now(timezone.utc) + timedelta(days=8))
    finally:
        lagging.close()
    assert plan.yanked_without_rows == (bad.bundle_id,)
    assert plan.orphans == () and plan.adopt == ()


def test_a_yank_marker_whose_bundle_gc_deleted_holds_nothing_back(tmp_path, store, sqlite_index, fp):
    """The marker outlives the bundle (a re-publish of its bytes stays yanked); it keeps no packs."""
    publish_tree(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v1")
    bad = publish_tree(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v2")
    bad_packs = packs_of(store, bad.bundle_id)
    yank(store, sqlite_index, bad.bundle_id)
    _gc_twice(store, sqlite_index)
    later = gc.plan(store, sqlite_index, POLICY, now=datetime.now(timezone.utc) + timedelta(days=9))
    assert store.exists(refs.yank_key(bad.bundle_id)) and later.yanked_without_rows == ()
    assert not any(store.exists(pack_key(p)) for p in bad_packs)


class YankBeforeRefRead:
    """gc's store: the first time gc reads `refs/<key>` to move it, an operator yanks `bundle_id`
    (through the real store: yank's own ref rewrite lands before gc's compare-and-swap reads)."""

    def __init__(self, inner, index, bundle_key: str, bundle_id: str):
        self.inner, self.index, self.bundle_key, self.bundle_id, self.done = inner, index, bundle_key, bundle_id, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def get_versioned(self, key, limit=None):
        if key == ref_key(self.bundle_key) and not self.done:
            self.done = True
            yank(self.inner, self.index, self.bundle_id, "broke pods")
        return self.inner.get_versioned(key, limit)


def test_gc_never_points_a_ref_at_a_bundle_yanked_while_it_moves_the_ref(tmp_path, store, sqlite_index, fp):
    """keep-last 0: gc deletes the newest bundle and moves its ref to the one before, which it chose
    before an operator yanked that one. The ref ended up naming the yanked bundle, signed by gc."""
    private, public = signing.generate("prod", tmp_path / "keys")
    key = signing.load_signing_key(private)
    older = publish_tree(tmp_path, store, sqlite_index, fp, b"older kernel" * 100, "v1")
    newest = publish_tree(tmp_path, store, sqlite_index, fp, b"newest kernel" * 100, "v2")
    doomed = sqlite_index.get_bundle(newest.bundle_id)
    nothing = gc.plan(store, sqlite_index, POLICY)
    keep_none = gc.Policy(0, timedelta(0), timedelta(hours=6))
    racing = YankBeforeRefRead(store, sqlite_index, fp.bundle_key, older.bundle_id)
    gc.execute(racing, sqlite_index, replace(nothing, policy=keep_none, delete_bundles=(doomed,)), signer=key)

    assert racing.done and sqlite_index.get_bundle(older.bundle_id).status == "yanked"
    ref = refs.read(store, fp.bundle_key)
    assert ref is None or ref.manifest != older.bundle_id, "a ref names the yanked bundle"
    store.delete(refs.yank_key(older.bundle_id))  # a store writer deletes the marker: still nothing to restore
    pod = restore(store, refs.RefCatalog(store), fp, tmp_path / "dst", trusted=signing.load_trusted_keys([public]),
                  require_signature=True)  # fmt: skip
    assert pod.status == "miss", pod.bundle_id


def test_cli_gc_reports_the_yanked_bundles_its_index_lacks(tmp_path, isolated_home):
    runner = CliRunner()

    def publish_cli(model: str) -> str:
        (tmp_path / model / "inductor").mkdir(parents=True)
        (tmp_path / model / "inductor/k.so").write_bytes(model.encode() * 100)
        out = runner.invoke(main, ["publish", "--from", str(tmp_path / model), "--model", model, "--json"])
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout)["bundle_id"]

    publish_cli("other")
    with sqlite3.connect(isolated_home / "index.db") as source, sqlite3.connect(tmp_path / "backup.db") as copy:
        source.backup(copy)
    bad = publish_cli("m")
    assert runner.invoke(main, ["yank", bad]).exit_code == 0
    backup = ["--index", f"sqlite:///{tmp_path / 'backup.db'}", "--grace", "0s", "--allow-short-grace"]
    planned = runner.invoke(main, ["gc", "--dry-run", "--json", *backup])
    assert planned.exit_code == 0, planned.output
    summary = json.loads(planned.stdout)
    assert summary["yanked_without_rows"] == [bad] and summary["orphans"] == []
    text = runner.invoke(main, ["gc", *backup])
    assert text.exit_code == 0 and f"yanked bundle {bad[:12]} has no row in this index" in text.stdout
    assert runner.invoke(main, ["yank", bad, "--undo"]).exit_code == 0  # with the publishers' index


def test_a_yanked_bundle_whose_manifest_is_lost_holds_no_sweep(tmp_path, store, sqlite_index, fp):
    """gc tells an operator to yank a bundle whose manifest is missing; it went on holding every
    sweep until the yanked bundle passed --older-than, though no undo could bring it back."""
    old = publish_tree(tmp_path, store, sqlite_index, fp, b"old kernel" * 100, "v1")
    good = publish_tree(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v2")
    old_packs = packs_of(store, old.bundle_id) - packs_of(store, good.bundle_id)
    later = datetime.now(timezone.utc) + timedelta(days=8)
    gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, POLICY, now=later))  # old goes: packs condemned
    lost = publish_tree(tmp_path, store, sqlite_index, fp, b"lost kernel" * 100, "v3")
    store.delete(manifest_key(lost.bundle_id))
    young = gc.Policy(keep_last=1, older_than=timedelta(days=30), grace=timedelta(hours=6))
    held = gc.plan(store, sqlite_index, young, now=later + timedelta(hours=7))
    assert [b.id for b in held.broken] == [lost.bundle_id] and held.sweep == ()

    yank(store, sqlite_index, lost.bundle_id, "its manifest is gone")  # what gc's report says to do
    due = gc.plan(store, sqlite_index, young, now=later + timedelta(hours=7))  # the yanked one is retained
    assert due.broken == () and {p.id for p in due.sweep} == old_packs


@pytest.mark.parametrize("mode", ["index", "refs"])
def test_a_yanked_bundle_gc_deleted_stays_yanked_when_a_store_writer_puts_it_back(tmp_path, store, sqlite_index,
                                                                                  fp, mode):  # fmt: skip
    """A store writer keeps a copy of a yanked signed bundle; gc deletes it, the signer's next ref
    is written from the index; the writer puts the bundle back and deletes its marker. The index and
    the signed ref must still know the yank, for pods pinned to it that require signatures."""
    private, public = signing.generate("prod", tmp_path / "keys")
    key = signing.load_signing_key(private)
    trusted = signing.load_trusted_keys([public])
    publish_tree(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v1", signing_key=key)
    bad = publish_tree(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v2", signing_key=key)
    yank(store, sqlite_index, bad.bundle_id, "NaNs", signer=key)
    wanted = [manifest_key(bad.bundle_id), *(i.key for i in store.list(f"signatures/{bad.bundle_id}/")),
              *(pack_key(p) for p in packs_of(store, bad.bundle_id))]  # fmt: skip
    saved = {k: store.get_bytes(k) for k in wanted}
    later = datetime.now(timezone.utc) + timedelta(days=8)
    for at in (later, later + timedelta(hours=7)):
        gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, POLICY, now=at), signer=key)
    refs.refresh(store, sqlite_index, fp.bundle_key, signer=key)
    assert not store.exists(manifest_key(bad.bundle_id))  # gc deleted it

    for k, data in saved.items():  # the writer puts every object back
        if not store.exists(k):
            assert store.put_bytes(k, data)
    store.delete(refs.yank_key(bad.bundle_id))
    catalog = sqlite_index if mode == "index" else refs.RefCatalog(store)
    pod = restore(store, catalog, fp, tmp_path / "dst", bundle_id=bad.bundle_id, trusted=trusted,
                  require_signature=True)  # fmt: skip
    assert pod.status == "miss" and "yanked" in pod.reason, (pod.status, pod.reason)


def test_a_yanked_bundle_put_back_after_gc_is_an_orphan_to_gc_and_yanked_to_reindex(tmp_path, store, sqlite_index,
                                                                                     fp):  # fmt: skip
    """The index knows gc deleted it: gc does not take the copy for a bundle a lagging index lacks
    (kept with its packs, forever), and reindex into the same index files it yanked."""
    from kcache.reindex import reindex

    publish_tree(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v1")
    bad = publish_tree(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v2")
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    wanted = [manifest_key(bad.bundle_id), *(pack_key(p) for p in packs_of(store, bad.bundle_id))]
    saved = {k: store.get_bytes(k) for k in wanted}
    _gc_twice(store, sqlite_index)
    for k, data in saved.items():
        if not store.exists(k):
            assert store.put_bytes(k, data)
    store.delete(refs.yank_key(bad.bundle_id))

    later = gc.plan(store, sqlite_index, POLICY, now=datetime.now(timezone.utc) + timedelta(days=10))
    assert later.yanked_without_rows == ()
    assert manifest_key(bad.bundle_id) in {o.key for o in later.orphans}
    reindex(store, sqlite_index)
    assert sqlite_index.get_bundle(bad.bundle_id).status == "yanked"


def test_a_keys_yank_list_stays_within_what_pods_read_of_a_ref(tmp_path, store, sqlite_index, fp):
    """The ids of yanked bundles gc deleted join the yank list: thousands of them made a ref over the
    1 MiB pods read, so every pod of the key refused it. The rows' own yanks come first."""
    from kcache import limits
    from kcache.index.models import YankRow

    publish_tree(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v1")
    bad = publish_tree(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v2")
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    from kcache.index.models import BundleRow

    now = sqlite_index.now()
    gone = [{"id": f"{i:064x}", "bundle_key": fp.bundle_key, "deleted_at": now} for i in range(20_000)]
    old = [{"id": f"{i:063x}f", "bundle_key": fp.bundle_key, "toolchain_key": fp.toolchain_key,
            "workload_key": fp.workload_key, "model": None, "facts": "{}", "layers": "inductor", "files": 0,
            "bytes": 0, "created_at": now - timedelta(days=30), "created_by": "t", "status": "yanked"}
           for i in range(8_000)]  # fmt: skip
    sqlite_index.transaction(lambda s: (sqlite_index.insert_many(s, YankRow, gone),
                                        sqlite_index.insert_many(s, BundleRow, old)))  # fmt: skip
    refs.refresh(store, sqlite_index, fp.bundle_key)
    assert store.size(ref_key(fp.bundle_key)) <= limits.REF_BYTES
    ref = refs.read(store, fp.bundle_key)
    assert bad.bundle_id in ref.yanked and len(ref.yanked) > 10_000


def test_gc_keeps_what_a_yank_cut_off_before_its_row_falls_back_to(tmp_path, store, sqlite_index, fp):
    """A yank wrote its marker (pods stop taking the bundle) and was killed before the index row: the
    row still says active. gc took it for the key's newest and deleted the bundle before it under
    --keep-last 1, so the yank, run again, fell back to nothing."""
    good = publish_tree(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v1")
    bad = publish_tree(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v2")
    store.put_bytes(refs.yank_key(bad.bundle_id), b"NaNs")  # the yank's first step, and no more
    assert sqlite_index.get_bundle(bad.bundle_id).status == "active"
    plan = gc.plan(store, sqlite_index, POLICY, now=datetime.now(timezone.utc) + timedelta(days=8))
    assert good.bundle_id not in {b.id for b in plan.delete_bundles}
    _gc_twice(store, sqlite_index)

    yank(store, sqlite_index, bad.bundle_id, "NaNs")  # the operator runs it again
    pod = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", good.bundle_id), pod.reason


def test_a_yank_after_the_plan_keeps_its_fallback_past_a_half_yanked_newer_bundle(tmp_path, store, sqlite_index, fp):
    """The key's newest bundle is half yanked (marker, active row); gc plans to delete the oldest
    under --keep-last 1; the one between is yanked before gc deletes. The oldest is all that is left
    to fall back to: the delete's own check counted the half-yanked bundle as the one kept."""
    oldest = publish_tree(tmp_path, store, sqlite_index, fp, b"oldest kernel" * 100, "v1")
    middle = publish_tree(tmp_path, store, sqlite_index, fp, b"middle kernel" * 100, "v2")
    newest = publish_tree(tmp_path, store, sqlite_index, fp, b"newest kernel" * 100, "v3")
    store.put_bytes(refs.yank_key(newest.bundle_id), b"NaNs")  # a yank cut off after its marker
    plan = gc.plan(store, sqlite_index, POLICY, now=datetime.now(timezone.utc) + timedelta(days=8))
    assert [b.id for b in plan.delete_bundles] == [oldest.bundle_id]
    yank(store, sqlite_index, middle.bundle_id, "broke pods")
    gc.execute(store, sqlite_index, plan)

    yank(store, sqlite_index, newest.bundle_id, "NaNs")  # the cut-off one, run again
    pod = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", oldest.bundle_id), pod.reason


def test_cli_gc_reports_the_half_yanked_bundles_it_keeps(tmp_path, isolated_home):
    """A bundle active in the index yet yanked in the store is kept and its yank should be run again: the
    plan knows them, but --json left them out (only a log line said so), unlike every other kept bundle."""
    runner = CliRunner()
    (tmp_path / "src" / "inductor").mkdir(parents=True)
    (tmp_path / "src" / "inductor/k.so").write_bytes(b"kernel" * 100)
    out = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m", "--json"])
    assert out.exit_code == 0, out.output
    half = json.loads(out.stdout)["bundle_id"]
    (isolated_home / "store" / refs.yank_key(half)).parent.mkdir(parents=True, exist_ok=True)
    (isolated_home / "store" / refs.yank_key(half)).write_bytes(b"NaNs")  # a yank cut off after its marker
    planned = runner.invoke(main, ["gc", "--dry-run", "--json"])
    assert planned.exit_code == 0, planned.output
    assert json.loads(planned.stdout)["half_yanked"] == [half]
    text = runner.invoke(main, ["gc", "--dry-run"])
    assert text.exit_code == 0 and f"bundle {half[:12]} is active in the index but yanked in the store" in text.stdout
