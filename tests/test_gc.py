"""Two-phase GC: plans, condemns, sweeps after the grace period, and never loses a live blob."""

import json
import threading
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from trees import read_tree, write_tree

from kcache import fingerprint, gc, signing, sources
from kcache.cli import main
from kcache.index import lifecycle
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.store import manifest_key, pack_key
from kcache.yank import yank

LAYERS = sources.select()
POLICY = gc.Policy(keep_last=1, older_than=timedelta(days=7), grace=timedelta(hours=6))


def _publish(tmp_path, store, index, fp, content: bytes, name: str):
    write_tree(tmp_path / name, {"inductor/kernel.so": content, f"inductor/{name}.py": name.encode()})
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={})


def _packs_of(store, bundle_id):
    from kcache import manifest as manifests

    return {e.pack for e in manifests.parse(store.get_bytes(manifest_key(bundle_id)), bundle_id).entries}


def test_expired_bundles_go_and_their_packs_follow_after_grace(tmp_path, store, index, fp):
    old = _publish(tmp_path, store, index, fp, b"old kernel" * 100, "v1")
    new = _publish(tmp_path, store, index, fp, b"new kernel" * 100, "v2")
    old_packs = _packs_of(store, old.bundle_id) - _packs_of(store, new.bundle_id)
    later = datetime.now(timezone.utc) + timedelta(days=8)

    first = gc.plan(store, index, POLICY, now=later)
    assert [b.id for b in first.delete_bundles] == [old.bundle_id]
    assert first.sweep == () and first.bytes_freed == 0
    gc.execute(store, index, first)
    assert not store.exists(manifest_key(old.bundle_id))
    assert all(store.exists(pack_key(p)) for p in old_packs)  # condemned, not yet deleted

    second = gc.plan(store, index, POLICY, now=later + timedelta(hours=1))
    assert {p.id for p in second.waiting} == old_packs and second.sweep == ()  # still in grace
    third = gc.plan(store, index, POLICY, now=later + timedelta(hours=7))
    assert {p.id for p in third.sweep} == old_packs and third.bytes_freed > 0
    result = gc.execute(store, index, third)
    assert result.packs_deleted == len(old_packs)
    assert not any(store.exists(pack_key(p)) for p in old_packs)
    assert restore(store, index, fp, tmp_path / "dst").bundle_id == new.bundle_id


def test_publish_that_reuses_a_condemned_pack_saves_it(tmp_path, store, sqlite_index, fp):
    old = _publish(tmp_path, store, sqlite_index, fp, b"shared kernel" * 100, "v1")
    _publish(tmp_path, store, sqlite_index, fp, b"other kernel" * 100, "v2")
    condemned = _packs_of(store, old.bundle_id)
    later = datetime.now(timezone.utc) + timedelta(days=8)
    gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, POLICY, now=later))
    stale_sweep = gc.plan(store, sqlite_index, POLICY, now=later + timedelta(hours=7))
    assert {p.id for p in stale_sweep.sweep} >= condemned

    other_model = fingerprint.compute({**fp.facts, "model.id": "reuser"})
    reuse = _publish(tmp_path, store, sqlite_index, other_model, b"shared kernel" * 100, "v3")
    assert reuse.new_blobs == 1  # only its own .py file: the kernel came from the condemned pack
    gc.execute(store, sqlite_index, stale_sweep)  # a plan made before the publish revived the pack
    assert all(store.exists(pack_key(p)) for p in _packs_of(store, reuse.bundle_id))
    dst = tmp_path / "dst"
    restore(store, sqlite_index, other_model, dst)
    assert read_tree(dst / "inductor")["kernel.so"][0] == b"shared kernel" * 100


class PausingIndex:
    """An index that stops a publish right after it has located its blobs."""

    def __init__(self, inner):
        self.inner, self.located, self.go_on = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def locate(self, blob_ids):
        where = self.inner.locate(blob_ids)
        if not self.located.is_set():
            self.located.set()
            assert self.go_on.wait(60)
        return where


def _shared_kernel_condemned(tmp_path, store, index, fp):
    """v1's kernel left only in a pack gc condemned (v2 replaced v1, gc ran 8 days on); (that gc's time, a
    fingerprint of another model whose publish will find the kernel there)."""
    _publish(tmp_path, store, index, fp, b"shared kernel" * 100, "v1")
    _publish(tmp_path, store, index, fp, b"other kernel" * 100, "v2")
    later = datetime.now(timezone.utc) + timedelta(days=8)
    gc.execute(store, index, gc.plan(store, index, POLICY, now=later))
    return later, fingerprint.compute({**fp.facts, "model.id": "racer"})


