"""Yank: a bundle that broke pods is never restored again (and un-yank undoes it).

The index row's status stops index-based restores. For refs-based restores the ref is rewritten
from the index: it names the newest bundle still active and lists the yanked ones, signed when a
signing key is given, so deleting the `yanks/<bundle-id>` marker from the store does not un-yank
anything for a pod that requires signatures. The marker stays as a fail-safe hint for pods that
do not (and for `kcache reindex`, which rebuilds yank status from markers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kcache import refs
from kcache.records import Bundle
from kcache.signing import SigningKey
from kcache.store import Store

if TYPE_CHECKING:
    from kcache.index import Index


def yank(store: Store, index: Index, bundle_id: str, reason: str = "", *, signer: SigningKey | None = None) -> Bundle:
    from kcache.index import lifecycle

    bundle = lifecycle.set_status(index, bundle_id, "yanked")
    store.delete(refs.yank_key(bundle.id))  # a fresh reason replaces an old one
    store.put_bytes(refs.yank_key(bundle.id), (reason or "yanked").encode())
    refs.refresh(store, index, bundle.bundle_key, signer=signer)
    return bundle


def unyank(store: Store, index: Index, bundle_id: str, *, signer: SigningKey | None = None) -> Bundle:
    from kcache.index import lifecycle

    bundle = lifecycle.set_status(index, bundle_id, "active")
    store.delete(refs.yank_key(bundle.id))
    refs.refresh(store, index, bundle.bundle_key, signer=signer)
    return bundle
