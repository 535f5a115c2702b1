"""Refs: `refs/<bundle-key>` names the newest manifest of a bundle key, in the store itself.

    refs/<bundle-key>  ->  {"schema": 1, "bundle_key": ..., "manifest": <id>, "created_at": <iso UTC>}
    yanks/<bundle-id>  ->  why the bundle was yanked (present = never restore it)

A pod that may read the bucket but not the SQL index restores through its ref. Publishers move
a ref forward with compare-and-swap, and only forward: a slow publisher whose bundle is older
than the ref's never overwrites it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime

from kcache import canonical
from kcache.errors import IntegrityError
from kcache.store import Store, ref_key

log = logging.getLogger(__name__)
_CAS_ATTEMPTS = 20


@dataclass(frozen=True)
class Ref:
    bundle_key: str
    manifest: str
    created_at: datetime

    @property
    def id(self) -> str:
        """The bundle id (= manifest id), as the index's Bundle names it."""
        return self.manifest

    def to_bytes(self) -> bytes:
        return canonical.dumps({"schema": 1, "bundle_key": self.bundle_key, "manifest": self.manifest,
                                "created_at": self.created_at.isoformat()})  # fmt: skip


def yank_key(bundle_id: str) -> str:
    """Marker object of a yanked bundle, so pods that restore through refs see the yank too."""
    return f"yanks/{bundle_id}"


def parse(data: bytes, bundle_key: str) -> Ref:
    try:
        doc = json.loads(data)
        ref = Ref(str(doc["bundle_key"]), str(doc["manifest"]), datetime.fromisoformat(doc["created_at"]))
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: hostile nesting
        raise IntegrityError("ref", bundle_key, f"does not parse: {exc}") from None
    if ref.bundle_key != bundle_key:
        raise IntegrityError("ref", bundle_key, f"names bundle key {ref.bundle_key}")
    return ref


def read(store: Store, bundle_key: str) -> Ref | None:
    current = store.get_versioned(ref_key(bundle_key))
    return parse(current[0], bundle_key) if current else None


def advance(store: Store, ref: Ref) -> bool:
    """Point the ref at `ref.manifest` unless it already names a newer bundle. True if it moved."""
    key = ref_key(ref.bundle_key)
    for _ in range(_CAS_ATTEMPTS):
        current = store.get_versioned(key)
        if current is not None:
            existing = parse(current[0], ref.bundle_key)
            if (existing.created_at, existing.manifest) >= (ref.created_at, ref.manifest):
                return False
        if store.put_if(key, ref.to_bytes(), current[1] if current else None):
            return True
    log.warning("gave up moving %s after %d contended attempts", key, _CAS_ATTEMPTS)
    return False


def repoint(store: Store, bundle_key: str, away_from: str, to: Ref | None) -> bool:
    """Move a ref that names `away_from` (yanked or deleted) to `to`, or remove it when `to` is None.

    Unlike `advance` this may move backwards in time; it only acts while the ref still names
    `away_from`, so a publish that moved it meanwhile wins.
    """
    key = ref_key(bundle_key)
    for _ in range(_CAS_ATTEMPTS):
        current = store.get_versioned(key)
        if current is None or parse(current[0], bundle_key).manifest != away_from:
            return False
        if to is None:
            store.delete(key)
            return True
        if store.put_if(key, to.to_bytes(), current[1]):
            return True
    return False


class RefCatalog:
    """The part of the index restore needs, answered from refs: for pods without SQL access."""

    def __init__(self, store: Store):
        self.store = store

    def newest_bundle(self, bundle_key: str) -> Ref | None:
        """The ref's bundle; restore itself checks the yank marker, whichever catalog answered."""
        return read(self.store, bundle_key)

    def newest_for_toolchain(self, toolchain_key: str) -> None:
        """Refs are per bundle key: a pod without the index cannot look for a partial hit."""
        return None

    def record_event(self, event) -> None:
        """Refs keep no statistics; a pod without the index has nowhere to record them."""

    def close(self) -> None:
        pass