def test_gc_sweeping_under_a_running_publish_never_breaks_its_bundle(tmp_path, store, sqlite_index, fp):
    later, other_model = _shared_kernel_condemned(tmp_path, store, sqlite_index, fp)
    write_tree(tmp_path / "v3", {"inductor/kernel.so": b"shared kernel" * 100})
    pausing = PausingIndex(sqlite_index)
    box = {}
    publisher = threading.Thread(target=lambda: box.update(r=publish(store, pausing, other_model, LAYERS,
                                                                     root=tmp_path / "v3", env={})))  # fmt: skip
    publisher.start()
    assert pausing.located.wait(60)
    # The publisher found the kernel in a condemned pack; GC now sweeps that pack away.
    swept = gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, POLICY, now=later + timedelta(hours=7)))
    assert swept.packs_deleted >= 1
    pausing.go_on.set()
    publisher.join(60)
    result = box["r"]
    assert result.new_blobs == 1  # re-uploaded after finding its pack gone
    assert all(store.exists(pack_key(p)) for p in _packs_of(store, result.bundle_id))
    restore(store, sqlite_index, other_model, tmp_path / "dst")
    assert read_tree(tmp_path / "dst/inductor") == {"kernel.so": (b"shared kernel" * 100, 0o644)}


class PausingBeforeLocate(PausingIndex):
    """An index that stops a publish after it looked for missing blobs and uploaded the rest, before it
    locates them: a long upload, during which a GC may sweep the pack holding the blobs it found."""

    def locate(self, blob_ids):
        if not self.located.is_set():
            self.located.set()
            assert self.go_on.wait(60)
        return self.inner.locate(blob_ids)


def test_gc_sweeping_while_a_publish_uploads_never_fails_it(tmp_path, store, index, fp):
    later, other_model = _shared_kernel_condemned(tmp_path, store, index, fp)
    write_tree(tmp_path / "v3", {"inductor/kernel.so": b"shared kernel" * 100, "inductor/new.py": b"new"})
    pausing = PausingBeforeLocate(index)
    box = {}

    def run():
        try:
            box["r"] = publish(store, pausing, other_model, LAYERS, root=tmp_path / "v3", env={})
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            box["e"] = exc

    publisher = threading.Thread(target=run)
    publisher.start()
    assert pausing.located.wait(60)
    # The publisher found the kernel in a condemned pack and uploaded its new file; GC now sweeps that pack.
    swept = gc.execute(store, index, gc.plan(store, index, POLICY, now=later + timedelta(hours=7)))
    assert swept.packs_deleted >= 1
    pausing.go_on.set()
    publisher.join(60)
    assert "e" not in box, box.get("e")
    result = box["r"]
    assert all(store.exists(pack_key(p)) for p in _packs_of(store, result.bundle_id))
    restore(store, index, other_model, tmp_path / "dst")
    assert read_tree(tmp_path / "dst/inductor")["kernel.so"][0] == b"shared kernel" * 100


def test_orphan_packs_are_condemned_after_grace_and_deleted_a_grace_later(tmp_path, store, sqlite_index, fp):
    store.put_bytes(pack_key("e" * 64), b"a pack whose publisher crashed before its row")
    store.put_bytes(manifest_key("d" * 64), b"a manifest whose publisher crashed before its row")
    soon = gc.plan(store, sqlite_index, POLICY)
    assert soon.orphans == () and soon.adopt == ()
    now = datetime.now(timezone.utc)
    later = gc.plan(store, sqlite_index, POLICY, now=now + timedelta(hours=7))
    assert [o.key for o in later.adopt] == [pack_key("e" * 64)]
    assert [o.key for o in later.orphans] == [manifest_key("d" * 64)]
    gc.execute(store, sqlite_index, later)
    assert store.exists(pack_key("e" * 64)) and not store.exists(manifest_key("d" * 64))
    assert gc.plan(store, sqlite_index, POLICY, now=now + timedelta(hours=8)).sweep == ()  # in its grace
    final = gc.plan(store, sqlite_index, POLICY, now=now + timedelta(hours=14))
    assert [p.id for p in final.sweep] == ["e" * 64]
    gc.execute(store, sqlite_index, final)
    assert not store.exists(pack_key("e" * 64))


