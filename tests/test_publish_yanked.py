"""A re-publish of a yanked bundle's bytes stays yanked, whatever a store writer deletes.

gc deletes a yanked bundle's row, manifest and packs, and keeps its `yanks/<id>` marker so that
a warmup which compiles the same broken kernels again does not make them the newest bundle. A
store writer without the signing key can delete that marker, but not edit the key's signed ref,
whose `yanked` list still names the bundle: publish takes either as the yank's evidence, as
reindex does.
"""

from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

import pytest
from gc_helpers import LAYERS
from trees import write_tree

from kcache import gc, refs, signing
from kcache.errors import NotFound
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.store import ref_key
from kcache.yank import yank

POLICY = gc.Policy(keep_last=1, older_than=timedelta(days=7), grace=timedelta(hours=6))


@pytest.fixture
def key(tmp_path):
    private, public = signing.generate("prod", tmp_path / "keys")
    return signing.load_signing_key(private), signing.load_trusted_keys([public])[0]


def _publish(tmp_path, store, index, fp, content: bytes, name: str, signer):
    write_tree(tmp_path / name, {"inductor/kernel.so": content, "inductor/k.py": b"same"})
    for path in (tmp_path / name / "inductor").iterdir():  # mtimes are published: the same bytes, the same id
        os.utime(path, ns=(10**18, 10**18))
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={}, config=PublishConfig(signing_key=signer))


def _gc_deletes_yanked(store, index) -> None:
    """gc past --older-than and --grace: the yanked bundle's row and objects go, its marker stays."""
    later = datetime.now(timezone.utc) + timedelta(days=8)
    gc.execute(store, index, gc.plan(store, index, POLICY, now=later))
    gc.execute(store, index, gc.plan(store, index, POLICY, now=later + timedelta(hours=7)))


@pytest.mark.parametrize("marker", [True, False], ids=["marker-kept", "marker-deleted"])
def test_republish_of_a_yanked_bundle_gc_deleted_is_committed_yanked(tmp_path, store, sqlite_index, fp, key,
                                                                     marker):  # fmt: skip
    signer, trusted = key
    good = _publish(tmp_path, store, sqlite_index, fp, b"good kernel" * 100, "v1", signer)
    bad = _publish(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v2", signer)
    yank(store, sqlite_index, bad.bundle_id, "NaNs", signer=signer)
    _gc_deletes_yanked(store, sqlite_index)
    with pytest.raises(NotFound):
        sqlite_index.get_bundle(bad.bundle_id)
    assert store.exists(refs.yank_key(bad.bundle_id))
    ref = refs.read(store, fp.bundle_key)
    assert ref.manifest == good.bundle_id and bad.bundle_id in ref.yanked  # the signed evidence
    if not marker:
        store.delete(refs.yank_key(bad.bundle_id))  # a store writer without the key

    again = _publish(tmp_path, store, sqlite_index, fp, b"bad kernel" * 100, "v3", signer)

    assert again.bundle_id == bad.bundle_id and again.yanked
    assert sqlite_index.get_bundle(bad.bundle_id).status == "yanked"
    after = refs.read(store, fp.bundle_key)
    assert after.manifest == good.bundle_id and bad.bundle_id in after.yanked
    pod = restore(store, refs.RefCatalog(store), fp, tmp_path / "pod", trusted=(trusted,), require_signature=True)
    assert (pod.status, pod.bundle_id) == ("hit", good.bundle_id), pod.reason
    assert (restore(store, sqlite_index, fp, tmp_path / "dst").bundle_id) == good.bundle_id


def test_a_damaged_ref_does_not_stop_a_publish(tmp_path, store, sqlite_index, fp):
    """The ref is evidence of a yank only when it parses; one that does not is replaced as before."""
    store.put_bytes(ref_key(fp.bundle_key), b"not a ref")
    result = _publish(tmp_path, store, sqlite_index, fp, b"kernel" * 100, "v1", None)
    assert not result.yanked and sqlite_index.get_bundle(result.bundle_id).status == "active"
    assert refs.read(store, fp.bundle_key).manifest == result.bundle_id
