"""A hostile store cannot exhaust restore's memory: refs, signatures and manifests are read capped,
and a manifest's signature is checked before its bytes are fetched."""

from __future__ import annotations

import json
import tracemalloc
from datetime import datetime, timezone

import pytest
from click.testing import CliRunner
from faulty import CountingStore
from trees import write_tree

from kcache import canonical, fingerprint, limits, refs, signing, sources
from kcache import manifest as manifests
from kcache.cli import main
from kcache.errors import ConfigError, IntegrityError, ObjectTooLarge, SignatureError
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.store import manifest_key, ref_key
from kcache.store.local import LocalStore

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
BIG = "e" * 64


@pytest.fixture
def keys(tmp_path):
    private, public = signing.generate("prod", tmp_path / "keys")
    return signing.load_signing_key(private), signing.load_trusted_keys([public])[0]


def _sparse(path, size: int):
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: the test itself must not need the memory it checks for
    return path


def _huge_manifest_under_ref(store, fp, size: int, signer=None) -> None:
    store.put_file(manifest_key(BIG), _sparse(store.root.parent / "big.tmp", size))
    refs.advance(store, refs.Ref(fp.bundle_key, BIG, T0), signer=signer)


@pytest.mark.parametrize("require", [False, True])
def test_a_manifest_over_the_cap_is_refused_unread(tmp_path, store, fp, keys, monkeypatch, require):
    monkeypatch.setenv(limits.MANIFEST_ENV, str(1024 * 1024))
    _huge_manifest_under_ref(store, fp, 8 * 1024 * 1024, signer=keys[0] if require else None)
    counting = CountingStore(store)
    trusted = (keys[1],) if require else ()
    with pytest.raises(ObjectTooLarge, match="KCACHE_MAX_MANIFEST_BYTES|limit"):
        restore(counting, refs.RefCatalog(counting), fp, tmp_path / "dst", trusted=trusted, require_signature=require)
    assert counting.read.get("manifests", 0) == 0
    assert (tmp_path / "dst/kcache.env").exists()  # fail-open: the pod starts cold with an env file


def test_the_default_cap_refuses_a_200_mb_manifest(tmp_path, store, fp):
    _huge_manifest_under_ref(store, fp, 210 * 1024 * 1024)
    counting = CountingStore(store)
    with pytest.raises(ObjectTooLarge):
        restore(counting, refs.RefCatalog(counting), fp, tmp_path / "dst")
    assert counting.read.get("manifests", 0) == 0


def test_the_signature_is_checked_before_the_manifest_is_read(tmp_path, store, sqlite_index, fp, keys):
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})  # unsigned
    counting = CountingStore(store)
    with pytest.raises(SignatureError):
        restore(counting, sqlite_index, fp, tmp_path / "dst", trusted=(keys[1],), require_signature=True)
    assert counting.read.get("manifests", 0) == 0


def test_a_signed_manifest_is_read_once_and_only_its_signed_size(tmp_path, store, sqlite_index, fp, keys):
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    published = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={},
                        config=PublishConfig(signing_key=keys[0]))  # fmt: skip
    counting = CountingStore(store)
    result = restore(counting, sqlite_index, fp, tmp_path / "dst", trusted=(keys[1],), require_signature=True)
    assert result.status == "hit"
    assert counting.read["manifests"] == store.size(manifest_key(published.bundle_id))


def test_huge_ref_and_signature_objects_are_refused_unread(tmp_path, store, fp, keys):
    big = _sparse(tmp_path / "big.tmp", limits.REF_BYTES + 1)
    store.put_file(ref_key(fp.bundle_key), big)
    counting = CountingStore(store)
    with pytest.raises(ObjectTooLarge):
        refs.RefCatalog(counting).newest_bundle(fp.bundle_key)
    store.put_file(signing.signature_key(BIG, "prod"), big)
    with pytest.raises(ObjectTooLarge):
        signing.verify(counting, (keys[1],), fp.bundle_key, BIG, 10)
    assert counting.read == {}
    private, _public = keys
    refs.advance(counting, refs.Ref(fp.bundle_key, BIG, T0), signer=private)  # a writer replaces it unread
    assert counting.read == {} and refs.read(store, fp.bundle_key).manifest == BIG


def test_the_cap_is_configurable_and_checked():
    assert limits.max_manifest_bytes({}) == 32 * 1024 * 1024  # what the restore bound allows (test_restore_memory)
    assert limits.max_manifest_bytes({limits.MANIFEST_ENV: "1000"}) == 1000
    for bad in ("-1", "0", "lots", "\u00b2", "9" * 4400):  # "²".isdigit(), and int() stops at 4300 digits
        with pytest.raises(ConfigError):
            limits.max_manifest_bytes({limits.MANIFEST_ENV: bad})


