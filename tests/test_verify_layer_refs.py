"""`kcache verify` walks refs/layers/ too: what `restore --fallback layers` follows to reuse a layer, or not."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest
from trees import write_tree

from kcache import fingerprint, layerkeys, refs, sources
from kcache.index import lifecycle
from kcache.publish import publish
from kcache.restore import restore
from kcache.store import manifest_key, ref_key
from kcache.verify import verify

LAYERS = sources.select()
TREE = {"triton/k1/add.cubin": b"triton kernel", "inductor/fxgraph/g": b"graph"}


@pytest.fixture(params=["file", "s3"])
def any_store(request):
    return request.getfixturevalue("store" if request.param == "file" else "s3_store")


def _publish(tmp_path, store, index, fp, tree=TREE, name="src"):
    write_tree(tmp_path / name, tree)
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={})


def _model(fp, model: str) -> fingerprint.Fingerprint:
    return fingerprint.compute({**fp.facts, "model.id": model})


def _triton_ref(fp) -> str:
    return layerkeys.ref_name("triton", layerkeys.layer_key("triton", fp.facts))


def _reused(store, index, fp, root) -> dict[str, str]:
    """{layer: donor bundle id} of a pod of another model restoring with --fallback layers."""
    return dict(restore(store, index, _model(fp, "a-new-model"), root, fallback="layers").donors)


def _point(store, name: str, bundle_id: str) -> None:
    """What a store writer can do: overwrite a layer ref (they are not signed)."""
    store.delete(ref_key(name))
    assert store.put_bytes(ref_key(name), refs.Ref(name, bundle_id, datetime.now(timezone.utc)).to_bytes())


def _layer_problems(result, name: str) -> list[str]:
    return [p for p in result.problems if p.startswith(f"layer ref refs/{name}")]


def test_sound_layer_refs_are_checked_and_pass(tmp_path, any_store, sqlite_index, fp):
    _publish(tmp_path, any_store, sqlite_index, fp, name="v1")
    _publish(tmp_path, any_store, sqlite_index, _model(fp, "another-model"), name="v2")
    result = verify(any_store, sqlite_index)
    assert result.problems == () and result.unchecked == () and result.status == "ok"
    assert result.layer_refs == len(list(any_store.list("refs/layers/"))) >= 2  # triton and inductor at least


@pytest.mark.parametrize("planted", [b"\xff not json {", b"{}"])
def test_a_layer_ref_that_does_not_parse(tmp_path, store, sqlite_index, fp, planted):
    _publish(tmp_path, store, sqlite_index, fp)
    name = _triton_ref(fp)
    store.delete(ref_key(name))
    store.put_bytes(ref_key(name), planted)
    assert "triton" not in _reused(store, sqlite_index, fp, tmp_path / "r")  # what verify must warn of
    (problem,) = verify(store, sqlite_index).problems
    assert problem.startswith(f"layer ref refs/{name}") and "does not parse" in problem


def test_a_layer_ref_whose_manifest_is_gone(tmp_path, any_store, sqlite_index, fp):
    _publish(tmp_path, any_store, sqlite_index, fp)
    name = _triton_ref(fp)
    _point(any_store, name, "ab" * 32)  # a bundle nobody published
    assert "triton" not in _reused(any_store, sqlite_index, fp, tmp_path / "r")
    (problem,) = _layer_problems(verify(any_store, sqlite_index), name)
    assert "ababababab" in problem and "manifest is missing" in problem and "triton" in problem


def test_a_layer_ref_whose_bundle_key_has_no_active_bundle(tmp_path, any_store, sqlite_index, fp):
    only = _publish(tmp_path, any_store, sqlite_index, fp)
    assert _reused(any_store, sqlite_index, fp, tmp_path / "r0")["triton"] == only.bundle_id
    # The row alone (a yank cut off before it moved the layer refs): `kcache yank` moves them (or removes them).
    lifecycle.set_status(sqlite_index, only.bundle_id, "yanked")
    assert "triton" not in _reused(any_store, sqlite_index, fp, tmp_path / "r1")
    result = verify(any_store, sqlite_index)
    (problem,) = _layer_problems(result, _triton_ref(fp))
    assert fp.bundle_key in problem and "no active bundle" in problem
    assert result.status == "damaged"


def test_a_layer_ref_whose_donor_has_a_yank_marker(tmp_path, store, sqlite_index, fp):
    only = _publish(tmp_path, store, sqlite_index, fp)
    store.put_bytes(refs.yank_key(only.bundle_id), b"yanked by hand")  # not through `kcache yank`
    assert "triton" not in _reused(store, sqlite_index, fp, tmp_path / "r")
    (problem,) = _layer_problems(verify(store, sqlite_index), _triton_ref(fp))
    assert only.bundle_id[:12] in problem and refs.yank_key(only.bundle_id) in problem


def test_a_layer_ref_pointed_at_another_toolchains_bundle(tmp_path, store, sqlite_index, fp):
    """A store writer steers the ref to kernels of another GPU: restore refuses them, verify says so."""
    ours = _publish(tmp_path, store, sqlite_index, fp, name="ours")
    other = fingerprint.compute({**fp.facts, "gpu.sm": "sm_80", "gpu.name": "NVIDIA A100", "model.id": "x"})
    theirs = _publish(tmp_path, store, sqlite_index, other, name="theirs")
    name = _triton_ref(fp)
    _point(store, name, theirs.bundle_id)
    assert "triton" not in _reused(store, sqlite_index, fp, tmp_path / "r")
    (problem,) = _layer_problems(verify(store, sqlite_index), name)
    assert theirs.bundle_id[:12] in problem and "does not give the triton layer" in problem
    _point(store, name, ours.bundle_id)
    assert _layer_problems(verify(store, sqlite_index), name) == []


def test_a_layer_ref_whose_manifest_names_no_bundle_key(tmp_path, store, sqlite_index, fp):
    published = _publish(tmp_path, store, sqlite_index, fp)
    key = manifest_key(published.bundle_id)
    store.delete(key)
    store.put_bytes(key, b'{"garbage": true}')
    (problem,) = _layer_problems(verify(store, sqlite_index), _triton_ref(fp))
    assert "names no bundle key" in problem
