"""publish(carry_newest=True), what `kcache watch` publishes with: the key's newest bundle's files that
ROOT lacks are carried into the new bundle, so replicas keep each other's kernels; never a file
ROOT has (or one that clashes with it), and never a bundle the publisher's own key did not sign."""

from __future__ import annotations

import hashlib
import logging

import pytest
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


@pytest.mark.parametrize("how", ["marker", "yanked-while-uploading"])
def test_a_yanked_bundles_files_are_not_carried(tmp_path, store, sqlite_index, fp, monkeypatch, how):
    """The newest bundle is yanked (a marker in the store, which restore obeys whatever the index
    says, or a yank that lands while this publish uploads): carried, its bad kernel came back in a
    new active bundle that no replica had compiled."""
    from kcache import publish as publishing
    from kcache import refs
    from kcache.yank import yank

    _publish(tmp_path, store, sqlite_index, fp, "a", {"triton/good/k.cubin": b"good"})
    bad = _publish(tmp_path, store, sqlite_index, fp, "b", {"triton/good/k.cubin": b"good",
                                                            "triton/BAD/k.cubin": b"NaNs"})  # fmt: skip
    if how == "marker":
        assert store.put_bytes(refs.yank_key(bad.bundle_id), b"NaNs")
    else:
        real = publishing._upload_until_revived

        def yank_meanwhile(*args, **kwargs):
            yank(store, sqlite_index, bad.bundle_id, "NaNs")
            return real(*args, **kwargs)

        monkeypatch.setattr(publishing, "_upload_until_revived", yank_meanwhile)
    files = {"triton/good/k.cubin": b"good", "triton/mine/k.cubin": b"mine"}
    ours = _publish(tmp_path, store, sqlite_index, fp, "c", files, carry_newest=True)
    assert set(_paths(store, ours)) == {"triton/good/k.cubin", "triton/mine/k.cubin"}


def test_junk_in_the_newest_bundle_is_not_carried(tmp_path, store, sqlite_index, fp, monkeypatch):
    """What publish would not take from ROOT (a junk name, such as torch's Triton temp directories,
    junk since a newer kcache) it must not take from another bundle either, or it never goes away."""
    from kcache.sources.base import COMMON_JUNK
    from kcache.sources.triton import TritonSource

    monkeypatch.setattr(TritonSource, "junk", COMMON_JUNK + ("tmp.pid_*",))  # an older kcache's publish
    _publish(tmp_path, store, sqlite_index, fp, "a", {"triton/tmp.0b7c0f7e-1b2c-4d5e-9f00-123456789abc/k.cubin": b"x",
                                                      "triton/kA/k.cubin": b"a"})  # fmt: skip
    monkeypatch.undo()
    ours = _publish(tmp_path, store, sqlite_index, fp, "b", {"triton/kB/k.cubin": b"b"}, carry_newest=True)
    assert set(_paths(store, ours)) == {"triton/kA/k.cubin", "triton/kB/k.cubin"}


def test_extra_layers_are_not_carried(tmp_path, store, sqlite_index, fp):
    """Extra directories are named by each pod (`a-b` here, `a_b` there, one export name): carried,
    two of them made every later watch of the restored ROOT fail."""
    from kcache.sources.extra import ExtraSource

    write_tree(tmp_path / "a", {"extra/a-b/f": b"theirs", "triton/kA/k.cubin": b"a"})
    publish(store, sqlite_index, fp, [*LAYERS, ExtraSource("a-b")], root=tmp_path / "a", env={})
    write_tree(tmp_path / "b", {"extra/a_b/f": b"ours", "triton/kB/k.cubin": b"b"})
    ours = publish(store, sqlite_index, fp, [*LAYERS, ExtraSource("a_b")], root=tmp_path / "b", env={},
                   config=PublishConfig(carry_newest=True))  # fmt: skip
    assert "extra:a-b" not in ours.layers and set(_paths(store, ours)) == {
        "extra/a_b/f", "triton/kA/k.cubin", "triton/kB/k.cubin"}
