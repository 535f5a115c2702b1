"""`yank --undo` where it cannot bring the bundle back: its objects are gone, or so is its row.

Undone, a bundle is its key's newest again for every pod. One whose manifest or packs the store
lost would fail each restore (where the yank sent pods to the previous bundle), and, retained
with a missing manifest, hold every gc sweep.
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from gc_helpers import packs_of, publish_tree

from kcache import gc, refs
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.errors import IntegrityError, NotFound, ObjectMissing
from kcache.restore import restore
from kcache.store import manifest_key, pack_key
from kcache.yank import BundleGone, unyank, yank


@pytest.fixture
def yanked(tmp_path, store, sqlite_index, fp):
    """(good, bad): two bundles of one key, the newer one yanked."""
    good = publish_tree(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v1")
    bad = publish_tree(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v2")
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    return good, bad


@pytest.mark.parametrize("lost", ["manifest", "pack", "pack's tail"])
def test_undo_of_a_bundle_whose_objects_are_gone_is_refused_and_changes_nothing(tmp_path, store, sqlite_index, fp,
                                                                                yanked, lost):  # fmt: skip
    good, bad = yanked
    gone = manifest_key(bad.bundle_id) if lost == "manifest" else pack_key(sorted(packs_of(store, bad.bundle_id))[0])
    if lost == "pack's tail":  # cut short: every blob past its first bytes would fail each restore
        head = store.get_bytes(gone)[:10]
        store.delete(gone)
        store.put_bytes(gone, head)
    else:
        store.delete(gone)
    with pytest.raises(ObjectMissing if lost != "pack's tail" else IntegrityError) as caught:
        unyank(store, sqlite_index, bad.bundle_id)
    assert caught.value.key == gone if lost != "pack's tail" else gone in str(caught.value)
    assert sqlite_index.get_bundle(bad.bundle_id).status == "yanked"
    assert store.exists(refs.yank_key(bad.bundle_id))
    assert refs.read(store, fp.bundle_key).manifest == good.bundle_id
    pod = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", good.bundle_id), pod.reason


def test_undo_after_gc_deleted_the_bundle_says_so(tmp_path, store, sqlite_index, fp, yanked):
    _good, bad = yanked
    later = datetime.now(timezone.utc) + timedelta(days=8)
    gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, gc.Policy(1, timedelta(days=7)), now=later))
    assert store.exists(refs.yank_key(bad.bundle_id))  # the marker outlives the bundle
    with pytest.raises(BundleGone) as caught:
        unyank(store, sqlite_index, bad.bundle_id[:12])
    assert isinstance(caught.value, NotFound) and caught.value.name == bad.bundle_id[:12]
    with pytest.raises(NotFound) as unknown:
        unyank(store, sqlite_index, "0123456789ab")
    assert not isinstance(unknown.value, BundleGone)


def test_cli_undo_after_gc_names_the_way_back(tmp_path, isolated_home):
    runner = CliRunner()
    (tmp_path / "src/inductor").mkdir(parents=True)
    (tmp_path / "src/inductor/k.so").write_bytes(b"kernel")
    published = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m", "--json"])
    bundle_id = json.loads(published.output)["bundle_id"]
    assert runner.invoke(main, ["yank", bundle_id[:12]]).exit_code == 0
    assert runner.invoke(main, ["gc", "--keep-last", "0", "--older-than", "0s"]).exit_code == 0
    undo = runner.invoke(main, ["yank", bundle_id[:12], "--undo", "--json"])
    assert undo.exit_code == ExitCode.NOT_FOUND, undo.output
    error = json.loads(undo.stdout)
    assert "yank" in error["error"] and "publish" in error["hint"], error
