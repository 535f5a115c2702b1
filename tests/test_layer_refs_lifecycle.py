"""Layer refs through a yank, its undo and gc: never left naming a bundle no pod may take the layer from.

refs/layers/<layer>/<layer key> names the newest bundle that gave the layer; `restore --fallback
layers` takes it from that bundle key's newest, and `kcache verify` reports a ref through which no
pod reuses the layer. A yank (or gc deleting the bundle) moves each layer ref naming it to the next
bundle that gives the layer, or removes it; an undo moves it forward to the newest again.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from sqlalchemy import update
from trees import write_tree

from kcache import fingerprint, gc, layerkeys, refs, signing, sources
from kcache.cli import main
from kcache.index.models import BundleRow
from kcache.publish import publish
from kcache.restore import restore
from kcache.store import ref_key
from kcache.verify import verify
from kcache.yank import unyank, yank

KEEP_NONE = gc.Policy(keep_last=0, older_than=timedelta(days=7), grace=timedelta(hours=6))


@pytest.fixture(params=["file", "s3"])
def any_store(request):
    return request.getfixturevalue("store" if request.param == "file" else "s3_store")


def _model(fp, model: str) -> fingerprint.Fingerprint:
    return fingerprint.compute({**fp.facts, "model.id": model})


def _publish(tmp_path, store, index, fp, model: str, tree: dict | None = None):
    """A bundle of `model` on fp's toolchain: its inductor layer has the same layer key as every other model's."""
    name = f"src-{model}-{len(list(tmp_path.iterdir()))}"
    write_tree(tmp_path / name, tree or {"inductor/fxgraph/g": f"graph of {model}".encode()})
    return publish(store, index, _model(fp, model), sources.select(), root=tmp_path / name, env={})


def _inductor_ref(fp) -> str:
    return layerkeys.ref_name("inductor", layerkeys.layer_key("inductor", fp.facts))


def _named(store, fp) -> str | None:
    ref = refs.read(store, _inductor_ref(fp))
    return None if ref is None else ref.manifest


def _donor(store, index, fp, root) -> str | None:
    """The bundle a pod of a model nobody published takes its inductor layer from (--fallback layers)."""
    result = restore(store, index, _model(fp, "a-new-model"), root, fallback="layers")
    return dict(result.donors).get("inductor")


def _age(index, bundle_id: str, days: int) -> None:
    """Stamp a row as published `days` ago, so gc's --older-than dooms it and nothing else."""
    old = datetime.now(timezone.utc) - timedelta(days=days)
    index.transaction(lambda s: s.execute(update(BundleRow).where(BundleRow.id == bundle_id).values(created_at=old)))


def _clean(store, index) -> None:
    result = verify(store, index)
    assert result.problems == () and result.status == "ok", result.problems


# ---- yank --------------------------------------------------------------------------------------------


def test_a_yank_moves_the_layer_ref_to_the_next_donor(tmp_path, any_store, sqlite_index, fp):
    older = _publish(tmp_path, any_store, sqlite_index, fp, "b")
    bad = _publish(tmp_path, any_store, sqlite_index, fp, "a")
    assert _named(any_store, fp) == bad.bundle_id
    _clean(any_store, sqlite_index)

    yank(any_store, sqlite_index, bad.bundle_id, "NaNs")

    assert _named(any_store, fp) == older.bundle_id
    _clean(any_store, sqlite_index)  # reported "no active bundle" for the layer ref before
    assert _donor(any_store, sqlite_index, fp, tmp_path / "r") == older.bundle_id
    assert (tmp_path / "r/inductor/fxgraph/g").read_bytes() == b"graph of b"


def test_a_yank_of_the_only_donor_removes_the_layer_ref(tmp_path, any_store, sqlite_index, fp):
    only = _publish(tmp_path, any_store, sqlite_index, fp, "a")
    yank(any_store, sqlite_index, only.bundle_id, "NaNs")
    assert not any_store.exists(ref_key(_inductor_ref(fp)))
    _clean(any_store, sqlite_index)
    assert _donor(any_store, sqlite_index, fp, tmp_path / "r") is None


def test_a_yank_never_moves_the_layer_ref_to_a_bundle_restore_would_not_take(tmp_path, store, sqlite_index, fp):
    """The next holder is not its own key's newest (that one lacks the layer): restore, which takes the
    key's newest, would refuse it, so the ref goes rather than name it."""
    _publish(tmp_path, store, sqlite_index, fp, "b")
    _publish(tmp_path, store, sqlite_index, fp, "b", {"triton/k1/add.cubin": b"no inductor layer"})
    bad = _publish(tmp_path, store, sqlite_index, fp, "a")
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    assert _named(store, fp) is None
    _clean(store, sqlite_index)


