"""A kept ROOT whose last start took layers from other bundle keys (`--fallback layers`): each such layer
is judged at the next start by its donor's own key (its signed ref, its yanks), as the restore that laid
it judged it, not by this pod's key, whose ref may not exist (the usual case with a fallback) or may
know nothing of the donor."""

import pytest
from faulty import CountingStore
from test_layer_reuse import GPU, TREE, _signed, published
from trees import read_tree, write_tree

from kcache import fingerprint, layerkeys, refs, sources
from kcache.publish import PublishConfig, publish
from kcache.restore import read_state, restore
from kcache.sources import select
from kcache.store import ref_key
from kcache.yank import yank

DONOR, MINE = {**GPU, "model.id": "donor"}, {**GPU, "model.id": "mine"}
OWN = {"triton/k9/own.cubin": b"compiled by the pod on top of the donor's kernels"}


def signed_pod(store, trusted, root, **kw):
    """A pod requiring signatures through refs (no SQL index), with --fallback layers."""
    return restore(store, refs.RefCatalog(store), fingerprint.compute(MINE), root, trusted=trusted,
                   require_signature=True, **{"fallback": "layers", **kw})  # fmt: skip


def test_a_vouched_donors_layers_stay_when_this_key_has_no_ref(tmp_path, store, sqlite_index):
    """This key has no bundle, so no ref: the donor's layers were set aside at every start as if nothing
    vouched for them, though the donor's own signed ref does. Here the layer refs have moved on meanwhile
    (gc, another publish), so the start takes no donor: the pod lost its warm layers for nothing."""
    config, trusted = _signed(tmp_path)
    donor = published(tmp_path, store, sqlite_index, DONOR, config=config)
    root = tmp_path / "kept"
    assert dict(signed_pod(store, trusted, root).donors)["triton"] == donor.bundle_id
    write_tree(root, OWN)
    for layer in layerkeys.FACTS:
        store.delete(ref_key(layerkeys.ref_name(layer, layerkeys.layer_key(layer, MINE))))
    assert signed_pod(store, trusted, root).status == "miss"
    assert (root / "triton/k1/add.cubin").read_bytes() == b"triton kernel"
    assert (root / "triton/k9/own.cubin").is_file()


def test_a_donor_its_own_key_yanked_is_set_aside_though_its_yank_marker_is_gone(tmp_path, store, sqlite_index):
    """The pod's key has a signed ref of its own now (it published what it compiled), which says nothing
    of the donor; the donor's key yanked the donor (its signed ref lists it), and a store writer deleted the
    yank marker. Judged by this key's ref alone, the yanked kernels stayed in ROOT and were loaded."""
    config, trusted = _signed(tmp_path)
    published(tmp_path, store, sqlite_index, DONOR, {"triton/k1/add.cubin": b"older, good"}, "older", config=config)
    bad = published(tmp_path, store, sqlite_index, DONOR, {**TREE, "triton/k1/add.cubin": b"NaN"}, config=config)
    root = tmp_path / "kept"
    assert dict(signed_pod(store, trusted, root).donors)["triton"] == bad.bundle_id
    write_tree(tmp_path / "mine", {"vllm/torch_compile_cache/x.py": b"the pod's own graph"})
    publish(store, sqlite_index, fingerprint.compute(MINE), select(["vllm"]), root=tmp_path / "mine", env={},
            config=PublishConfig(signing_key=config.signing_key))  # fmt: skip
    yank(store, sqlite_index, bad.bundle_id, "NaNs", signer=config.signing_key)
    assert bad.bundle_id in refs.read(store, fingerprint.compute(DONOR).bundle_key).yanked
    store.delete(refs.yank_key(bad.bundle_id))
    assert signed_pod(store, trusted, root, fallback=None).status == "hit"
    assert read_tree(root / "triton") == {}
    assert bad.bundle_id not in read_state(root)["layers_from"].values()
