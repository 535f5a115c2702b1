"""Operator commands: yank (and undo), verify, and restore --fallback toolchain."""

import base64
import json
import os

import pytest
from click.testing import CliRunner
from trees import read_tree, write_tree

from kcache import fingerprint, refs, signing, sources
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.errors import IntegrityError, KcacheError, ObjectMissing, SignatureError
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.store import pack_key
from kcache.verify import in_subset, parse_subset, verify
from kcache.yank import unyank, yank

LAYERS = sources.select()
WELL_FORMED = base64.b64encode(bytes(64))  # looks like an Ed25519 signature; no key made it


def _publish(tmp_path, store, index, fp, files, name="src", key=None):
    write_tree(tmp_path / name, files)
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={}, config=PublishConfig(signing_key=key))


def _plant(store, key: str, data: bytes) -> None:
    """What a writer to the bucket can do: put any bytes under any key, an existing one included."""
    path = store.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        os.chmod(path, 0o644)
    path.write_bytes(data)


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


def test_verify_finds_a_pack_moved_away_from_its_key(tmp_path, store, sqlite_index, fp):
    """A same-named file elsewhere under packs/ is not the pack: restore reads packs/<hh>/<id> only."""
    _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": os.urandom(2000)})
    (pack,) = store.list("packs/")
    pack_id = pack.key.rsplit("/", 1)[-1]
    assert pack.key == pack_key(pack_id)
    moved = store.root / "packs" / "zz" / pack_id
    moved.parent.mkdir()
    (store.root / pack.key).rename(moved)
    found = verify(store, sqlite_index)
    assert len(found.problems) == 1 and f"pack {pack_id[:12]} is missing" in found.problems[0]
    with pytest.raises(ObjectMissing, match=pack_key(pack_id)):  # what verify warned of
        restore(store, sqlite_index, fp, tmp_path / "r")


@pytest.fixture
def keys(tmp_path):
    made = {}
    for name in ("k1", "k2"):
        private, public = signing.generate(name, tmp_path / "keys")
        made[name] = (signing.load_signing_key(private), signing.load_trusted_keys([public])[0])
    return made


@pytest.mark.parametrize("planted", [b"AAAA", b"AAAA" * 22, b"\xff\x00 not base64", WELL_FORMED])
def test_verify_finds_a_planted_signature_with_or_without_trusted_keys(tmp_path, store, sqlite_index, fp, keys,
                                                                       planted):  # fmt: skip
    signed = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"}, key=keys["k1"][0])
    assert verify(store, sqlite_index).problems == ()
    assert verify(store, sqlite_index, trusted=(keys["k1"][1],)).problems == ()
    _plant(store, signing.signature_key(signed.bundle_id, "k1"), planted)
    with pytest.raises(SignatureError, match="signature by 'k1' does not verify"):  # what verify must warn of
        restore(store, sqlite_index, fp, tmp_path / "r", trusted=(keys["k1"][1],))
    (problem,) = verify(store, sqlite_index, trusted=(keys["k1"][1],)).problems
    assert signed.bundle_id[:12] in problem and "signature by 'k1' does not verify" in problem
    # Without the public key, a signature is checked as far as it can be: 64 bytes in base64.
    untrusted = verify(store, sqlite_index).problems
    if planted == WELL_FORMED:  # only the public key tells
        assert untrusted == ()
    else:
        (problem,) = untrusted
        assert signed.bundle_id[:12] in problem and "signature by 'k1' is no Ed25519 signature" in problem


def test_verify_with_trusted_keys_finds_a_signature_replayed_from_another_bundle(tmp_path, store, sqlite_index,
                                                                                 fp, keys):  # fmt: skip
    one = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"}, "v1", key=keys["k1"][0])
    two = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"b"}, "v2", key=keys["k1"][0])
    _plant(store, signing.signature_key(two.bundle_id, "k1"),
           store.get_bytes(signing.signature_key(one.bundle_id, "k1")))  # fmt: skip
    assert verify(store, sqlite_index).problems == ()  # a well-formed signature: only the public key tells
    (problem,) = verify(store, sqlite_index, trusted=(keys["k1"][1],)).problems
    assert two.bundle_id[:12] in problem and "does not verify" in problem


