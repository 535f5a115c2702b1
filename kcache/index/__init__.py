"""The SQL index: the fast path to the store's content, rebuildable from the store."""

from kcache.index.repo import Index
from kcache.records import BlobLocation, Bundle, Event

__all__ = ["Index", "Bundle", "BlobLocation", "Event"]
