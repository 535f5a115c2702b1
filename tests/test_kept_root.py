"""A ROOT kept from one start to the next (a hostPath, a PersistentVolume) that the next start keys
differently: another kind of node under a volume that moved with the pod, another image.

The layers in ROOT were restored or compiled under the last key. A miss left them in place and
kcache.env pointed torch at them: kernels built for another CPU (-march=native, which torch's own
keys do not see) ran there, and `publish --from ROOT` or the watch sidecar filed them under the new
key for every pod of that key. A restore under another key starts from empty layers.
"""

import json
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from trees import read_tree, write_tree

from kcache import envfile, fingerprint, removal, sources
from kcache.errors import ConfigError, RestoreTimeout, StoreError
from kcache.manifest import MAX_LAYERS
from kcache.publish import PublishConfig, publish
from kcache.refs import RefCatalog
from kcache.restore import MARKER_RESERVE, Opened, read_state, restore, restore_opening
from kcache.yank import yank


def publish_tree(store, index, fp, root: Path):
    return publish(store, index, fp, sources.select(), root=root, env={}, config=PublishConfig(allow_empty=True))


@contextmanager
def a_slow_volume(monkeypatch, only: Path | None = None):
    """Every deletion (or only that of `only`) takes longer than any budget, until the block ends."""
    volume_answers = threading.Event()
    real_remove_tree = removal.remove_tree

    def slow_volume(path):
        if only is None or Path(path) == only:
            volume_answers.wait()
        real_remove_tree(path)

    monkeypatch.setattr(removal, "remove_tree", slow_volume)
    try:
        yield
    finally:
        volume_answers.set()


def no_fingerprint():
    raise ConfigError("--facts-file", "facts.json", "does not exist")


def restore_whose_store_is_out_of_reach(root: Path, fp):
    """A restore whose fingerprint `fp` is computed, and whose store then refuses the connection."""
    computed = []

    def store_out_of_reach():
        computed.append(fp)
        raise StoreError("s3://bucket", "connection refused")

    with pytest.raises(StoreError):
        restore_opening(store_out_of_reach, root, computed=lambda: computed[0] if computed else None)


def test_a_miss_under_another_key_starts_from_empty_layers(store, sqlite_index, fp, tmp_path):
    write_tree(tmp_path / "src", {"inductor/fx/a": b"avx512 kernel", "triton/k/k.cubin": b"sm_90"})
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    write_tree(root, {"inductor/fx/own": b"compiled after the restore", "extra/x/y": b"an extra layer"})
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    result = restore(store, sqlite_index, avx2, root)
    assert result.status == "miss" and read_state(root)["bundle_key"] == avx2.bundle_key
    assert read_tree(root / "inductor") == {} and read_tree(root / "triton") == {}
    assert not (root / "extra/x").exists()
    assert envfile.read(root / envfile.NAME)["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")


def test_the_same_key_keeps_what_the_pod_compiled(store, sqlite_index, fp, tmp_path):
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "miss"
    write_tree(root, {"inductor/fx/own": b"compiled on the cold start"})
    assert restore(store, sqlite_index, fp, root).status == "miss"
    assert set(read_tree(root / "inductor")) == {"fx/own"}


def test_a_root_without_a_marker_is_left_as_it_is(store, sqlite_index, fp, tmp_path):
    """No marker says under which key its layers were made: nothing to compare, nothing removed."""
    root = tmp_path / "root"
    write_tree(root, {"inductor/fx/own": b"from before kcache"})
    assert restore(store, sqlite_index, fp, root).status == "miss"
    assert set(read_tree(root / "inductor")) == {"fx/own"}


def test_a_restore_that_never_knew_its_key_keeps_the_last_one(store, sqlite_index, fp, tmp_path):
    """A fingerprint that fails leaves the layers alone, and its error marker still names the key they
    were made under: the next start under another key empties them."""
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    write_tree(root, {"inductor/fx/own": b"compiled under the first key"})

    with pytest.raises(ConfigError):
        restore_opening(no_fingerprint, root)
    assert read_state(root)["status"] == "error" and read_state(root)["layers_key"] == fp.bundle_key
    assert set(read_tree(root / "inductor")) == {"fx/own"}
    restore(store, sqlite_index, fingerprint.compute({**fp.facts, "gpu.sm": "sm_90"}), root)
    assert read_tree(root / "inductor") == {}