def test_verify_with_trusted_keys_reports_bundles_no_trusted_key_signed(tmp_path, store, sqlite_index, fp, keys):
    unsigned = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"}, "v1")
    by_k2 = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"b"}, "v2", key=keys["k2"][0])
    by_k1 = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"c"}, "v3", key=keys["k1"][0])
    assert verify(store, sqlite_index).problems == ()  # signatures are optional without trusted keys
    problems = verify(store, sqlite_index, trusted=(keys["k1"][1],)).problems
    assert len(problems) == 2 and all("not signed by a trusted key" in p for p in problems)
    unsigned_ones = {f"bundle {unsigned.bundle_id[:12]}", f"bundle {by_k2.bundle_id[:12]}"}
    assert {p.split(":")[0] for p in problems} == unsigned_ones
    # Key rotation: a bundle signed by any one trusted key is signed.
    rotated = verify(store, sqlite_index, trusted=(keys["k1"][1], keys["k2"][1])).problems
    assert len(rotated) == 1 and unsigned.bundle_id[:12] in rotated[0] and by_k1.bundle_id[:12] not in rotated[0]


def test_verify_reports_a_signature_over_the_size_cap(tmp_path, store, sqlite_index, fp, keys):
    signed = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"a"}, key=keys["k1"][0])
    _plant(store, signing.signature_key(signed.bundle_id, "k1"), b"A" * 100_000)
    for trusted in ((), (keys["k1"][1],)):
        (problem,) = verify(store, sqlite_index, trusted=trusted).problems
        assert signed.bundle_id[:12] in problem and "limit" in problem


def test_cli_verify_checks_signatures_with_trusted_keys_from_flags_or_the_environment(tmp_path, monkeypatch,
                                                                                       isolated_home):  # fmt: skip
    monkeypatch.delenv("KCACHE_TRUSTED_KEYS", raising=False)
    runner = CliRunner()
    for name in ("k1", "k2"):
        assert runner.invoke(main, ["keygen", name, "--dir", str(tmp_path / "k")]).exit_code == 0
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    out = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m1", "--json",
                               "--signing-key", str(tmp_path / "k/k1.key")])  # fmt: skip
    bundle_id = json.loads(out.output)["bundle_id"]
    pub = str(tmp_path / "k/k1.pub")
    assert runner.invoke(main, ["verify", "--trusted-key", pub]).exit_code == 0
    (sig,) = isolated_home.rglob(f"signatures/{bundle_id}/k1")
    os.chmod(sig, 0o644)
    sig.write_bytes(WELL_FORMED)  # only the public key tells it is bad
    assert runner.invoke(main, ["verify"]).exit_code == 0
    flagged = runner.invoke(main, ["verify", "--trusted-key", pub])
    assert flagged.exit_code == ExitCode.PROBLEMS and "signature by 'k1' does not verify" in flagged.output
    monkeypatch.setenv("KCACHE_TRUSTED_KEYS", f"{tmp_path}/k/k2.pub:{pub}")  # as restore reads it
    from_env = runner.invoke(main, ["verify", "--json"])
    assert from_env.exit_code == ExitCode.PROBLEMS
    assert any("signature by 'k1' does not verify" in p for p in json.loads(from_env.stdout)["problems"])


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


def test_a_yank_cut_short_changes_nothing_or_stops_every_pod(tmp_path, store, sqlite_index, fp):
    """A yank that fails part-way (its marker refused by the store; a yank killed at that step) must not
    leave the index saying yanked while pods restoring through refs/ still take the bundle, which the
    ref names and no marker stops: the marker goes first, and it alone stops the bundle everywhere."""
    old = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"good"}, "v1")
    bad = _publish(tmp_path, store, sqlite_index, fp, {"inductor/a": b"broken"}, "v2")
    (store.root / "yanks").write_bytes(b"")  # a file where the markers' directory goes: every marker fails
    with pytest.raises(KcacheError):
        yank(store, sqlite_index, bad.bundle_id, "NaNs")
    through_refs = restore(store, refs.RefCatalog(store), fp, tmp_path / "r1").bundle_id
    assert (sqlite_index.get_bundle(bad.bundle_id).status, through_refs) == ("active", bad.bundle_id)
    (store.root / "yanks").unlink()
    yank(store, sqlite_index, bad.bundle_id, "NaNs")  # run again, it completes
    assert restore(store, refs.RefCatalog(store), fp, tmp_path / "r2").bundle_id == old.bundle_id
    assert restore(store, sqlite_index, fp, tmp_path / "r3").bundle_id == old.bundle_id
