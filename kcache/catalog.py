"""Which catalog restore asks for the newest bundle: the SQL index or the store's refs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kcache.config import Settings
from kcache.refs import RefCatalog
from kcache.store import Store

if TYPE_CHECKING:
    from kcache.index import Index

NO_INDEX = "none"


def open_for_restore(settings: Settings, store: Store) -> Index | RefCatalog:
    """The index when one is named or the default exists; else refs, which need only bucket reads."""
    if settings.index_url == NO_INDEX:
        return RefCatalog(store)
    if settings.index_explicit or settings.default_index_path.exists():
        from kcache.index import Index  # SQLAlchemy costs ~0.3 s to import: only when needed

        return Index.open(settings.index_url)
    return RefCatalog(store)