def test_a_restore_that_fails_after_its_fingerprint_leaves_no_other_keys_layers(store, sqlite_index, fp, tmp_path):
    """The fingerprint came, the store or the index did not (a bucket out of reach, an index that hung
    past the budget): the error marker names this start's key, so the layers must be this key's too, or
    kcache.env points torch at another node's kernels and the next start under this key keeps them."""
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    write_tree(root, {"inductor/fx/own": b"compiled under the first key"})
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    restore_whose_store_is_out_of_reach(root, avx2)
    state = read_state(root)
    assert state["status"] == "error" and state["bundle_key"] == avx2.bundle_key
    assert read_tree(root / "inductor") == {} and state["layers_key"] == avx2.bundle_key


def test_a_restore_whose_index_hangs_past_the_budget_leaves_no_other_keys_layers(store, sqlite_index, fp, tmp_path):
    """The budget runs out while the index opens: the error path, not the worker still waiting on it,
    empties the layers, and the worker that returns after that leaves them as they are."""
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    write_tree(root, {"inductor/fx/own": b"compiled under the first key"})
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    computed, answer = [], threading.Event()

    def index_that_hangs():
        computed.append(avx2)
        answer.wait()
        return Opened(store, sqlite_index, avx2)

    try:
        with pytest.raises(RestoreTimeout):
            restore_opening(index_that_hangs, root, timeout=0.5, computed=lambda: computed[0] if computed else None)
        state = read_state(root)
        assert state["status"] == "error" and state["layers_key"] == avx2.bundle_key
        assert read_tree(root / "inductor") == {}
    finally:
        answer.set()


def test_deleting_another_keys_layers_costs_the_hit_no_budget(store, sqlite_index, fp, tmp_path, monkeypatch):
    """What was set aside (a hundred thousand files, a slow volume) was deleted before anything was
    chosen, waiting up to the whole budget for it: the restore then ran out of time and started cold
    though a bundle matched. It is deleted once the bundle is in place, as the layers a swap replaces."""
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    write_tree(tmp_path / "src", {"inductor/fx/a": b"avx2 kernel"})
    publish_tree(store, sqlite_index, avx2, tmp_path / "src")
    root = tmp_path / "root"
    restore(store, sqlite_index, fp, root)
    write_tree(root, {"inductor/fx/own": b"compiled under the first key"})
    with a_slow_volume(monkeypatch):
        result = restore(store, sqlite_index, avx2, root, timeout=3)
        assert result.status == "hit", result.reason
        assert set(read_tree(root / "inductor")) == {"fx/a"} and read_state(root)["layers_key"] == avx2.bundle_key


