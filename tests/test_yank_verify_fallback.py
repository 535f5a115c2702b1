"""Operator commands: yank (and undo), verify, and restore --fallback toolchain."""

import json
import os

import pytest
from click.testing import CliRunner
from trees import read_tree, write_tree

from kcache import fingerprint, refs, sources
from kcache.cli import main
from kcache.errors import IntegrityError
from kcache.publish import publish
from kcache.restore import restore
from kcache.verify import in_subset, parse_subset, verify
from kcache.yank import unyank, yank

LAYERS = sources.select()


def _publish(tmp_path, store, index, fp, files, name="src"):
    write_tree(tmp_path / name, files)
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={})


def test_yanked_bundle_is_never_restored_and_undo_brings_it_back(tmp_path, store, sqlite_index, fp):
    old = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"good"}, "v1")
    bad = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"broken"}, "v2")
    assert restore(store, sqlite_index, fp, tmp_path / "r0").bundle_id == bad.bundle_id
    yank(store, sqlite_index, bad.bundle_id, "NaNs")
    # Both catalogs now hand out the previous bundle.
    assert restore(store, sqlite_index, fp, tmp_path / "r1").bundle_id == old.bundle_id
    assert restore(store, refs.RefCatalog(store), fp, tmp_path / "r2").bundle_id == old.bundle_id
    pinned = restore(store, sqlite_index, fp, tmp_path / "r3", bundle_id=bad.bundle_id)
    assert pinned.status == "miss" and "yanked" in pinned.reason
    unyank(store, sqlite_index, bad.bundle_id)
    assert restore(store, sqlite_index, fp, tmp_path / "r4").bundle_id == bad.bundle_id
    assert restore(store, refs.RefCatalog(store), fp, tmp_path / "r5").bundle_id == bad.bundle_id


def test_yanking_the_only_bundle_makes_a_miss_everywhere(tmp_path, store, sqlite_index, fp):
    only = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"})
    yank(store, sqlite_index, only.bundle_id)
    assert restore(store, sqlite_index, fp, tmp_path / "r1").status == "miss"
    assert restore(store, refs.RefCatalog(store), fp, tmp_path / "r2").status == "miss"


def test_refs_restore_respects_a_yank_marker_even_if_the_ref_was_not_moved(tmp_path, store, sqlite_index, fp):
    only = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"})
    store.put_bytes(refs.yank_key(only.bundle_id), b"yanked by hand")
    assert restore(store, refs.RefCatalog(store), fp, tmp_path / "r").status == "miss"


def test_verify_finds_missing_and_corrupt_packs(tmp_path, store, sqlite_index, fp):
    _publish(tmp_path, store, sqlite_index, fp, {f"inductor/{i}": os.urandom(2000) for i in range(30)})
    clean = verify(store, sqlite_index, read_data=True)
    assert clean.problems == () and clean.blobs_read == 30 and clean.bundles == 1
    (pack,) = store.list("packs/")
    path = store.root / pack.key
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    assert verify(store, sqlite_index).problems == ()  # existence checks cannot see a flipped bit
    damaged = verify(store, sqlite_index, read_data=True)
    assert damaged.problems and damaged.blobs_read == 29
    path.unlink()
    missing = verify(store, sqlite_index)
    assert missing.problems and all("missing" in p for p in missing.problems)



@pytest.mark.parametrize("victim", ["a", "b"])
def test_verify_reads_every_copy_of_a_blob(tmp_path, store, fp, victim):
    """Two publishers that never saw each other's index pack the same file twice: a corrupt copy is
    found whichever pack it is in, since restore of the bundle naming that pack would fail."""
    from kcache import manifest as manifests
    from kcache.index import Index
    from kcache.reindex import reindex
    from kcache.store import pack_key

    same = {"inductor/k.so": os.urandom(5000)}
    models = {}
    for model in ("a", "b"):
        models[model] = fingerprint.compute({**fp.facts, "model.id": model})
        _publish(tmp_path, store, Index.open(f"sqlite:///{tmp_path / model}.db"), models[model], same, model)
    index = Index.open(f"sqlite:///{tmp_path / 'all.db'}")
    reindex(store, index)
    assert len(list(store.list("packs/"))) == 2
    clean = verify(store, index, read_data=True)
    assert clean.problems == () and clean.blobs_read == 2 and clean.packs == 2

    parsed = [manifests.parse(store.get_bytes(i.key), i.key.rsplit("/", 1)[-1]) for i in store.list("manifests/")]
    (entry,) = next(m for m in parsed if m.facts["model.id"] == victim).entries
    path = store.root / pack_key(entry.pack)
    data = bytearray(path.read_bytes())
    data[entry.offset + entry.length // 2] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    damaged = verify(store, index, read_data=True)
    assert damaged.blobs_read == 1 and len(damaged.problems) == 1 and entry.pack[:12] in damaged.problems[0]
    with pytest.raises(IntegrityError):  # what verify warned of
        restore(store, index, models[victim], tmp_path / "r")

def test_subsets_partition_the_packs():
    ids = [f"{i:08x}" + "0" * 56 for i in range(0, 2**32, 2**32 // 97)]
    for total in (1, 3, 7):
        slices = [{i for i in ids if in_subset(i, (n, total))} for n in range(1, total + 1)]
        assert set().union(*slices) == set(ids) and sum(map(len, slices)) == len(ids)
    with pytest.raises(Exception, match="n/t"):
        parse_subset("x")


def test_fallback_restores_kernel_layers_from_another_workload(tmp_path, store, sqlite_index, fp):
    other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
    files = {"inductor/fxgraph/g": b"graph", "triton/k/k.cubin": b"cubin", "vllm/torch_compile_cache/x": b"v"}
    _publish(tmp_path, store, sqlite_index, other, files)
    assert restore(store, sqlite_index, fp, tmp_path / "plain").status == "miss"
    partial = restore(store, sqlite_index, fp, tmp_path / "dst", fallback="toolchain")
    assert partial.status == "partial" and "another workload" in partial.reason
    assert set(partial.layers) == {"inductor", "triton"}
    assert read_tree(tmp_path / "dst/triton") == {"k/k.cubin": (b"cubin", 0o644)}
    assert read_tree(tmp_path / "dst/vllm") == {}  # keyed by the workload: never shared


def test_fallback_never_crosses_toolchains(tmp_path, store, sqlite_index, fp):
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2", "model.id": "another-model"})
    _publish(tmp_path, store, sqlite_index, avx2, {"inductor/k.so": b"avx2 code"})
    assert restore(store, sqlite_index, fp, tmp_path / "dst", fallback="toolchain").status == "miss"


def test_cli_yank_verify_and_partial(tmp_path):
    runner = CliRunner()
    write_tree(tmp_path / "src", {"inductor/a": b"a", "triton/t": b"t"})
    out = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m1", "--json"])
    bundle_id = json.loads(out.output)["bundle_id"]
    partial = runner.invoke(
        main, ["restore", "--into", str(tmp_path / "d"), "--model", "m2", "--fallback", "toolchain"]
    )
    assert partial.exit_code == 0 and "partial hit" in partial.output
    assert runner.invoke(main, ["verify", "--read-data"]).exit_code == 0
    yanked = runner.invoke(main, ["yank", bundle_id[:10], "--reason", "test"])
    assert yanked.exit_code == 0 and "yanked" in yanked.output
    miss = runner.invoke(main, ["restore", "--into", str(tmp_path / "e"), "--model", "m1", "--json"])
    assert json.loads(miss.output)["status"] == "miss"
    assert runner.invoke(main, ["yank", bundle_id[:10], "--undo"]).exit_code == 0
