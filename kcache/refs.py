"""Refs: `refs/<bundle-key>` names the newest manifest of a bundle key, in the store itself.

    refs/<bundle-key>  ->  {"schema": 1, "bundle_key": ..., "manifest": <id>, "created_at": <iso UTC>}

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


def parse(data: bytes, bundle_key: str) -> Ref:
    try:
        doc = json.loads(data)
        ref = Ref(str(doc["bundle_key"]), str(doc["manifest"]), datetime.fromisoformat(doc["created_at"]))
    except (ValueError, KeyError, TypeError) as exc:
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


class RefCatalog:
    """The part of the index restore needs, answered from refs: for pods without SQL access."""

    def __init__(self, store: Store):
        self.store = store

    def newest_bundle(self, bundle_key: str) -> Ref | None:
        return read(self.store, bundle_key)

    def record_event(self, event) -> None:
        """Refs keep no statistics; a pod without the index has nowhere to record them."""

    def close(self) -> None:
        pass
