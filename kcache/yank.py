"""Yank: a bundle that broke pods is never restored again (and un-yank undoes it).

The index row's status stops index-based restores. For refs-based restores the ref is rewritten
from the index: it names the newest bundle still active and lists the yanked ones, signed when a
signing key is given, so deleting the `yanks/<bundle-id>` marker from the store does not un-yank
anything for a pod that requires signatures. The marker stays as a fail-safe hint for pods that
do not (and for `kcache reindex`, which rebuilds yank status from markers). Each layer ref
naming the bundle moves to the next bundle that gives its layer, or goes (kcache.layerkeys).

Un-yank makes the bundle restorable again (its key's newest, if it is), so it first checks that
the manifest and every pack it names are still in the store: one that is not would fail each
restore where the yank sent pods to the previous bundle (and, retained, hold every gc sweep).
Its layer refs move forward to the newest bundle giving their layer again, which may be it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kcache import fetch, layerkeys, refs
from kcache import manifest as manifests
from kcache.errors import ConfigError, IntegrityError, KcacheError, NotFound
from kcache.records import Bundle
from kcache.signing import SigningKey
from kcache.store import Store, pack_key

if TYPE_CHECKING:
    from kcache.index import Index


class BundleGone(NotFound):
    """The index has no such bundle, yet the store still holds its yank marker (gc deleted the
    bundle and kept the marker, or the index is behind the publishers')."""

    def __init__(self, name: str):
        self.what, self.name = "bundle", name
        KcacheError.__init__(self, f"no bundle {name!r} in the index, but the store still holds its yank marker")


def yank(store: Store, index: Index, bundle_id: str, reason: str = "", *, signer: SigningKey | None = None) -> Bundle:
    from kcache.index import lifecycle

    try:  # before anything changes: a reason the store cannot hold must not leave a half-done yank
        text = (reason or "yanked").encode()
    except UnicodeEncodeError:  # an argument holding bytes no encoding names (a lone surrogate)
        raise ConfigError("--reason", reason, "is not UTF-8 text") from None
    refs.default_ttl()  # and a bad KCACHE_REF_TTL, which the ref below is written with
    bundle = index.get_bundle(bundle_id)
    # The marker first: it alone stops the bundle for every pod (index or refs/). Written after the
    # row, a yank cut off between the two left the index saying yanked while pods restoring through
    # refs/ still took the bundle the ref names; now a yank cut off anywhere stops it or changed nothing.
    store.delete(refs.yank_key(bundle.id))  # a fresh reason replaces an old one
    store.put_bytes(refs.yank_key(bundle.id), text)
    bundle = lifecycle.set_status(index, bundle.id, "yanked")
    refs.refresh(store, index, bundle.bundle_key, signer=signer)
    layerkeys.move_off(store, index, bundle, signer=signer)
    return bundle


def unyank(store: Store, index: Index, bundle_id: str, *, signer: SigningKey | None = None) -> Bundle:
    from kcache.index import lifecycle

    try:
        bundle = index.get_bundle(bundle_id)
    except NotFound:
        if any(info.key.startswith(refs.yank_key(bundle_id)) for info in store.list("yanks/")):
            raise BundleGone(bundle_id) from None
        raise
    _check_restorable(store, bundle.id)
    refs.default_ttl()  # a bad KCACHE_REF_TTL must fail before the row changes, not at the ref after it
    bundle = lifecycle.set_status(index, bundle.id, "active")
    store.delete(refs.yank_key(bundle.id))
    refs.refresh(store, index, bundle.bundle_key, signer=signer)
    layerkeys.catch_up(store, index, bundle, signer=signer)
    return bundle


def _check_restorable(store: Store, bundle_id: str) -> None:
    """Raise unless the manifest verifies and every pack it names holds the bytes its entries
    reach (one HEAD each): a pack cut short fails every restore as surely as a missing one."""
    for pack, reach in sorted(fetch.pack_extents(manifests.fetch(store, bundle_id).entries).items()):
        size = store.size(pack_key(pack))  # ObjectMissing when it is gone
        if size < reach:
            raise IntegrityError("pack", pack_key(pack), f"is {size} bytes; the bundle's files reach byte {reach}")