def test_a_layer_that_cannot_be_set_aside_is_left_out_of_kcache_env(store, sqlite_index, fp, tmp_path, tmpfs):
    """A volume mounted at ROOT/inductor (EBUSY on rename) keeps the last key's kernels after a miss
    under another key. kcache.env must not point torch at them (another CPU's -march=native code), the
    marker must say they are the last key's, and `publish --from ROOT` must leave them out rather than
    file them under this key for every pod of it."""
    root = tmp_path / "root"
    tmpfs(root / "inductor")
    assert restore(store, sqlite_index, fp, root).status == "miss"
    write_tree(root, {"inductor/fx/own": b"avx512 kernel", "triton/k/k.cubin": b"sm_90"})
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    result = restore(store, sqlite_index, avx2, root)
    assert result.status == "miss"
    assert set(read_tree(root / "inductor")) == {"fx/own"} and read_tree(root / "triton") == {}
    env = envfile.read(root / envfile.NAME)
    assert "TORCHINDUCTOR_CACHE_DIR" not in env and env["TRITON_CACHE_DIR"] == str(root / "triton")
    state = read_state(root)
    assert state["layers_key"] == avx2.bundle_key and state["kept_back"] == {"inductor": fp.bundle_key}
    write_tree(root, {"triton/k2/k.cubin": b"compiled under avx2"})
    published = publish_tree(store, sqlite_index, avx2, root)
    assert published.files == 1 and published.layers == ("triton",)
    assert restore(store, sqlite_index, fp, root).status == "miss"  # back on a node of the first key
    assert set(read_tree(root / "inductor")) == {"fx/own"}
    assert envfile.read(root / envfile.NAME)["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert read_state(root)["layers_key"] == fp.bundle_key and read_state(root)["kept_back"] == {}


def test_publish_from_a_root_whose_layers_another_key_made_refuses(store, sqlite_index, fp, tmp_path):
    """The marker says the layers are another key's (a restore that failed before comparing them):
    publishing them under this key would hand every pod of it the other machine's kernels."""
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "miss"
    write_tree(root, {"inductor/fx/own": b"avx512 kernel"})
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    with pytest.raises(ConfigError, match="on another toolchain"):
        publish_tree(store, sqlite_index, avx2, root)
    assert publish_tree(store, sqlite_index, fp, root).files == 1


def test_a_failed_restore_leaves_a_layer_kept_back_out_of_kcache_env(store, sqlite_index, fp, tmp_path, tmpfs):
    """The error path writes kcache.env too: a layer of another key that stayed in place is left out there."""
    root = tmp_path / "root"
    tmpfs(root / "inductor")
    restore(store, sqlite_index, fp, root)
    write_tree(root, {"inductor/fx/own": b"avx512 kernel"})
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    restore_whose_store_is_out_of_reach(root, avx2)
    assert "TORCHINDUCTOR_CACHE_DIR" not in envfile.read(root / envfile.NAME)
    assert read_state(root)["kept_back"] == {"inductor": fp.bundle_key}

    with pytest.raises(ConfigError):  # no key known: what was kept back stays so
        restore_opening(no_fingerprint, root)
    assert "TORCHINDUCTOR_CACHE_DIR" not in envfile.read(root / envfile.NAME)
    assert read_state(root)["kept_back"] == {"inductor": fp.bundle_key}


def test_a_killed_restores_leftovers_cost_the_next_hit_no_budget(store, sqlite_index, fp, tmp_path, monkeypatch):
    """A restore killed, or cut off by its budget while it deleted the layers its swap replaced, leaves
    its staging directory (the last start's compiles: a hundred thousand files) for the next one. That
    one deleted it before anything was chosen, waiting up to the whole budget: on a slow volume it ran
    out of time and started cold though a bundle matched, and so did every start after it."""
    write_tree(tmp_path / "src", {"inductor/fx/a": b"kernel"})
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    leftover = root / ".kcache-staging-1-killed"
    write_tree(leftover, {"retired/0/fx/own": b"compiled by the last start"})
    with a_slow_volume(monkeypatch, only=leftover):  # deleting the leftover takes longer than the budget
        result = restore(store, sqlite_index, fp, root, timeout=3)
        assert result.status == "hit", result.reason
        assert set(read_tree(root / "inductor")) == {"fx/a"} and read_state(root)["status"] == "hit"
    assert restore(store, sqlite_index, fp, root).status == "hit"  # without a budget: deleted to the end
    assert not leftover.exists()


@pytest.mark.parametrize("catalog", ["index", "refs"])
def test_the_same_key_sets_aside_what_a_yanked_bundle_laid_down(store, sqlite_index, fp, tmp_path, catalog):
    """The last start restored a bundle of this key that has been yanked since (bad kernels, NaNs): this
    start misses, and the same key kept the layers that bundle laid down, so kcache.env pointed the
    model at the yanked kernels on that node start after start. What the pod compiled itself stays."""
    write_tree(tmp_path / "src", {"inductor/fx/bad": b"kernel that returns NaN", "triton/k/k.cubin": b"bad"})
    bad = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    write_tree(root, {"vllm/own/graph": b"compiled by the pod after its restore"})
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    result = restore(store, sqlite_index if catalog == "index" else RefCatalog(store), fp, root)
    assert result.status == "miss"
    assert read_tree(root / "inductor") == {} and read_tree(root / "triton") == {}
    assert read_tree(root / "vllm") == {"own/graph": (b"compiled by the pod after its restore", 0o644)}


def test_a_hostile_marker_costs_no_restore_and_moves_nothing_outside_the_layers(store, sqlite_index, fp, tmp_path):
    """The marker lies in ROOT, which every container of the pod writes: places and bundle ids from it
    only ever name layers of ROOT to set aside; a place no layer has, or an id that is none, is passed over."""
    write_tree(tmp_path / "src", {"inductor/fx/bad": b"kernel that returns NaN"})
    bad = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    write_tree(root, {"triton/k/own": b"compiled by the pod"})
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    marker = root / ".kcache-state.json"
    state = json.loads(marker.read_text())
    state["layers_from"] = {"inductor": bad.bundle_id, "..": bad.bundle_id, "../x": bad.bundle_id,
                            "extra/../../x": bad.bundle_id, "triton": "../../etc", "7": 7}  # fmt: skip
    marker.write_text(json.dumps(state))
    write_tree(tmp_path, {"x/kept": b"outside ROOT"})
    assert restore(store, sqlite_index, fp, root).status == "miss"
    assert not (root / "inductor/fx/bad").exists()  # the yanked bundle's layer, as restore recorded it
    assert (root / "triton/k/own").is_file()  # "../../etc" names no bundle: nothing yanked set it aside
    assert (tmp_path / "x/kept").is_file() and read_state(root)["status"] == "miss"


def test_a_bundle_yanked_with_its_ref_and_marker_gone_is_not_kept_for_a_pod_requiring_signatures(
        store, sqlite_index, fp, tmp_path):  # fmt: skip
    """Through refs, requiring signatures: the key's only bundle is yanked with the key (its ref goes: no
    active bundle), and a store writer deletes the marker. Nothing signed vouches for the kept bundle."""
    from kcache import refs, signing

    private, public = signing.generate("prod", tmp_path / "keys")
    key, trusted = signing.load_signing_key(private), signing.load_trusted_keys([public])
    write_tree(tmp_path / "src", {"inductor/fx/a": b"kernel that gives NaNs"})
    bad = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={},
                  config=PublishConfig(signing_key=key))  # fmt: skip
    root = tmp_path / "root"

    def pod():
        return restore(store, refs.RefCatalog(store), fp, root, trusted=trusted, require_signature=True)

    assert pod().status == "hit"
    yank(store, sqlite_index, bad.bundle_id, "NaNs", signer=key)
    store.delete(refs.yank_key(bad.bundle_id))
    assert pod().status == "miss"
    assert read_tree(root / "inductor") == {}


