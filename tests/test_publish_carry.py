"""publish(carry_newest=True), what `kcache watch` publishes with: the key's newest bundle's files that
ROOT lacks are carried into the new bundle, so replicas keep each other's kernels; never a file
ROOT has (or one that clashes with it), and never a bundle the publisher's own key did not sign."""

from __future__ import annotations

import hashlib
import logging

from trees import write_tree

from kcache import manifest as manifests
from kcache import signing, sources
from kcache.publish import PublishConfig, publish
from kcache.store import manifest_key

LAYERS = sources.select()


def _paths(store, result) -> dict[str, bytes]:
    entries = manifests.parse(store.get_bytes(manifest_key(result.bundle_id)), result.bundle_id).entries
    return {e.path: e.blob for e in entries}


def _publish(tmp_path, store, index, fp, name, files, **config):
    write_tree(tmp_path / name, files)
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={}, config=PublishConfig(**config))


def test_files_root_has_win_and_a_clash_is_not_carried(tmp_path, store, sqlite_index, fp):
    _publish(tmp_path, store, sqlite_index, fp, "a", {
        "triton/kA/k.cubin": b"theirs", "triton/same/k.cubin": b"their version", "inductor/x/y": b"a file below x",
        "cuda/entry": b"their layer",
    })  # fmt: skip
    ours = _publish(tmp_path, store, sqlite_index, fp, "b", {
        "triton/kB/k.cubin": b"ours", "triton/same/k.cubin": b"our version", "inductor/x": b"x is a file here",
    }, carry_newest=True)  # fmt: skip
    paths = _paths(store, ours)
    assert set(paths) == {"triton/kA/k.cubin", "triton/kB/k.cubin", "triton/same/k.cubin", "inductor/x",
                          "cuda/entry"}  # fmt: skip
    assert "cuda" in ours.layers
    assert paths["triton/same/k.cubin"] == hashlib.sha256(b"our version").hexdigest()


def test_a_bundle_the_signing_key_did_not_sign_is_not_carried(tmp_path, store, sqlite_index, fp, caplog):
    private, _ = signing.generate("prod", tmp_path / "keys")
    key = signing.load_signing_key(private)
    _publish(tmp_path, store, sqlite_index, fp, "planted", {"triton/kX/k.cubin": b"not ours"})  # unsigned
    with caplog.at_level(logging.WARNING, logger="kcache.publish"):
        ours = _publish(tmp_path, store, sqlite_index, fp, "b", {"triton/kB/k.cubin": b"ours"}, carry_newest=True,
                        signing_key=key)  # fmt: skip
    assert set(_paths(store, ours)) == {"triton/kB/k.cubin"} and "not signed by 'prod'" in caplog.text
    again = _publish(tmp_path, store, sqlite_index, fp, "c", {"triton/kC/k.cubin": b"ours too"}, carry_newest=True,
                     signing_key=key)  # fmt: skip
    assert set(_paths(store, again)) == {"triton/kB/k.cubin", "triton/kC/k.cubin"}
