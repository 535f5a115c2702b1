"""Which catalog restore asks for the newest bundle: the SQL index or the store's refs."""

from __future__ import annotations

from kcache.config import Settings
from kcache.index import Index
from kcache.refs import RefCatalog
from kcache.store import Store

NO_INDEX = "none"


def open_for_restore(settings: Settings, store: Store) -> Index | RefCatalog:
    """The index when one is named or the default exists; else refs, which need only bucket reads."""
    if settings.index_url == NO_INDEX:
        return RefCatalog(store)
    if settings.index_explicit or settings.default_index_path.exists():
        return Index.open(settings.index_url)
    return RefCatalog(store)
