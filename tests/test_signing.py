"""Signed manifests: a writer to the store without the signing key cannot get code restored."""

import json
import logging
import stat

import pytest
from click.testing import CliRunner
from trees import read_tree, write_tree

from kcache import fingerprint, signing, sources
from kcache import manifest as manifests
from kcache.cli import main
from kcache.errors import ConfigError, SignatureError
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.store import manifest_key


@pytest.fixture
def keys(tmp_path):
    made = {}
    for name in ("prod-a", "prod-b"):
        private, public = signing.generate(name, tmp_path / "keys")
        made[name] = (signing.load_signing_key(private), signing.load_trusted_keys([public])[0])
    return made


def _publish(tmp_path, store, index, fp, key=None):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"pickled graph", "inductor/ab/k.so": b"\x7fELF"})
    return publish(
        store, index, fp, sources.select(), root=tmp_path / "src", env={}, config=PublishConfig(signing_key=key)
    )


def test_keygen_writes_a_private_key_only_its_owner_reads(tmp_path):
    private, public = signing.generate("k1", tmp_path)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert public.read_text().startswith("kcache-ed25519 k1 ")
    with pytest.raises(ConfigError, match="exists"):
        signing.generate("k1", tmp_path)
    with pytest.raises(ConfigError):
        signing.generate("../evil", tmp_path)
    with pytest.raises(ConfigError, match="keygen"):
        signing.load_trusted_keys([private])  # a private key is not a public one


def test_signed_bundle_restores_and_names_its_signer(tmp_path, store, sqlite_index, fp, keys):
    _publish(tmp_path, store, sqlite_index, fp, keys["prod-a"][0])
    result = restore(store, sqlite_index, fp, tmp_path / "dst", trusted=(keys["prod-a"][1],), require_signature=True)
    assert (result.status, result.signed_by) == ("hit", "prod-a")


def test_rotation_trusts_either_key(tmp_path, store, sqlite_index, fp, keys):
    _publish(tmp_path, store, sqlite_index, fp, keys["prod-b"][0])
    trusted = (keys["prod-a"][1], keys["prod-b"][1])
    assert (
        restore(store, sqlite_index, fp, tmp_path / "dst", trusted=trusted, require_signature=True).signed_by
        == "prod-b"
    )


def test_unsigned_bundle_is_refused_when_required(tmp_path, store, sqlite_index, fp, keys, caplog):
    _publish(tmp_path, store, sqlite_index, fp)
    with pytest.raises(SignatureError, match="not signed by a trusted key"):
        restore(store, sqlite_index, fp, tmp_path / "dst", trusted=(keys["prod-a"][1],), require_signature=True)
    assert read_tree(tmp_path / "dst/inductor") == {}
    with caplog.at_level(logging.WARNING):
        relaxed = restore(store, sqlite_index, fp, tmp_path / "dst2", trusted=(keys["prod-a"][1],))
    assert relaxed.status == "hit" and relaxed.signed_by is None and "not signed" in caplog.text


def test_bundle_signed_by_an_untrusted_key_is_refused(tmp_path, store, sqlite_index, fp, keys):
    _publish(tmp_path, store, sqlite_index, fp, keys["prod-b"][0])
    with pytest.raises(SignatureError):
        restore(store, sqlite_index, fp, tmp_path / "dst", trusted=(keys["prod-a"][1],), require_signature=True)


def test_forged_signature_is_refused_even_when_not_required(tmp_path, store, sqlite_index, fp, keys):
    result = _publish(tmp_path, store, sqlite_index, fp)
    store.put_bytes(signing.signature_key(result.bundle_id, "prod-a"), b"AAAA" * 22)
    with pytest.raises(SignatureError, match="does not verify"):
        restore(store, sqlite_index, fp, tmp_path / "dst", trusted=(keys["prod-a"][1],))
    assert read_tree(tmp_path / "dst/inductor") == {}


def test_signature_cannot_be_replayed_for_another_manifest(tmp_path, store, sqlite_index, fp, keys):
    signed = _publish(tmp_path, store, sqlite_index, fp, keys["prod-a"][0])
    other_fp = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    original = manifests.parse(store.get_bytes(manifest_key(signed.bundle_id)), signed.bundle_id)
    evil = manifests.build(other_fp.bundle_key, other_fp.toolchain_key, other_fp.workload_key, other_fp.facts,
                           original.layers, original.entries)  # fmt: skip
    store.put_bytes(manifest_key(evil.id), evil.to_bytes())
    stolen = store.get_bytes(signing.signature_key(signed.bundle_id, "prod-a"))
    store.put_bytes(signing.signature_key(evil.id, "prod-a"), stolen)
    with pytest.raises(SignatureError, match="does not verify"):
        restore(store, sqlite_index, other_fp, tmp_path / "dst", trusted=(keys["prod-a"][1],), bundle_id=evil.id)


def test_require_without_trusted_keys_is_a_config_error(tmp_path, store, sqlite_index, fp):
    with pytest.raises(ConfigError, match="trusted-key"):
        restore(store, sqlite_index, fp, tmp_path / "dst", require_signature=True)


def test_cli_sign_and_verify(tmp_path, monkeypatch):
    monkeypatch.setenv("KCACHE_MODEL", "m")
    runner = CliRunner()
    out = runner.invoke(main, ["keygen", "ci", "--dir", str(tmp_path / "k")], catch_exceptions=False)
    assert out.exit_code == 0 and "ci.pub" in out.output
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    published = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--signing-key",
                                     str(tmp_path / "k/ci.key"), "--json"], catch_exceptions=False)  # fmt: skip
    assert published.exit_code == 0
    monkeypatch.setenv("KCACHE_TRUSTED_KEYS", str(tmp_path / "k/ci.pub"))
    restored = runner.invoke(main, ["restore", "--into", str(tmp_path / "dst"), "--require-signature", "--json"],
                             catch_exceptions=False)  # fmt: skip
    assert json.loads(restored.output)["signed_by"] == "ci"
    monkeypatch.delenv("KCACHE_TRUSTED_KEYS")
    refused = runner.invoke(main, ["restore", "--into", str(tmp_path / "dst2"), "--require-signature", "--strict"])
    assert refused.exit_code == 2 and "trusted-key" in refused.stderr