def test_cli_starts_cold_on_a_huge_manifest(tmp_path, monkeypatch):
    store = LocalStore(tmp_path / "bucket")
    args = ["--store", f"file://{store.root}", "--index", "none", "--model", "m1"]
    runner = CliRunner()
    facts = runner.invoke(main, ["fingerprint", "--json", "--model", "m1"], catch_exceptions=False)
    fp = fingerprint.compute(json.loads(facts.output)["facts"])
    _huge_manifest_under_ref(store, fp, 70 * 1024 * 1024)
    cold = runner.invoke(main, ["restore", "--into", str(tmp_path / "dst"), *args], catch_exceptions=False)
    assert cold.exit_code == 0 and "limit" in cold.stderr and (tmp_path / "dst/kcache.env").exists()
    strict = runner.invoke(main, ["restore", "--into", str(tmp_path / "dst"), "--strict", *args])
    assert strict.exit_code == 6 and "KCACHE_MAX_MANIFEST_BYTES" in strict.stderr


@pytest.mark.parametrize("planted", ["ref", "signature"])
def test_a_planted_ref_or_signature_over_its_cap_is_not_blamed_on_the_manifest_cap(tmp_path, keys, planted):
    """Refs and signatures have fixed caps; the hint of an oversized one told the operator to raise
    KCACHE_MAX_MANIFEST_BYTES, which changes nothing for them (and a planted object is no publisher's)."""
    store = LocalStore(tmp_path / "bucket")
    runner = CliRunner()
    facts = runner.invoke(main, ["fingerprint", "--json", "--model", "m1"], catch_exceptions=False)
    fp = fingerprint.compute(json.loads(facts.output)["facts"])
    private, _public = keys
    _huge_manifest_under_ref(store, fp, 100, signer=private)
    key = ref_key(fp.bundle_key) if planted == "ref" else signing.signature_key(BIG, "prod")
    store.delete(key)
    store.put_file(key, _sparse(tmp_path / "big.tmp", limits.REF_BYTES + 1))
    args = ["--store", f"file://{store.root}", "--index", "none", "--model", "m1", "--strict", "--json",
            "--trusted-key", str(tmp_path / "keys" / "prod.pub")]
    out = runner.invoke(main, ["restore", "--into", str(tmp_path / "dst"), *args])
    assert out.exit_code == 6, out.output
    answer = json.loads(out.stdout)
    assert "refused unread" in answer["error"] and "KCACHE_MAX_MANIFEST_BYTES" not in answer["hint"], answer


def _manifest_bytes(**fields) -> bytes:
    doc = {"schema": 3, "bundle_key": "a" * 32, "toolchain_key": "t", "workload_key": "w", "facts": {},
           "layers": ["cuda"], "layer_info": {}, "chunks": {}, "entries": []}  # fmt: skip
    return canonical.dumps({**doc, **fields})


MiB = 1024 * 1024
# What json.loads makes of a few bytes, at its most: ~64 bytes of Python for `[],` or `{}`, ~59 for a
# two-character string, ~40 for a four-digit number, ~150 for a fact.
TINY_VALUES = {
    "empty-lists": lambda n: _manifest_bytes(entries=[[]] * (n // 3)),
    "tiny-strings": lambda n: _manifest_bytes(entries=[["ab"] * (n // 5)]),
    "small-numbers": lambda n: _manifest_bytes(entries=[[1000] * (n // 5)]),
    "facts": lambda n: _manifest_bytes(facts={f"f{i:08d}": "" for i in range(n // 15)}),
    "layer-info": lambda n: _manifest_bytes(layer_info={f"l{i:07d}": {} for i in range(n // 14)}),
}


@pytest.mark.parametrize("shape", TINY_VALUES)
def test_a_manifest_of_tiny_json_values_is_refused_before_it_is_parsed(shape):
    """json.loads makes 8-26 times a manifest's bytes of such values (at the 32 MiB cap: 720 MiB of
    empty lists, 720 MiB of layer_info, 410 MiB of facts), before any row is checked. Their number
    is counted in the bytes first, as a pack trailer's entries are."""
    data = TINY_VALUES[shape](4 * MiB)
    manifest_id = canonical.sha256(data)
    tracemalloc.start()
    try:
        with pytest.raises(IntegrityError, match="more JSON values than"):
            manifests.parse(data, manifest_id)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MiB  # refused before json.loads made anything of it


def test_a_manifest_of_the_smallest_rows_still_parses():
    """The rows with the fewest bytes a value (a six-character path, sizes and times of one digit)."""
    rows = [[f"cuda/{i:05x}", 420, 1, "0" * 64, "1" * 64, 0, 1, 0] for i in range(20_000)]
    data = _manifest_bytes(entries=rows)
    assert len(manifests.parse(data, canonical.sha256(data)).entries) == 20_000