def test_a_miss_keeps_the_layers_of_a_bundle_that_was_not_yanked(store, sqlite_index, fp, tmp_path):
    write_tree(tmp_path / "src", {"inductor/fx/a": b"good kernel"})
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    write_tree(root, {"inductor/fx/own": b"compiled after the restore"})
    assert restore(store, sqlite_index, fp, root, bundle_id="f" * 64).status == "miss"  # pinned to nothing
    assert set(read_tree(root / "inductor")) == {"fx/a", "fx/own"}


def test_a_hostile_marker_does_not_grow_the_next_ones(store, sqlite_index, fp, tmp_path):
    """Each start under the same key writes back what the marker says each layer holds: no more of it
    than a bundle could lay down, whatever a container of the pod wrote there."""
    write_tree(tmp_path / "src", {"inductor/fx/a": b"kernel"})
    published = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    marker = root / ".kcache-state.json"
    state = json.loads(marker.read_text())
    state["layers_from"] = {f"extra/x{i}": published.bundle_id for i in range(5000)}
    marker.write_text(json.dumps(state))
    restore_whose_store_is_out_of_reach(root, fp)  # a failed start carries what the marker says over
    assert len(read_state(root)["layers_from"]) <= MAX_LAYERS + len(sources.BUILTIN)


def test_a_failed_start_between_does_not_make_a_yanked_bundles_layers_stay(store, sqlite_index, fp, tmp_path):
    """One start in between failed (the bucket out of reach) and kept the layers, as the same key does:
    its error marker must still say which bundle laid them down, or once that bundle is yanked no later
    start looks it up, and kcache.env points the model at the yanked kernels on that node for good."""
    write_tree(tmp_path / "src", {"inductor/fx/bad": b"kernel that returns NaN"})
    bad = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    restore_whose_store_is_out_of_reach(root, fp)
    assert (root / "inductor/fx/bad").is_file()  # the same key keeps its layers
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    assert restore(store, sqlite_index, fp, root).status == "miss"
    assert read_tree(root / "inductor") == {}