@pytest.mark.parametrize("mode", ["index", "refs"])
def test_a_donor_already_in_its_place_is_not_laid_again(tmp_path, store, sqlite_index, mode):
    """Each start of a kept ROOT fetched the same donor's layer again and swapped it in over the one in
    place, and what the pod had compiled on top of it went with the old one: compiled again, every start."""
    config, trusted = _signed(tmp_path)
    donor = published(tmp_path, store, sqlite_index, DONOR, config=config)
    root = tmp_path / "kept"

    def pod(store):
        if mode == "refs":
            return signed_pod(store, trusted, root)
        return restore(store, sqlite_index, fingerprint.compute(MINE), root, fallback="layers")

    assert pod(store).status == "partial"
    write_tree(root, OWN)
    counting = CountingStore(store)
    again = pod(counting)
    assert again.status == "partial" and dict(again.donors)["triton"] == donor.bundle_id
    assert counting.read.get("packs", 0) == 0
    assert (root / "triton/k1/add.cubin").read_bytes() == b"triton kernel"
    assert (root / "triton/k9/own.cubin").is_file()  # what the pod compiled on top of it stays


def test_a_donors_layer_missing_files_in_its_place_is_laid_again(tmp_path, store, sqlite_index):
    """The marker says the donor lies there, but someone cleared the cache (rm -rf triton/*), or a container
    of the pod wrote the marker wrong: kept as it was, the layer stayed cold on every start after."""
    published(tmp_path, store, sqlite_index, DONOR)
    root = tmp_path / "kept"

    def pod():
        return restore(store, sqlite_index, fingerprint.compute(MINE), root, fallback="layers")

    assert pod().status == "partial"
    (root / "triton/k1/add.cubin").unlink()
    write_tree(root, OWN)
    assert "triton" in dict(pod().donors)
    assert (root / "triton/k1/add.cubin").read_bytes() == b"triton kernel"


def test_a_toolchain_partials_layers_already_in_place_are_not_laid_again(tmp_path, store, sqlite_index):
    """--fallback toolchain, as --fallback layers: the same bundle of another workload was fetched again at
    every start of a kept ROOT and swapped in over its own layers, with what the pod compiled on top."""
    donor = published(tmp_path, store, sqlite_index, DONOR)
    root = tmp_path / "kept"

    def pod(store):
        return restore(store, sqlite_index, fingerprint.compute(MINE), root, fallback="toolchain")

    assert pod(store).bundle_id == donor.bundle_id
    write_tree(root, OWN)
    counting = CountingStore(store)
    again = pod(counting)
    assert again.status == "partial" and again.bundle_id == donor.bundle_id
    assert counting.read.get("packs", 0) == 0
    assert (root / "triton/k9/own.cubin").is_file() and (root / "triton/k1/add.cubin").is_file()


class OlderTriton(sources.TritonSource):
    """The triton layer as a kcache that did not yet know Triton's temporary directories published it."""

    junk = sources.base.COMMON_JUNK


@pytest.mark.parametrize("fallback", ["layers", "toolchain"])
def test_a_layer_in_place_is_kept_though_its_bundle_holds_junk_restore_never_laid(tmp_path, store, sqlite_index,
                                                                                  fallback):  # fmt: skip
    """Restore leaves a bundle's junk out (a half-written Triton temporary, a lock); the check that a donor's
    layer is still in place asked for those files too, found them missing, and laid the layer again at every
    start, with what the pod had compiled on top of it gone."""
    tree = {**TREE, "triton/k1/tmp.pid_7_0f/add.cubin": b"half written"}
    write_tree(tmp_path / "src", tree)
    donor = publish(store, sqlite_index, fingerprint.compute(DONOR), [OlderTriton(), *select(["inductor", "cuda"])],
                    root=tmp_path / "src", env={})  # fmt: skip
    root = tmp_path / "kept"

    def pod(store):
        return restore(store, sqlite_index, fingerprint.compute(MINE), root, fallback=fallback)

    first = pod(store)
    assert first.status == "partial"
    assert not (root / "triton/k1/tmp.pid_7_0f").exists()
    write_tree(root, OWN)
    counting = CountingStore(store)
    again = pod(counting)
    assert again.status == "partial" and donor.bundle_id in (again.bundle_id, *dict(again.donors).values())
    assert counting.read.get("packs", 0) == 0
    assert (root / "triton/k9/own.cubin").is_file()