def test_a_yank_signs_the_layer_ref_it_moves(tmp_path, store, sqlite_index, fp):
    private, public = signing.generate("prod", tmp_path / "keys")
    key = signing.load_signing_key(private)
    older = _publish(tmp_path, store, sqlite_index, fp, "b")
    bad = _publish(tmp_path, store, sqlite_index, fp, "a")
    yank(store, sqlite_index, bad.bundle_id, "NaNs", signer=key)
    ref = refs.read(store, _inductor_ref(fp))
    assert ref.manifest == older.bundle_id and dict(ref.signatures).keys() == {"prod"}
    trusted = signing.load_trusted_keys([public])
    assert signing.check(trusted, dict(ref.signatures), ref.message(), "layer ref") == "prod"


def test_a_yank_leaves_a_layer_ref_naming_another_bundle(tmp_path, store, sqlite_index, fp):
    old = _publish(tmp_path, store, sqlite_index, fp, "b")
    newest = _publish(tmp_path, store, sqlite_index, fp, "a")
    before = store.get_bytes(ref_key(_inductor_ref(fp)))
    yank(store, sqlite_index, old.bundle_id, "NaNs")
    assert store.get_bytes(ref_key(_inductor_ref(fp))) == before and _named(store, fp) == newest.bundle_id


def test_the_yank_and_verify_commands(tmp_path, store, sqlite_index, fp):
    older = _publish(tmp_path, store, sqlite_index, fp, "b")
    bad = _publish(tmp_path, store, sqlite_index, fp, "a")
    where = ["--store", store.url, "--index", sqlite_index.url]
    runner = CliRunner()
    runner.invoke(main, ["yank", bad.bundle_id[:12], "--reason", "NaNs", *where], catch_exceptions=False)
    assert _named(store, fp) == older.bundle_id
    checked = runner.invoke(main, ["verify", *where], catch_exceptions=False)
    assert checked.exit_code == 0, checked.output


# ---- yank --undo -------------------------------------------------------------------------------------


@pytest.mark.parametrize("others", [0, 1])
def test_undo_puts_the_layer_ref_back_on_the_newest(tmp_path, store, index, fp, others):
    older = [_publish(tmp_path, store, index, fp, "b") for _ in range(others)]
    bad = _publish(tmp_path, store, index, fp, "a")
    yank(store, index, bad.bundle_id, "NaNs")
    assert _named(store, fp) == (older[0].bundle_id if older else None)

    unyank(store, index, bad.bundle_id)

    assert _named(store, fp) == bad.bundle_id
    _clean(store, index)
    assert _donor(store, index, fp, tmp_path / "r") == bad.bundle_id


def test_undo_does_not_pull_the_layer_ref_back_from_a_newer_bundle(tmp_path, store, sqlite_index, fp):
    bad = _publish(tmp_path, store, sqlite_index, fp, "a")
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    newer = _publish(tmp_path, store, sqlite_index, fp, "c")
    unyank(store, sqlite_index, bad.bundle_id)
    assert _named(store, fp) == newer.bundle_id
    _clean(store, sqlite_index)


# ---- gc ----------------------------------------------------------------------------------------------


def test_gc_deleting_the_donor_moves_its_layer_ref(tmp_path, any_store, sqlite_index, fp):
    young = _publish(tmp_path, any_store, sqlite_index, fp, "b")
    doomed = _publish(tmp_path, any_store, sqlite_index, fp, "a")
    _age(sqlite_index, doomed.bundle_id, days=30)
    _clean(any_store, sqlite_index)

    result = gc.execute(any_store, sqlite_index, gc.plan(any_store, sqlite_index, KEEP_NONE))

    assert result.bundles_deleted == 1 and _named(any_store, fp) == young.bundle_id
    _clean(any_store, sqlite_index)  # reported the layer ref's manifest missing before
    assert _donor(any_store, sqlite_index, fp, tmp_path / "r") == young.bundle_id


def test_gc_deleting_the_only_donor_removes_its_layer_ref(tmp_path, store, sqlite_index, fp):
    only = _publish(tmp_path, store, sqlite_index, fp, "a")
    _age(sqlite_index, only.bundle_id, days=30)
    assert gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, KEEP_NONE)).bundles_deleted == 1
    assert not store.exists(ref_key(_inductor_ref(fp)))
    _clean(store, sqlite_index)


def test_gc_signs_the_layer_ref_it_moves(tmp_path, store, sqlite_index, fp):
    private, _public = signing.generate("prod", tmp_path / "keys")
    young = _publish(tmp_path, store, sqlite_index, fp, "b")
    doomed = _publish(tmp_path, store, sqlite_index, fp, "a")
    _age(sqlite_index, doomed.bundle_id, days=30)
    gc.execute(store, sqlite_index, gc.plan(store, sqlite_index, KEEP_NONE), signer=signing.load_signing_key(private))
    ref = refs.read(store, _inductor_ref(fp))
    assert ref.manifest == young.bundle_id and dict(ref.signatures).keys() == {"prod"}