class CrashingIndex:
    """An index that fails right after the first pack reached the store: a publish that crashed."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def add_pack(self, *args):
        raise RuntimeError("publisher killed after its upload")


def test_republish_over_an_orphan_pack_survives_the_orphan_sweep(tmp_path, store, sqlite_index, fp):
    tree = {"inductor/kernel.so": b"kernel" * 100, "inductor/graph.py": b"graph"}
    write_tree(tmp_path / "src", tree)
    with pytest.raises(RuntimeError):
        publish(store, CrashingIndex(sqlite_index), fp, LAYERS, root=tmp_path / "src", env={})
    (orphan,) = list(store.list("packs/"))
    later = datetime.now(timezone.utc) + timedelta(hours=7)
    stale = gc.plan(store, sqlite_index, POLICY, now=later)  # made while the pack had no row
    # The re-publish builds the byte-identical pack; the store says "already there".
    result = publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "src", env={})
    gc.execute(store, sqlite_index, stale)
    for hours in (14, 21):  # later runs: the orphan goes, the bundle's packs stay
        gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, POLICY, now=later + timedelta(hours=hours)))
    assert all(store.exists(pack_key(p)) for p in _packs_of(store, result.bundle_id))
    restore(store, sqlite_index, fp, tmp_path / "dst")
    assert read_tree(tmp_path / "dst/inductor")["kernel.so"][0] == b"kernel" * 100


class PublishDuringDelete:
    """A store that runs a publish just before GC deletes a pack object (its row is already gone)."""

    def __init__(self, inner, publish_now):
        self.inner, self.publish_now, self.result = inner, publish_now, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete(self, key):
        if key.startswith("packs/") and self.result is None:
            self.result = self.publish_now()
        self.inner.delete(key)


def test_a_pack_gc_is_deleting_is_never_adopted_by_a_publish(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/kernel.so": b"kernel" * 100})
    with pytest.raises(RuntimeError):
        publish(store, CrashingIndex(sqlite_index), fp, LAYERS, root=tmp_path / "src", env={})
    later = datetime.now(timezone.utc) + timedelta(hours=7)
    gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, POLICY, now=later))  # adopted, condemned
    sweep = gc.plan(store, sqlite_index, POLICY, now=later + timedelta(hours=7))
    assert len(sweep.sweep) == 1
    racing = PublishDuringDelete(store, lambda: publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "src", env={}))
    assert gc.execute(racing, sqlite_index, sweep).packs_deleted == 1
    # The publish ran between the row delete and the object delete: it found the identical pack
    # "already there" and must not have named it.
    assert all(store.exists(pack_key(p)) for p in _packs_of(store, racing.result.bundle_id))
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"


def test_publish_uploads_again_the_blobs_of_a_pack_the_store_lost(tmp_path, store, sqlite_index, fp):
    first = _publish(tmp_path, store, sqlite_index, fp, b"kernel" * 100, "v1")
    for pack in _packs_of(store, first.bundle_id):
        store.delete(pack_key(pack))  # lost: `kcache verify` would flag it
    other_model = fingerprint.compute({**fp.facts, "model.id": "second"})
    second = _publish(tmp_path, store, sqlite_index, other_model, b"kernel" * 100, "v1")
    assert second.new_blobs == 2
    assert all(store.exists(pack_key(p)) for p in _packs_of(store, second.bundle_id))
    restore(store, sqlite_index, other_model, tmp_path / "dst")
    assert read_tree(tmp_path / "dst/inductor")["kernel.so"][0] == b"kernel" * 100


def test_manifest_committed_while_gc_deletes_it_as_an_orphan_is_put_back(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/kernel.so": b"kernel" * 100})

    class CrashBeforeCommit(CrashingIndex):
        def add_pack(self, *args):
            return self.inner.add_pack(*args)

        def add_bundle(self, row):
            raise RuntimeError("publisher killed before its commit point")

    with pytest.raises(RuntimeError):  # leaves the manifest as an orphan (its packs have rows)
        publish(store, CrashBeforeCommit(sqlite_index), fp, LAYERS, root=tmp_path / "src", env={})
    plan = gc.plan(store, sqlite_index, POLICY, now=datetime.now(timezone.utc) + timedelta(hours=7))
    assert [o.key.split("/")[0] for o in plan.orphans] == ["manifests"]

    class PublishBeforeManifestDelete(PublishDuringDelete):
        def delete(self, key):
            if key.startswith("manifests/") and self.result is None:
                self.result = self.publish_now()  # commits on the orphan copy, which still exists
            self.inner.delete(key)

    racing = PublishBeforeManifestDelete(
        store, lambda: publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "src", env={})
    )
    gc.execute(racing, sqlite_index, plan)
    assert store.exists(manifest_key(racing.result.bundle_id))
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"


def test_manifest_swept_as_an_orphan_before_the_commit_point_is_written_again(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/kernel.so": b"kernel" * 100})

    class SweepBeforeCommit:  # GC deletes the orphan copy of our manifest just before our bundle row
        def __init__(self, inner, crash=False):
            self.inner, self.crash = inner, crash

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def add_bundle(self, row):
            if self.crash:
                raise RuntimeError("publisher killed before its commit point")
            store.delete(manifest_key(row.id))
            return self.inner.add_bundle(row)

    with pytest.raises(RuntimeError):  # leaves the manifest as an orphan
        publish(store, SweepBeforeCommit(sqlite_index, crash=True), fp, LAYERS, root=tmp_path / "src", env={})
    result = publish(store, SweepBeforeCommit(sqlite_index), fp, LAYERS, root=tmp_path / "src", env={})
    assert store.exists(manifest_key(result.bundle_id))
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"


def test_cli_dry_run_changes_nothing(tmp_path):
    runner = CliRunner()
    for name, content in (("v1", b"one"), ("v2", b"two")):
        write_tree(tmp_path / name, {"inductor/k": content})
        runner.invoke(main, ["publish", "--from", str(tmp_path / name), "--model", "m"], catch_exceptions=False)
    args = ["gc", "--keep-last", "1", "--older-than", "0s", "--grace", "0s", "--allow-short-grace"]
    dry = runner.invoke(main, args + ["--dry-run", "--json"], catch_exceptions=False)
    planned = json.loads(dry.output)
    assert len(planned["bundles_to_delete"]) == 1 and planned["result"] is None
    listed = json.loads(runner.invoke(main, ["ls", "--json"]).output)
    assert len(listed) == 2
    done = runner.invoke(main, args, catch_exceptions=False)
    assert done.exit_code == 0 and "deleted 1 bundles" in done.output
    assert len(json.loads(runner.invoke(main, ["ls", "--json"]).output)) == 1
    bad = runner.invoke(main, ["gc", "--older-than", "soon"])
    assert bad.exit_code == 2 and "duration" in bad.stderr


def test_lifecycle_revive_reports_gone_packs(sqlite_index):
    from kcache.records import BlobLocation

    sqlite_index.add_pack("a" * 64, 1, [BlobLocation("1" * 64, "a" * 64, 0, 1, 1)])
    now = datetime.now(timezone.utc)
    lifecycle.condemn(sqlite_index, ["a" * 64], now - timedelta(hours=1))
    assert lifecycle.revive(sqlite_index, ["a" * 64, "b" * 64]) == {"b" * 64}
    assert lifecycle.delete_condemned(sqlite_index, ["a" * 64], now) == set()  # revived: survives


class PublishBeforeDelete:
    """GC's store: just before GC deletes the first object under `prefix`, a publish runs."""

    def __init__(self, inner, prefix, publish_now):
        self.inner, self.prefix, self.publish_now, self.result = inner, prefix, publish_now, None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def delete(self, key):
        if key.startswith(self.prefix) and self.result is None:
            self.result = self.publish_now()
        self.inner.delete(key)


