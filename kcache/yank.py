"""Yank: a bundle that broke pods is never restored again (and un-yank undoes it).

The index row's status stops index-based restores; a `yanks/<bundle-id>` object in the store stops
refs-based restores, and the bundle key's ref is moved to the newest bundle still active.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kcache import refs
from kcache.records import Bundle
from kcache.store import Store

if TYPE_CHECKING:
    from kcache.index import Index


def yank(store: Store, index: Index, bundle_id: str, reason: str = "") -> Bundle:
    from kcache.index import lifecycle

    bundle = lifecycle.set_status(index, bundle_id, "yanked")
    store.delete(refs.yank_key(bundle.id))  # a fresh reason replaces an old one
    store.put_bytes(refs.yank_key(bundle.id), (reason or "yanked").encode())
    newest = index.newest_bundle(bundle.bundle_key)
    replacement = refs.Ref(newest.bundle_key, newest.id, newest.created_at) if newest else None
    refs.repoint(store, bundle.bundle_key, bundle.id, replacement)
    return bundle


def unyank(store: Store, index: Index, bundle_id: str) -> Bundle:
    from kcache.index import lifecycle

    bundle = lifecycle.set_status(index, bundle_id, "active")
    store.delete(refs.yank_key(bundle.id))
    refs.advance(store, refs.Ref(bundle.bundle_key, bundle.id, bundle.created_at))
    return bundle