def test_a_bundle_gc_keeps_after_all_gets_its_layer_ref_back(tmp_path, store, sqlite_index, fp):
    """Planned for deletion, then protected (gc re-checks the rule before the row goes): the layer
    ref it moved off the bundle comes back to it."""
    older = _publish(tmp_path, store, sqlite_index, fp, "b")
    kept = _publish(tmp_path, store, sqlite_index, fp, "a")
    nothing = gc.plan(store, sqlite_index, gc.Policy(3, timedelta(days=7), timedelta(hours=6)))
    planned = replace(nothing, delete_bundles=(sqlite_index.get_bundle(kept.bundle_id),))
    result = gc.execute(store, sqlite_index, planned)
    assert result.bundles_kept == 1 and older.bundle_id != kept.bundle_id
    assert _named(store, fp) == kept.bundle_id
    _clean(store, sqlite_index)


# ---- a publish moving the layer ref meanwhile wins ------------------------------------------------


class PublishesDuringTheMove:
    """The store a yank runs on: a publish of another model (its inductor layer under the same layer
    key) lands just before the yank's first write or removal of the layer ref, as a publisher's
    compare-and-swap would in between the yank's read and its write."""

    def __init__(self, inner, name: str, publish_one):
        self.inner, self.key, self.publish_one, self.published = inner, ref_key(name), publish_one, None

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def _race(self, key) -> None:
        if key == self.key and self.published is None:
            self.published = self.publish_one(self.inner)

    def put_if(self, key, data, version):
        self._race(key)
        return self.inner.put_if(key, data, version)

    def delete(self, key):
        self._race(key)
        return self.inner.delete(key)


@pytest.mark.parametrize("others", [0, 1], ids=["removal", "move"])
def test_a_publish_that_moves_the_layer_ref_meanwhile_wins(tmp_path, any_store, sqlite_index, fp, others):
    for _ in range(others):
        _publish(tmp_path, any_store, sqlite_index, fp, "b")
    bad = _publish(tmp_path, any_store, sqlite_index, fp, "a")
    racing = PublishesDuringTheMove(any_store, _inductor_ref(fp),
                                    lambda inner: _publish(tmp_path, inner, sqlite_index, fp, "c"))  # fmt: skip

    yank(racing, sqlite_index, bad.bundle_id, "NaNs")

    assert racing.published is not None  # the yank wrote (or removed) the layer ref
    assert _named(any_store, fp) == racing.published.bundle_id
    _clean(any_store, sqlite_index)
    assert _donor(any_store, sqlite_index, fp, tmp_path / "r") == racing.published.bundle_id


# ---- publish -----------------------------------------------------------------------------------------


def test_a_newer_bundle_without_the_layer_moves_the_layer_ref_off_the_one_it_replaced(tmp_path, any_store,
                                                                                      sqlite_index, fp):  # fmt: skip
    """Restore takes the layer from the ref's key's newest bundle, which now lacks it: the ref moves to
    another model's bundle that gives it, or goes."""
    other = _publish(tmp_path, any_store, sqlite_index, fp, "b")
    replaced = _publish(tmp_path, any_store, sqlite_index, fp, "a")
    assert _named(any_store, fp) == replaced.bundle_id
    _publish(tmp_path, any_store, sqlite_index, fp, "a", {"triton/k1/add.cubin": b"no inductor layer"})

    assert _named(any_store, fp) == other.bundle_id
    _clean(any_store, sqlite_index)  # "no bundle of that key gives the layer" before
    assert _donor(any_store, sqlite_index, fp, tmp_path / "r") == other.bundle_id


def test_a_newer_bundle_without_the_layer_removes_a_layer_ref_no_other_bundle_can_hold(tmp_path, store,
                                                                                       sqlite_index, fp):  # fmt: skip
    _publish(tmp_path, store, sqlite_index, fp, "a")
    _publish(tmp_path, store, sqlite_index, fp, "a", {"triton/k1/add.cubin": b"no inductor layer"})
    assert not store.exists(ref_key(_inductor_ref(fp)))
    _clean(store, sqlite_index)


def test_a_republish_of_the_newest_bundle_leaves_its_layer_refs(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph of a"})
    first, again = (publish(store, sqlite_index, _model(fp, "a"), sources.select(), root=tmp_path / "src", env={})
                    for _ in range(2))  # fmt: skip
    assert again.bundle_id == first.bundle_id and not again.created and _named(store, fp) == first.bundle_id