@pytest.mark.parametrize("prefix", ["signatures/", "manifests/"])
def test_bundle_republished_while_gc_deletes_it_keeps_its_manifest_and_signature(tmp_path, store, index, fp,
                                                                                 prefix):  # fmt: skip
    private, public = signing.generate("prod", tmp_path / "keys")
    config = PublishConfig(signing_key=signing.load_signing_key(private))
    for name, content in (("v1", b"old kernel"), ("v2", b"new kernel")):
        write_tree(tmp_path / name, {"inductor/kernel.so": content * 100})
    old = publish(store, index, fp, LAYERS, root=tmp_path / "v1", env={}, config=config)
    publish(store, index, fp, LAYERS, root=tmp_path / "v2", env={}, config=config)
    policy = gc.Policy(keep_last=1, older_than=timedelta(0), grace=timedelta(hours=6))
    plan = gc.plan(store, index, policy, now=datetime.now(timezone.utc) + timedelta(seconds=1))
    assert [b.id for b in plan.delete_bundles] == [old.bundle_id]

    # The bundle row is gone already; the publish commits the identical manifest again on the
    # objects GC is about to delete.
    racing = PublishBeforeDelete(
        store, prefix, lambda: publish(store, index, fp, LAYERS, root=tmp_path / "v1", env={}, config=config)
    )
    result = gc.execute(racing, index, plan)
    assert racing.result.created and racing.result.bundle_id == old.bundle_id
    assert (result.bundles_deleted, result.bundles_kept) == (0, 1)
    assert index.newest_bundle(fp.bundle_key).id == old.bundle_id
    assert store.exists(manifest_key(old.bundle_id))
    assert store.exists(signing.signature_key(old.bundle_id, "prod"))
    trusted = signing.load_trusted_keys([public])
    pod = restore(store, index, fp, tmp_path / "dst", trusted=trusted, require_signature=True)
    assert (pod.status, pod.bundle_id) == ("hit", old.bundle_id), pod.reason
    gc.plan(store, index, policy, now=datetime.now(timezone.utc) + timedelta(seconds=1))  # gc runs again


