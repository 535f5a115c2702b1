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
    """The index when one is named or the default exists; else refs, which need only bucket reads.

    kcache.binding decides: an index is used only for the store it describes, and keys it has
    never seen fall back to refs/.
    """
    from kcache import binding

    return binding.open_for_restore(settings, store)