def test_a_yanked_layer_that_cannot_be_set_aside_is_left_out_of_kcache_env(store, sqlite_index, fp, tmp_path, tmpfs):
    """A volume mounted at ROOT/inductor (EBUSY on rename) keeps what a since-yanked bundle laid down
    there: kcache.env must not point the model at it, `publish --from ROOT` must leave it out, and no
    later start takes it back, a start under this key after one under another included."""
    write_tree(tmp_path / "src", {"inductor/fx/bad": b"kernel that returns NaN", "triton/k/k.cubin": b"bad"})
    bad = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    tmpfs(root / "inductor")
    write_tree(root, {"inductor/fx/bad": b"kernel that returns NaN"})
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    assert restore(store, sqlite_index, fp, root).status == "miss"
    assert read_tree(root / "triton") == {} and (root / "inductor/fx/bad").is_file()
    env = envfile.read(root / envfile.NAME)
    assert "TORCHINDUCTOR_CACHE_DIR" not in env and env["TRITON_CACHE_DIR"] == str(root / "triton")
    assert read_state(root)["kept_back"] == {"inductor": fp.bundle_key}
    write_tree(root, {"triton/k2/k.cubin": b"compiled by the pod"})
    assert publish_tree(store, sqlite_index, fp, root).layers == ("triton",)
    assert restore(store, sqlite_index, fp, root).status == "hit"  # the pod's own bundle; inductor still held
    assert "TORCHINDUCTOR_CACHE_DIR" not in envfile.read(root / envfile.NAME)
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    assert restore(store, sqlite_index, avx2, root).status == "miss"  # another key, then this one again:
    assert restore(store, sqlite_index, fp, root).status == "hit"  # no start takes the yanked layer back
    assert "TORCHINDUCTOR_CACHE_DIR" not in envfile.read(root / envfile.NAME)
    assert (root / "inductor/fx/bad").is_file() and read_state(root)["kept_back"] == {"inductor": fp.bundle_key}


def test_a_store_that_hangs_on_the_yank_look_up_leaves_no_other_keys_layers(store, sqlite_index, fp, tmp_path):
    """Layers made under another key go whatever any bundle in them is: a store that hung while the
    kept layers' bundles were looked up for yanks held them all past the budget, and the pod on a node
    of another kind started with the last one's kernels (kcache.env pointing torch at them)."""
    write_tree(tmp_path / "src", {"inductor/fx/a": b"avx512 kernel"})
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    answer = threading.Event()

    class HangingStore:
        def __getattr__(self, name):
            return getattr(store, name)

        def exists(self, key):
            if key.startswith("yanks/"):
                answer.wait()
            return store.exists(key)

    try:
        try:  # a miss, or the budget spent elsewhere: either way the other key's layers are gone
            restore_opening(lambda: Opened(HangingStore(), sqlite_index, avx2), root, timeout=2)
        except RestoreTimeout:
            pass
        assert read_state(root)["layers_key"] == avx2.bundle_key
        assert read_tree(root / "inductor") == {}
    finally:
        answer.set()


def test_a_kept_back_layer_that_stays_under_its_key_is_still_checked_for_yanks(store, sqlite_index, fp, tmp_path,
                                                                                  tmpfs):  # fmt: skip
    """A layer kept back under this key (a volume at ROOT/inductor: EBUSY) stays when a start under this key
    follows one under another; what it holds must stay named in the marker, or once its bundle is yanked no
    start looks it up and kcache.env points the model at the yanked kernels on that node for good."""
    write_tree(tmp_path / "src", {"inductor/fx/bad": b"kernel that returns NaN"})
    bad = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    tmpfs(root / "inductor")
    write_tree(root, {"inductor/fx/bad": b"kernel that returns NaN"})
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    assert restore(store, sqlite_index, avx2, root).status == "miss"
    assert read_state(root)["kept_back"] == {"inductor": fp.bundle_key}
    restore_whose_store_is_out_of_reach(root, fp)  # this key again: the layer is its own, and stays
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    assert restore(store, sqlite_index, fp, root).status == "miss"
    assert "TORCHINDUCTOR_CACHE_DIR" not in envfile.read(root / envfile.NAME)


def marker_written_over(root: Path, fp, **fields) -> int:
    """The size of the marker the next (failed) start writes once a container of the pod rewrote `fields`."""
    marker = root / ".kcache-state.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), **fields}))
    restore_whose_store_is_out_of_reach(root, fp)
    return marker.stat().st_size


def test_a_marker_names_no_place_restore_does_not_lay_a_layer_at(store, sqlite_index, fp, tmp_path):
    """layers_from was bounded in count, not in what it names: ~300 places of 4 KB each that no layer
    has, written back by every start, made the marker ~1 MB, past the room set aside for it on a full
    volume (then no marker, and readiness waits for ever). Only places restore lays are read."""
    write_tree(tmp_path / "src", {"inductor/fx/a": b"kernel"})
    published = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    junk = {f"junk/{i:03d}/{'a' * 4000}": published.bundle_id for i in range(300)}
    size = marker_written_over(root, fp, layers_from={**junk, "inductor": published.bundle_id, "extra/..": "x"})
    assert size <= MARKER_RESERVE
    assert read_state(root)["layers_from"] == {"inductor": published.bundle_id}