def test_plan_reports_a_bundle_whose_manifest_is_missing_and_sweeps_nothing(tmp_path, store, index, fp):
    old = _publish(tmp_path, store, index, fp, b"old kernel" * 100, "v1")
    new = _publish(tmp_path, store, index, fp, b"new kernel" * 100, "v2")
    old_packs = _packs_of(store, old.bundle_id) - _packs_of(store, new.bundle_id)
    later = datetime.now(timezone.utc) + timedelta(days=8)
    gc.execute(store, index, gc.plan(store, index, POLICY, now=later))  # old goes, its packs are condemned
    store.delete(manifest_key(new.bundle_id))  # lost, or deleted by a GC that raced a publish

    held = gc.plan(store, index, POLICY, now=later + timedelta(hours=7))
    assert [b.id for b in held.broken] == [new.bundle_id]
    # Which packs the lost manifest names is unknown: none is swept while it is missing.
    assert held.sweep == () and {p.id for p in held.waiting} == old_packs
    assert gc.execute(store, index, held).packs_deleted == 0
    assert all(store.exists(pack_key(p)) for p in old_packs)


def test_gc_planned_before_a_yank_keeps_the_bundle_the_yank_falls_back_to(tmp_path, store, index, fp):
    old = _publish(tmp_path, store, index, fp, b"old kernel" * 100, "v1")
    new = _publish(tmp_path, store, index, fp, b"new kernel" * 100, "v2")
    old_packs = _packs_of(store, old.bundle_id) - _packs_of(store, new.bundle_id)
    later = datetime.now(timezone.utc) + timedelta(days=8)
    lifecycle.condemn(index, old_packs, later - timedelta(hours=7))  # as if shared with a bundle GC deleted
    plan = gc.plan(store, index, POLICY, now=later)
    assert [b.id for b in plan.delete_bundles] == [old.bundle_id]
    assert {p.id for p in plan.sweep} == old_packs

    yank(store, index, new.bundle_id, "broke pods")  # the operator rolls back to the older bundle
    result = gc.execute(store, index, plan)
    assert (result.bundles_deleted, result.bundles_kept, result.packs_deleted) == (0, 1, 0)
    assert index.newest_bundle(fp.bundle_key).id == old.bundle_id
    assert store.exists(manifest_key(old.bundle_id))
    pod = restore(store, index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", old.bundle_id), pod.reason
    assert all(store.exists(pack_key(p)) for p in old_packs)
    assert [b.id for b in gc.plan(store, index, POLICY, now=later).delete_bundles] == [new.bundle_id]  # yanked


def test_a_ref_gc_removes_while_a_publish_commits_is_written_again(tmp_path, store, sqlite_index, fp, monkeypatch):
    """GC deletes the key's last bundle and removes its ref; a publish of the key commits and
    writes its ref in between: the ref must name the new bundle afterwards, not be gone."""
    from kcache import refs
    from kcache.store import ref_key

    old = _publish(tmp_path, store, sqlite_index, fp, b"old kernel", "v1")
    plan = gc.plan(store, sqlite_index, gc.Policy(0, timedelta(0), timedelta(hours=6)),
                   now=datetime.now(timezone.utc) + timedelta(seconds=1))  # fmt: skip
    assert [b.id for b in plan.delete_bundles] == [old.bundle_id]
    real_delete, published = store.delete, {}

    def delete(key):
        if key == ref_key(fp.bundle_key) and not published:
            published["v2"] = _publish(tmp_path, store, sqlite_index, fp, b"new kernel", "v2")
        return real_delete(key)

    monkeypatch.setattr(store, "delete", delete)
    gc.execute(store, sqlite_index, plan)
    monkeypatch.setattr(store, "delete", real_delete)
    ref = refs.read(store, fp.bundle_key)
    assert ref is not None and ref.manifest == published["v2"].bundle_id


def test_a_yanked_bundle_gc_deleted_stays_yanked_when_its_bytes_are_published_again(tmp_path, store, index, fp):
    """A pod that restored the bundle before its yank publishes its ROOT again (same files, same
    times: the same manifest id): the yank that outlived the bundle's row must keep it yanked."""
    from kcache import refs

    old = _publish(tmp_path, store, index, fp, b"old kernel" * 100, "v1")
    bad = _publish(tmp_path, store, index, fp, b"bad kernel" * 100, "v2")
    yank(store, index, bad.bundle_id, "NaNs")
    later = datetime.now(timezone.utc) + timedelta(days=8)
    plan = gc.plan(store, index, POLICY, now=later)
    assert bad.bundle_id in [b.id for b in plan.delete_bundles]
    gc.execute(store, index, plan)
    assert store.exists(refs.yank_key(bad.bundle_id))  # the yank outlives the bundle

    again = publish(store, index, fp, LAYERS, root=tmp_path / "v2", env={})
    assert (again.bundle_id, again.created, again.yanked) == (bad.bundle_id, True, True)
    assert index.get_bundle(bad.bundle_id).status == "yanked"
    assert index.newest_bundle(fp.bundle_key).id == old.bundle_id
    ref = refs.read(store, fp.bundle_key)
    assert ref.manifest == old.bundle_id and bad.bundle_id in ref.yanked
    pod = restore(store, index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", old.bundle_id), pod.reason


def test_a_yanked_bundle_gc_deleted_stays_yanked_when_published_again_without_marker_or_ref(tmp_path, store,
                                                                                             index, fp):  # fmt: skip
    """As above, after a store writer deleted the marker and the ref: the index still has the yank;
    `yank --undo` then makes the bundle active again, and its key's ref no longer lists it."""
    from kcache import refs
    from kcache.store import ref_key
    from kcache.yank import unyank

    old = _publish(tmp_path, store, index, fp, b"old kernel" * 100, "v1")
    bad = _publish(tmp_path, store, index, fp, b"bad kernel" * 100, "v2")
    yank(store, index, bad.bundle_id, "NaNs")
    gc.execute(store, index, gc.plan(store, index, POLICY, now=datetime.now(timezone.utc) + timedelta(days=8)))
    store.delete(refs.yank_key(bad.bundle_id))
    store.delete(ref_key(fp.bundle_key))

    again = publish(store, index, fp, LAYERS, root=tmp_path / "v2", env={})
    assert (again.bundle_id, again.yanked) == (bad.bundle_id, True)
    assert index.newest_bundle(fp.bundle_key).id == old.bundle_id
    unyank(store, index, bad.bundle_id)
    assert bad.bundle_id not in refs.read(store, fp.bundle_key).yanked
    pod = restore(store, refs.RefCatalog(store), fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", bad.bundle_id), pod.reason


def test_gc_removes_temp_files_of_killed_writes_once_past_grace(tmp_path, store, index, fp):
    import os

    kept = _publish(tmp_path, store, index, fp, b"kernel" * 100, "v1")
    pack = next(iter(_packs_of(store, kept.bundle_id)))
    shard = store.root / pack_key(pack).rsplit("/", 1)[0]
    killed = shard / f".tmp-{'e' * 64}-x1y2"  # what kcache.atomic leaves when killed before its rename
    killed.write_bytes(b"half a pack" * 1000)
    fresh = shard / f".tmp-{'f' * 64}-a3b4"  # a publish writing right now
    fresh.write_bytes(b"in flight")
    hours_ago = datetime.now(timezone.utc).timestamp() - 7 * 3600
    os.utime(killed, (hours_ago, hours_ago))

    plan = gc.plan(store, index, POLICY)
    assert [left.key for left in plan.leftovers] == [killed.relative_to(store.root).as_posix()]
    assert plan.bytes_freed == len(b"half a pack" * 1000)
    result = gc.execute(store, index, plan)
    assert result.leftovers_removed == 1 and not killed.exists() and fresh.exists()
    assert restore(store, index, fp, tmp_path / "dst").bundle_id == kept.bundle_id


def test_gc_aborts_multipart_uploads_a_killed_publish_left(tmp_path, s3_store, sqlite_index, fp):
    full = s3_store._key(pack_key("d" * 64))
    killed = s3_store.client.create_multipart_upload(Bucket=s3_store.bucket, Key=full)["UploadId"]
    s3_store.client.upload_part(Bucket=s3_store.bucket, Key=full, UploadId=killed, PartNumber=1, Body=b"x" * 1024)
    uploads = lambda: [u["UploadId"] for u in s3_store.client.list_multipart_uploads(  # noqa: E731
        Bucket=s3_store.bucket, Prefix=s3_store.prefix).get("Uploads", [])]
    assert killed in uploads()

    early = gc.plan(s3_store, sqlite_index, POLICY)
    assert killed not in [left.upload_id for left in early.leftovers]  # begun within --grace: may be in flight
    later = gc.plan(s3_store, sqlite_index, POLICY, now=datetime.now(timezone.utc) + timedelta(hours=7))
    assert [left.upload_id for left in later.leftovers if left.key == pack_key("d" * 64)] == [killed]
    gc.execute(s3_store, sqlite_index, later)
    assert killed not in uploads()


def test_gc_leaves_uploads_that_are_no_pack_of_its_store_alone(s3_bucket, sqlite_index):
    """A store at a bucket's root shares the bucket's upload list with every other application."""
    from kcache.store import open_store

    url, endpoint = s3_bucket
    root = open_store(url.rsplit("/", 1)[0], endpoint_url=endpoint)  # s3://bucket, no prefix
    theirs = root.client.create_multipart_upload(Bucket=root.bucket, Key="other-app/backup.tar")["UploadId"]
    root.client.upload_part(Bucket=root.bucket, Key="other-app/backup.tar", UploadId=theirs, PartNumber=1, Body=b"x")
    later = gc.plan(root, sqlite_index, POLICY, now=datetime.now(timezone.utc) + timedelta(hours=7))
    assert theirs not in [left.upload_id for left in later.leftovers]
    gc.execute(root, sqlite_index, later)
    listed = root.client.list_multipart_uploads(Bucket=root.bucket).get("Uploads", [])
    assert theirs in [u["UploadId"] for u in listed]


def test_an_orphan_the_store_will_not_delete_does_not_stop_the_others(tmp_path, store, index):
    from kcache.errors import StoreError

    class Refusing:
        def __init__(self, inner):
            self.inner = inner

        def delete(self, key):
            if key.endswith("a" * 64):
                raise StoreError(self.inner.url, f"cannot delete {key}: Permission denied")
            self.inner.delete(key)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    for c in "ab":
        store.put_bytes(manifest_key(c * 64), b"an orphan")
    later = datetime.now(timezone.utc) + timedelta(days=1)
    plan = gc.plan(store, index, POLICY, now=later)
    assert {o.key for o in plan.orphans} == {manifest_key("a" * 64), manifest_key("b" * 64)}
    gc.execute(Refusing(store), index, plan)
    assert store.exists(manifest_key("a" * 64)) and not store.exists(manifest_key("b" * 64))


def test_gc_refuses_an_index_that_lacks_bundles_the_stores_refs_name(tmp_path, store, sqlite_index, fp):
    """A CronJob without the publishers' index (another KCACHE_HOME, a backup missing recent rows)
    saw every published manifest as an orphan and every pack as unreferenced: it deleted them."""
    from kcache.errors import ConfigError
    from kcache.index import Index

    published = _publish(tmp_path, store, sqlite_index, fp, b"kernel" * 100, "v1")
    other = Index.open(f"sqlite:///{tmp_path / 'another.db'}")
    with pytest.raises(ConfigError, match="reindex"):
        gc.plan(store, other, POLICY, now=datetime.now(timezone.utc) + timedelta(days=30))
    other.close()
    assert store.exists(manifest_key(published.bundle_id))
    pod = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", published.bundle_id)
    assert gc.plan(store, sqlite_index, POLICY).orphans == ()  # the publishers' own index plans as before


def test_a_retained_bundle_whose_manifest_names_unsafe_paths_is_reported_broken(tmp_path, store, index, fp):
    """An index row (an index writer's) naming a manifest that hashes right but lists one path twice:
    gc must hold its sweeps and say so, not crash on every run."""
    import hashlib

    from kcache import canonical
    from kcache.records import Bundle

    rows = [["inductor/a", 0o644, 1, "b" * 64, "c" * 64, 0, 1]] * 2
    data = canonical.dumps({"schema": 1, "bundle_key": fp.bundle_key, "toolchain_key": fp.toolchain_key,
                            "workload_key": fp.workload_key, "facts": dict(fp.facts), "layers": ["inductor"],
                            "entries": rows})  # fmt: skip
    bundle_id = hashlib.sha256(data).hexdigest()
    store.put_bytes(manifest_key(bundle_id), data)
    index.add_bundle(Bundle(bundle_id, fp.bundle_key, fp.toolchain_key, fp.workload_key, None, dict(fp.facts),
                            ("inductor",), 2, 2, datetime.now(timezone.utc), "test", "active"))  # fmt: skip
    plan = gc.plan(store, index, POLICY)
    assert [b.id for b in plan.broken] == [bundle_id] and plan.sweep == ()


class GcRunsBeforeTheCommit:
    """The publisher's store: once the publish revived its packs and writes its manifest, `meanwhile` runs."""

    def __init__(self, inner, meanwhile):
        self.inner, self.meanwhile, self.ran = inner, meanwhile, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_bytes(self, key, data):
        if key.startswith("manifests/") and not self.ran:
            self.ran = True
            self.meanwhile()
        return self.inner.put_bytes(key, data)


def test_gc_runs_within_the_smallest_grace_leave_a_committing_publish_its_packs(tmp_path, store, sqlite_index, fp):
    """A gc planned before a publish revived a pack condemns it after the revive; a second gc with a
    --grace shorter than the publish's revive-to-commit span then swept it, and the publish committed a
    bundle naming a pack the store no longer had (with --grace 0s: 1 of its 2 packs gone, every restore of
    it failed). The smallest grace the CLI takes must outlast that span."""
    write_tree(tmp_path / "v1", {"inductor/kernel.so": b"shared" * 100, "inductor/a.py": b"a"})
    publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "v1", env={})
    _publish(tmp_path, store, sqlite_index, fp, b"other" * 100, "v2")
    policy = gc.Policy(keep_last=1, older_than=timedelta(0), grace=gc.MIN_GRACE)
    stale = gc.plan(store, sqlite_index, policy)  # v1 goes, and the pack of its kernel is to be condemned
    swept = []

    def two_gc_runs():
        gc.execute(store, sqlite_index, stale)  # condemns the pack the publish has just revived
        swept.append(gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, policy)).packs_deleted)

    write_tree(tmp_path / "v3", {"inductor/kernel.so": b"shared" * 100, "inductor/c.py": b"c"})
    v3 = publish(GcRunsBeforeTheCommit(store, two_gc_runs), sqlite_index, fp, LAYERS, root=tmp_path / "v3", env={})
    assert swept == [0]
    assert all(store.exists(pack_key(p)) for p in _packs_of(store, v3.bundle_id))
    assert restore(store, sqlite_index, fp, tmp_path / "dst").bundle_id == v3.bundle_id


