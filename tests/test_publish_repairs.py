"""A re-publish repairs what a store writer or a race left wrong in the objects it commits on."""

import pytest
from trees import write_tree

from kcache import signing, sources
from kcache.errors import IntegrityError, SignatureError
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.store import manifest_key

LAYERS = sources.select()


def _signed(tmp_path):
    private, public = signing.generate("prod", tmp_path / "keys")
    return PublishConfig(signing_key=signing.load_signing_key(private)), signing.load_trusted_keys([public])


def test_a_republish_replaces_a_planted_signature(tmp_path, store, index, fp):
    config, trusted = _signed(tmp_path)
    write_tree(tmp_path / "src", {"inductor/k": b"kernel"})
    first = publish(store, index, fp, LAYERS, root=tmp_path / "src", env={}, config=config)
    planted = signing.signature_key(first.bundle_id, "prod")
    store.delete(planted)
    store.put_bytes(planted, b"AAAA")  # every pod requiring signatures now refuses the bundle
    with pytest.raises(SignatureError):
        restore(store, index, fp, tmp_path / "bad", trusted=trusted, require_signature=True)

    publish(store, index, fp, LAYERS, root=tmp_path / "src", env={}, config=config)
    pod = restore(store, index, fp, tmp_path / "dst", trusted=trusted, require_signature=True)
    assert (pod.status, pod.bundle_id, pod.signed_by) == ("hit", first.bundle_id, "prod"), pod.reason


def test_a_republish_replaces_a_manifest_copy_that_is_not_the_manifest(tmp_path, store, index, fp):
    write_tree(tmp_path / "src", {"inductor/k": b"kernel"})
    first = publish(store, index, fp, LAYERS, root=tmp_path / "src", env={})
    store.delete(manifest_key(first.bundle_id))
    store.put_bytes(manifest_key(first.bundle_id), b"{}")
    with pytest.raises(IntegrityError):
        restore(store, index, fp, tmp_path / "bad")

    publish(store, index, fp, LAYERS, root=tmp_path / "src", env={})
    pod = restore(store, index, fp, tmp_path / "dst")
    assert (pod.status, pod.bundle_id) == ("hit", first.bundle_id), pod.reason


class SweepsAfterSigning:
    """GC deletes an orphan manifest just after the publish that found it "already there" signed it."""

    def __init__(self, inner, manifest: str):
        self.inner, self.manifest, self.swept = inner, manifest, False

    def put_bytes(self, key, data):
        wrote = self.inner.put_bytes(key, data)
        if key.startswith("signatures/") and not self.swept:
            self.inner.delete(self.manifest)
            self.swept = True
        return wrote

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_signed_publish_on_a_swept_orphan_manifest_writes_it_again(tmp_path, store, index, fp):
    config, trusted = _signed(tmp_path)
    write_tree(tmp_path / "src", {"inductor/k": b"kernel"})
    unsigned = publish(store, index, fp, LAYERS, root=tmp_path / "src", env={})  # the manifest is there, unsigned
    key = manifest_key(unsigned.bundle_id)
    again = publish(SweepsAfterSigning(store, key), index, fp, LAYERS, root=tmp_path / "src", env={}, config=config)
    assert again.bundle_id == unsigned.bundle_id
    assert store.exists(key)
    pod = restore(store, index, fp, tmp_path / "dst", trusted=trusted, require_signature=True)
    assert (pod.status, pod.bundle_id) == ("hit", unsigned.bundle_id), pod.reason
