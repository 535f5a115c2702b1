"""The SQL index: the fast path to the store's content, rebuildable from the store."""

from kcache.index.repo import BlobLocation, Bundle, Event, Index

__all__ = ["Index", "Bundle", "BlobLocation", "Event"]