@pytest.mark.parametrize("grace", ["0s", "59m", "0.5h"])
def test_a_grace_shorter_than_the_floor_is_a_usage_error_that_names_it(tmp_path, grace):
    """`gc --grace 0s` was taken silently; see the test above for what it can break."""
    result = CliRunner().invoke(main, ["gc", "--dry-run", "--grace", grace])
    assert result.exit_code == 2, result.output
    assert "--grace" in result.stderr and "1h" in result.stderr and "--allow-short-grace" in result.stderr
    assert "Traceback" not in result.output


def test_the_floor_the_cli_names_is_the_one_gc_keeps():
    from kcache import durations
    from kcache.cli.operate_cmd import MIN_GRACE_TEXT

    assert durations.parse(MIN_GRACE_TEXT, "--grace") == gc.MIN_GRACE


def test_a_short_grace_runs_with_the_override(tmp_path):
    runner = CliRunner()
    write_tree(tmp_path / "v1", {"inductor/k": b"one"})
    assert runner.invoke(main, ["publish", "--from", str(tmp_path / "v1"), "--model", "m"]).exit_code == 0
    floor = runner.invoke(main, ["gc", "--dry-run", "--grace", "1h"], catch_exceptions=False)
    assert floor.exit_code == 0, floor.output
    short = runner.invoke(main, ["gc", "--dry-run", "--grace", "0s", "--allow-short-grace"], catch_exceptions=False)
    assert short.exit_code == 0, short.output
