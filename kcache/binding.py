"""Which store an index describes, and opening an index only for the store it describes.

    <store>/kcache-store.json   {"schema": 1, "store_id": <32 hex>}, written once (create-if-absent)
    index: store_binding        slot 1 -> that store id, and the URL it was first bound under

An index is a cache of one store: "blob X exists" is true of that store only. Used with another
store, publish would skip uploads the new store never got and restore would miss what its refs
name. So the first writer that opens an index with a store binds the two; from then on the index
is refused for any other store (StoreMismatch). The id lives in the store, not in its URL,
because URLs alias (endpoints, prefixes with a trailing slash, file:// through a link).

Read-only commands never create an index file: with no index file they read an empty index in
memory, so `kcache ls` on a fresh KCACHE_HOME cannot turn a later refs/ restore into a miss.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from kcache import canonical, limits
from kcache.catalog import NO_INDEX
from kcache.config import Settings
from kcache.errors import ConfigError, IndexDbError, IntegrityError, StoreMismatch
from kcache.refs import RefCatalog
from kcache.store import Store

if TYPE_CHECKING:
    from kcache.index import Index

log = logging.getLogger(__name__)

STORE_ID_KEY = "kcache-store.json"
_ID = re.compile(r"[0-9a-f]{32}\Z")
_SQLITE_FILE = re.compile(r"sqlite(\+\w+)?:///")  # SQLAlchemy's sqlite:/// and sqlite+<driver>:/// (a file)
NEEDS_INDEX = "this command needs an index; only `kcache restore` works from refs/"
_STORE_ID_BYTES = 4096  # {"schema": 1, "store_id": <32 hex>} is 50 bytes


def read_store_id(store: Store) -> str | None:
    """The store's id, or None when no kcache writer has named it yet."""
    data = limits.read_capped(store, STORE_ID_KEY, _STORE_ID_BYTES, "store id")
    if data is None:
        return None
    try:
        store_id = json.loads(data)["store_id"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: 4 KiB of `[`
        raise IntegrityError("store id", STORE_ID_KEY, f"does not parse: {type(exc).__name__}") from None
    if not isinstance(store_id, str) or not _ID.match(store_id):
        raise IntegrityError("store id", STORE_ID_KEY, "is not 32 hex digits")
    return store_id


def ensure_store_id(store: Store) -> str:
    """The store's id, naming the store first if nobody has (a racing writer's name wins)."""
    existing = read_store_id(store)
    if existing is not None:
        return existing
    store.put_bytes(STORE_ID_KEY, canonical.dumps({"schema": 1, "store_id": uuid.uuid4().hex}))
    return read_store_id(store) or ""


def check(index: Index, store: Store, *, write: bool) -> None:
    """Refuse an index bound to another store; a writer binds an unbound index to this one.

    A reader leaves an unbound index unbound (an index from before bindings, or never written),
    and reads the store's id only when there is a binding to compare it with: a pod with a
    read-only role may not even learn that the id object is absent (S3 answers 403 then).
    """
    bound = index.bound_store()
    if bound is None and not write:
        return
    store_id = ensure_store_id(store) if write else read_store_id(store)
    if bound is None:
        bound = index.bind_store(store_id, store.url)
    if bound[0] != store_id:
        raise StoreMismatch(index.url, bound[1], store.url)


def sqlite_path(url: str) -> str | None:
    """The file a SQLite URL names, or None for another database (or SQLite in memory)."""
    scheme = _SQLITE_FILE.match(url)
    if scheme is None:
        return None
    path = url[scheme.end():].split("?", 1)[0]
    return path if path and path != ":memory:" else None


def missing_sqlite_file(url: str) -> bool:
    """True for a SQLite URL whose file does not exist (opening it would create it)."""
    path = sqlite_path(url)
    try:
        return path is not None and not Path(path).expanduser().exists()
    except (OSError, RuntimeError):  # ENAMETOOLONG; ~user unknown: opening it says so as an index error
        return False


def require_index(settings: Settings) -> None:
    """Refuse --index none (KCACHE_INDEX=none) in a command that needs an index: every one but restore."""
    if settings.index_url == NO_INDEX:
        raise ConfigError(settings.named_by("index", "--index"), settings.index_url, NEEDS_INDEX)


def open_index(settings: Settings, store: Store | None, *, write: bool, create: bool | None = None) -> Index:
    """The index for `store`: bound to it when `write`; an empty in-memory one for a reader
    when the default SQLite file does not exist. A reader that never touches the store (ls, stats)
    passes None and skips the check.

    A SQLite file named by --index or KCACHE_INDEX that does not exist is created only when
    `create` (default: `write`; publishers and reindex); for any other command it is an
    IndexDbError, as a named file:// store that does not exist is a StoreError: a typo must not
    read as an empty index (`verify` finding no problems, `ls` no bundles)."""
    from kcache.index import Index

    require_index(settings)
    create = write if create is None else create
    missing = missing_sqlite_file(settings.index_url)
    if missing and settings.index_explicit and not create:
        raise IndexDbError(settings.index_url, f"{sqlite_path(settings.index_url)} does not exist (only publish, "
                                               "reindex and db upgrade create an index file)")  # fmt: skip
    empty = not write and missing
    index = Index.in_memory(settings.index_url) if empty else Index.open(settings.index_url)
    if store is None:
        return index
    try:
        check(index, store, write=write)
    except BaseException:
        index.close()
        raise
    return index


class FallbackCatalog:
    """Restore's catalog: the index first, then refs/ for keys the index has never seen.

    A key the index knows (even only yanked bundles) is answered by the index alone: its yanks
    and its order win. A key it has never seen may still have a ref, written by a publisher that
    used another index or none.
    """

    def __init__(self, index: Index, refs: RefCatalog):
        self.index, self.refs = index, refs

    def get_bundle(self, bundle_id: str):
        """A pinned bundle is the index's to describe (its yank status included)."""
        return self.index.get_bundle(bundle_id)

    def was_yanked(self, bundle_id: str) -> bool:
        return self.index.was_yanked(bundle_id)

    def newest_bundle(self, bundle_key: str):
        found = self.index.newest_bundle(bundle_key)
        if found is None and not self.index.knows_key(bundle_key):
            return self.refs.newest_bundle(bundle_key)
        return found

    def newest_for_toolchain(self, toolchain_key: str):
        return self.index.newest_for_toolchain(toolchain_key)

    def record_event(self, event) -> None:
        self.index.record_event(event)

    def close(self) -> None:
        self.index.close()


def open_for_restore(settings: Settings, store: Store) -> Index | FallbackCatalog | RefCatalog:
    """The index when one is named or the default exists (falling back to refs/ per key); else refs.

    The default index bound to another store, or one that cannot be opened, is skipped with a
    warning (it was only a guess); a named one is an error.
    """
    refs = RefCatalog(store)
    if settings.index_url == NO_INDEX:
        return refs
    if not settings.index_explicit and not settings.default_index_path.exists():
        return refs
    if missing_sqlite_file(settings.index_url):
        return refs  # restore never creates an index file
    try:
        index = open_index(settings, store, write=False)
    except (StoreMismatch, IndexDbError) as exc:  # one that cannot be opened: a read-only KCACHE_HOME
        if settings.index_explicit:
            raise
        log.warning("not using the default index: %s; restoring through refs/", exc)
        return refs
    return FallbackCatalog(index, refs)