@pytest.mark.parametrize("fingerprinted", [True, False], ids=["store-out-of-reach", "no-fingerprint"])
def test_what_a_failed_start_carries_over_from_a_marker_fits_the_room_set_aside(store, sqlite_index, fp, tmp_path,
                                                                                 fingerprinted):  # fmt: skip
    """A failed start carries the last marker's layers_key, kept_back and bundle_keys over: read as they
    were (any string, any count), a container's 3 MB of them were written back every start, past the
    64 KiB set aside for the marker. The key stays one that is not this pod's: the layers still go."""
    write_tree(tmp_path / "src", {"inductor/fx/a": b"kernel"})
    published = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    ids = [f"{i:064x}" for i in range(MAX_LAYERS + 20)]
    places = {f"extra/{i:03d}{'n' * 60}": bundle for i, bundle in enumerate(ids)}
    marker = root / ".kcache-state.json"
    state = {**json.loads(marker.read_text()), "layers_from": {**places, "inductor": published.bundle_id},
             "bundle_keys": {bundle: "a" * 32 for bundle in ids}}  # fmt: skip
    if not fingerprinted:  # carried over as they are (with the fingerprint, the layers are compared)
        state.update({"layers_key": "k" * 1_000_000, "kept_back": {f"p{i}" * 100: "k" * 1000 for i in range(1000)}})
    marker.write_text(json.dumps(state))
    if fingerprinted:
        restore_whose_store_is_out_of_reach(root, fp)
    else:
        with pytest.raises(ConfigError):
            restore_opening(no_fingerprint, root)
    assert marker.stat().st_size <= MARKER_RESERVE
    if not fingerprinted:
        assert read_state(root)["layers_key"] not in (fp.bundle_key, None)
        write_tree(root, {"inductor/fx/own": b"compiled after"})
        restore(store, sqlite_index, fp, root, bundle_id="f" * 64)  # pinned to nothing: a miss
        assert read_tree(root / "inductor") == {}  # made under a key that is not this one: set aside


def test_extra_layers_that_cannot_be_set_aside_stay_kept_back_at_the_next_start(store, sqlite_index, fp, tmp_path,
                                                                                tmpfs):  # fmt: skip
    """ROOT/extra is set aside as a whole, and kept back as "extra" when a volume is mounted there: the
    marker's reader must take that name too, or the next start under the new key takes the last key's
    extra layers for its own (`publish --from ROOT` files them under it)."""
    root = tmp_path / "root"
    tmpfs(root / "extra")
    assert restore(store, sqlite_index, fp, root).status == "miss"
    write_tree(root, {"extra/trt/plan": b"built for the first key's GPU"})
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    assert restore(store, sqlite_index, avx2, root).status == "miss"
    assert read_state(root)["kept_back"] == {"extra": fp.bundle_key}
    assert restore(store, sqlite_index, avx2, root).status == "miss"
    assert read_state(root)["kept_back"] == {"extra": fp.bundle_key}


def test_another_keys_header_is_set_aside_whichever_user_made_it(store, sqlite_index, fp, tmp_path):
    """Only the headers of this process's user and of the last start's were set aside under another key:
    alice compiled one under the first key, a start as bob followed, and then a start under another key
    as alice left hers in place, for torch (running as alice) to load on another machine."""
    root = tmp_path / "root"
    header = "tmp/torchinductor_alice/precompiled_headers/h.gch"
    assert restore(store, sqlite_index, fp, root, run_as="alice").status == "miss"
    write_tree(root, {header: b"compiled for the first key's CPU"})
    assert restore(store, sqlite_index, fp, root, run_as="bob").status == "miss"
    assert (root / header).is_file()  # the same key keeps it
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    assert restore(store, sqlite_index, avx2, root, run_as="alice").status == "miss"
    assert not (root / header).exists()


@pytest.mark.parametrize("place", ["", "/", ".", "inductor/../.."])
def test_publish_from_root_leaves_out_only_places_a_restore_keeps_back(store, sqlite_index, fp, tmp_path, place):
    """`kept_back` names the places restore could not set aside; a container of the pod may write the marker
    too, and a place that is none ("" is ROOT itself) made publish --from ROOT leave out every layer."""
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "miss"
    write_tree(root, {"inductor/fx/own": b"kernel", "triton/k/k.cubin": b"sm_90"})
    marker = root / ".kcache-state.json"
    state = json.loads(marker.read_text())
    state["kept_back"] = {place: fp.bundle_key, "triton": fp.bundle_key}
    marker.write_text(json.dumps(state))
    published = publish_tree(store, sqlite_index, fp, root)
    assert published.layers == ("inductor",) and published.files == 1
