"""GC against faults: interrupted runs, runs that overlap, and a --dry-run that must leave everything as it was."""

from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

from click.testing import CliRunner
from gc_helpers import LAYERS, CommitsWhenReleased, packs_of, publish_tree
from trees import write_tree

from kcache import fingerprint, gc, refs
from kcache.cli import main
from kcache.errors import IndexDbError
from kcache.publish import publish
from kcache.restore import restore
from kcache.store import manifest_key, pack_key


class DropsAfterFirstCommit:
    """An index whose connection drops once the first transaction has committed (a crash, a SIGKILL,
    a network cut): every later call fails, as the rest of that gc run would."""

    def __init__(self, inner):
        self.inner, self.url, self.dead = inner, inner.url, False

    def __getattr__(self, name):
        if self.dead:
            raise IndexDbError(self.url, "server closed the connection unexpectedly")
        attr = getattr(self.inner, name)
        if name != "transaction":
            return attr

        def transaction(work):
            result = attr(work)
            self.dead = True
            return result

        return transaction


def test_gc_cut_off_after_deleting_the_bundle_its_ref_names_can_run_again(tmp_path, store, index, fp):
    """keep-last 0 deletes the bundle refs/<key> names. A run cut off between that row's delete and
    the ref's move left a ref naming a bundle the index no longer has, and every later run refused
    the index as "not the one this store's publishers use": gc could never run again."""
    v1 = publish_tree(tmp_path, store, index, fp, b"one" * 100, "v1")
    v2 = publish_tree(tmp_path, store, index, fp, b"two" * 100, "v2")
    assert refs.read(store, fp.bundle_key).manifest == v2.bundle_id
    policy = gc.Policy(keep_last=0, older_than=timedelta(days=7), grace=timedelta(hours=6))
    later = datetime.now(timezone.utc) + timedelta(days=8)
    first = gc.plan(store, index, policy, now=later)
    assert [b.id for b in first.delete_bundles] == [v2.bundle_id, v1.bundle_id]
    try:
        gc.execute(store, DropsAfterFirstCommit(index), first)
    except IndexDbError:
        pass  # the run died part-way
    assert index.get_bundle(v1.bundle_id).status == "active"  # v1 untouched so far

    again = gc.plan(store, index, policy, now=later)  # refused here before the fix
    gc.execute(store, index, again)
    assert refs.read(store, fp.bundle_key) is None
    assert not store.exists(manifest_key(v1.bundle_id))




def test_a_slow_plan_cannot_backdate_a_condemnation_past_grace(tmp_path, store, sqlite_index, fp):
    """A run condemns the packs it found unreferenced when its plan began. It stamped them with the
    plan's start, so a plan that took longer than --grace (a big store, a short --grace) condemned a
    pack a publish had just revived "grace ago": a second gc swept it at once and the publish then
    committed a bundle naming a deleted pack."""
    publish_tree(tmp_path, store, sqlite_index, fp, b"base" * 100, "v0")
    racer = fingerprint.compute({**fp.facts, "model.id": "racer"})
    write_tree(tmp_path / "v1", {"inductor/kernel.so": b"a brand new kernel" * 100})
    pausing = CommitsWhenReleased(sqlite_index)
    box = {}
    publisher = threading.Thread(target=lambda: box.update(r=publish(store, pausing, racer, LAYERS,
                                                                     root=tmp_path / "v1", env={})))  # fmt: skip
    publisher.start()
    try:
        assert pausing.reached.wait(60)  # its pack is uploaded, recorded, revived; no bundle names it yet
        policy = gc.Policy(keep_last=3, older_than=timedelta(days=7), grace=timedelta(hours=6))
        now = datetime.now(timezone.utc)
        # gc A's plan began seven hours ago: it sees the new pack unreferenced and condemns it now.
        gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, policy, now=now - timedelta(hours=7)))
        # gc B, running now, must see a pack condemned just now: one that waits out its grace.
        second = gc.plan(store, sqlite_index, policy, now=now)
        assert second.sweep == () and len(second.waiting) == 1
        gc.execute(store, sqlite_index, second)
    finally:
        pausing.release.set()
        publisher.join(60)
    result = box["r"]
    assert all(store.exists(pack_key(p)) for p in packs_of(store, result.bundle_id))
    pod = restore(store, sqlite_index, racer, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", result.bundle_id), pod.reason


def test_cli_dry_run_creates_no_index_and_names_no_store(tmp_path, isolated_home):
    """--dry-run opened the index as a writer: a default index file that did not exist was created
    and bound to the store, and a store nobody had named got a kcache-store.json. Neither is the
    plan's to change; and a gc with no index file at all is refused rather than planned against an
    empty index (to which every manifest of a store without refs is an orphan)."""
    store_dir = tmp_path / "fresh-store"
    store_dir.mkdir()
    for dry_run in (["--dry-run"], []):
        result = CliRunner().invoke(main, ["gc", *dry_run, "--store", f"file://{store_dir}"])
        assert result.exit_code != 0 and "does not exist" in result.output + result.stderr, result.output
        assert not (isolated_home / "index.db").exists()
        assert list(store_dir.iterdir()) == []


def test_cli_dry_run_leaves_an_unbound_index_unbound(tmp_path):
    from kcache.index import Index

    store_dir, index_file = tmp_path / "fresh-store", tmp_path / "index.db"
    store_dir.mkdir()
    Index.open(f"sqlite:///{index_file}").close()
    args = ["gc", "--dry-run", "--store", f"file://{store_dir}", "--index", f"sqlite:///{index_file}"]
    assert CliRunner().invoke(main, args, catch_exceptions=False).exit_code == 0
    index = Index.open(f"sqlite:///{index_file}")
    assert index.bound_store() is None
    index.close()
    assert list(store_dir.iterdir()) == []
