"""The index's queries. Returns plain frozen dataclasses, never ORM rows.

Writes are idempotent (insert-or-ignore on content ids), so any number of publishers can race:
the first row for a blob wins, and every row points at a pack that was stored before the row was.
Every write takes its row locks in one canonical order (ascending id), so two writers holding the
same contents under differently sorted paths never lock in opposite orders; a transaction that
PostgreSQL still aborts (deadlock 40P01, serialization failure 40001) is run again, a few times.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import TypeVar

from sqlalchemy import Engine, String, and_, any_, delete, func, insert, literal, select, update
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.orm import Session

from kcache.errors import ConfigError, IndexConflict, IndexDbError, NewestChanged, NotFound
from kcache.index.db import describe_error, ensure_schema, make_engine
from kcache.index.models import (
    MAX_MODEL_ID,
    BlobRow,
    BundleRow,
    EventRow,
    PackRow,
    PublishLeaseRow,
    StoreBindingRow,
    YankRow,
)
from kcache.records import BlobLocation, Bundle, Event
from kcache.untrusted import one_line

log = logging.getLogger(__name__)
T = TypeVar("T")
_IN_CHUNK = 500  # bound on bind parameters per IN (...) query
# Prefixes reach LIKE: only hex digits, so no wildcard can widen them ("%%%%%%" once yanked a bundle).
_HEX_ID_PREFIX = re.compile(r"[0-9a-f]{6,64}\Z")
_HEX_KEY_PREFIX = re.compile(r"[0-9a-f]{1,32}\Z")
_RETRY_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock detected
_ATTEMPTS = 5
_BACKOFF = 0.05  # seconds; doubled per attempt, jittered so the losers do not collide again
ANY = object()  # add_bundle's if_newest: commit whatever the key's newest bundle is


def transient(exc: BaseException) -> bool:
    """True for an error that says "run the same transaction again": a deadlock or serialization failure."""
    return getattr(getattr(exc, "orig", None), "sqlstate", None) in _RETRY_SQLSTATES


def _now() -> datetime:
    return datetime.now(timezone.utc)


# The most bytes of facts or layers restore loads from one row: a real row holds a few KiB. An
# index writer's row of gigabytes would otherwise take the init container's memory (json.loads
# holds ~16 times the text).
MAX_ROW_TEXT = 1024 * 1024
# Every other text a lookup loads (ids, keys, model, created_by, the store binding): the index is
# written by whoever can write it, and SQLite enforces no VARCHAR length.
MAX_SHORT_TEXT = 4096
_QUOTED = 500  # characters of an error's text an IndexDbError quotes
_LOOKUP_TRIES = 3  # a newest bundle deleted between naming and loading it, that many times in a row: none


class BadRow(ValueError):
    """A bundle row that does not read as one; Index._guard names the index."""


def _small_row():
    """SQL: whether a bundle row is small enough to load (each text column within its bound)."""
    short = [BundleRow.id, BundleRow.bundle_key, BundleRow.toolchain_key, BundleRow.workload_key, BundleRow.model,
             BundleRow.created_by, BundleRow.status]  # fmt: skip
    limits = [(BundleRow.facts, MAX_ROW_TEXT), (BundleRow.layers, MAX_ROW_TEXT)] + [(c, MAX_SHORT_TEXT) for c in short]
    return and_(*(func.coalesce(func.length(column), 0) <= limit for column, limit in limits))


def _short_id():
    """A bundle id as read before its row is known to be small: no more of it than a small row has."""
    return func.substr(BundleRow.id, 1, MAX_SHORT_TEXT + 1)


def _oversized(bundle_id) -> BadRow:
    return BadRow(f"bundle {str(bundle_id)[:12]}'s row holds more text than a row may have (facts "
                  f"or layers over {MAX_ROW_TEXT} characters, another column over {MAX_SHORT_TEXT})")  # fmt: skip


def bundle_of(row: BundleRow) -> Bundle:
    check_columns(row)
    created = aware(row.created_at)
    try:
        facts = json.loads(row.facts)
    except (ValueError, RecursionError) as exc:
        raise BadRow(f"bundle {str(row.id)[:12]}'s facts are not JSON ({exc})") from None
    if not isinstance(facts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in facts.items()):
        raise BadRow(f"bundle {str(row.id)[:12]}'s facts are not an object of strings")
    return Bundle(
        row.id, row.bundle_key, row.toolchain_key, row.workload_key, row.model,
        facts, tuple(filter(None, row.layers.split(","))),
        row.files, row.bytes, created, row.created_by, row.status, row.compile_seconds,
    )  # fmt: skip


def _row_of(bundle: Bundle, created: datetime) -> dict:
    """`bundle` as the columns of its row, stamped `created`."""
    return dict(
        id=bundle.id, bundle_key=bundle.bundle_key, toolchain_key=bundle.toolchain_key,
        workload_key=bundle.workload_key, model=bundle.model,
        facts=json.dumps(bundle.facts, sort_keys=True), layers=",".join(bundle.layers),
        files=bundle.files, bytes=bundle.bytes, created_at=created,
        created_by=bundle.created_by, status=bundle.status, compile_seconds=bundle.compile_seconds,
    )  # fmt: skip


def _newest_id(match):
    """SQL: the id of the newest active bundle that `match`es (as restore picks it)."""
    newest = select(BundleRow.id).where(match, BundleRow.status == "active")
    return newest.order_by(BundleRow.created_at.desc(), BundleRow.id).limit(1)


def aware(ts: datetime) -> datetime:
    """A row's time in UTC: SQLite gives back naive UTC."""
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)


_TEXT = ("text", lambda v: isinstance(v, str))
_COUNT = ("a count", lambda v: type(v) is int and v >= 0)
# What each bundle column must hold, and how to tell.
_COLUMNS = {
    "id": _TEXT, "bundle_key": _TEXT, "toolchain_key": _TEXT, "workload_key": _TEXT, "facts": _TEXT,
    "layers": _TEXT, "created_by": _TEXT, "status": _TEXT,
    "model": ("text", lambda v: v is None or isinstance(v, str)),
    "files": _COUNT, "bytes": _COUNT,
    "compile_seconds": ("seconds", lambda v: v is None or type(v) in (int, float)),  # inf: shown as none
    "created_at": ("a time", lambda v: isinstance(v, datetime)),
}  # fmt: skip


def check_columns(row, columns: Iterable[str] = tuple(_COLUMNS)) -> None:
    """BadRow for the first of a bundle row's `columns` that holds something else than it must.

    SQLite keeps whatever a writer stores in any column (text in `bytes`, a blob in `model`), and the
    index is untrusted: past here, a size of 'x' crashed `kcache ls` as a bug in kcache.
    """
    for column in columns:
        expected, holds = _COLUMNS[column]
        value = getattr(row, column)
        if not holds(value):
            held = repr(value) if type(value) in (int, float) else f"a {type(value).__name__}"  # never the text
            raise BadRow(f"bundle {str(row.id)[:12]}'s {column} holds {held}, not {expected}")


class Index:
    """One SQL index. Open with `Index.open(url)`; every method is one short transaction."""

    def __init__(self, engine: Engine, url: str):
        self.engine, self.url = engine, url

    @classmethod
    def open(cls, url: str) -> Index:
        engine = make_engine(url)
        ensure_schema(engine, url)
        return cls(engine, url)

    @classmethod
    def in_memory(cls, url: str) -> Index:
        """An empty index that lives in memory, named `url` in messages: what a reader sees
        where no index file exists, without creating one."""
        from sqlalchemy import create_engine
        from sqlalchemy.pool import StaticPool

        from kcache.index.db import upgrade

        engine = create_engine("sqlite://", poolclass=StaticPool)  # one connection: one in-memory database
        upgrade(engine)
        return cls(engine, url)

    def close(self) -> None:
        self.engine.dispose()

    def _session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def read(self, work: Callable[[Session], T]) -> T:
        """Run `work(session)` for reading; SQLAlchemy's errors become IndexDbError."""
        with self._guard(), self._session() as s:
            return work(s)

    def transaction(self, work: Callable[[Session], T]) -> T:
        """Run `work(session)` in one transaction; again when PostgreSQL aborted it for a deadlock or
        a serialization failure (the work must be safe to repeat: every kcache write is)."""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                with self._session() as s, s.begin():
                    return work(s)
            except DBAPIError as exc:
                if not transient(exc):
                    raise IndexDbError(self.url, describe_error(exc)) from None
                if attempt == _ATTEMPTS:
                    raise IndexConflict(self.url, describe_error(exc), _ATTEMPTS) from None
                log.info("index write aborted (%s); attempt %d of %d", describe_error(exc), attempt + 1, _ATTEMPTS)
                time.sleep(random.uniform(0, _BACKOFF * 2**attempt))
            except SQLAlchemyError as exc:
                raise IndexDbError(self.url, describe_error(exc)) from None
        raise AssertionError("unreachable")

    def insert_ignore(self, model, rows: list[dict]):
        """INSERT ... ON CONFLICT DO NOTHING of `rows` as literal VALUES: for a row or two (RETURNING needs it)."""
        return self._insert_or_nothing(model).values(rows)

    def insert_many(self, s: Session, model, rows: list[dict]) -> None:
        """Insert-or-ignore `rows` as one executemany: the statement is compiled once and cached.
        A VALUES list of 500 rows is compiled afresh for every call (2500 bind parameters): 20k blob
        rows took 1.7 s of client CPU on SQLite that way."""
        if rows:
            s.connection().execute(self._insert_or_nothing(model), rows)

    def _insert_or_nothing(self, model):
        # Imported here: the PostgreSQL dialect (and asyncio with it) costs a restore on SQLite ~0.1 s.
        if self.engine.dialect.name == "postgresql":
            from sqlalchemy.dialects import postgresql as dialect
        else:
            from sqlalchemy.dialects import sqlite as dialect
        return dialect.insert(model).on_conflict_do_nothing()

    def one_of(self, column, values: list[str]):
        """`column IN values`. PostgreSQL gets one array parameter instead of one per value: the statement
        text stays the same, so neither SQLAlchemy nor psycopg re-renders and re-parses 500 placeholders on
        every call (about 1.4 ms of client time per 500 ids; the plan is the same)."""
        if self.engine.dialect.name == "postgresql":
            from sqlalchemy.dialects import postgresql

            return column == any_(literal(values, postgresql.ARRAY(String)))
        return column.in_(values)

    def find_missing(self, blob_ids: Iterable[str]) -> set[str]:
        """The ids among `blob_ids` that no pack in the index holds."""
        wanted = sorted(set(blob_ids))
        present: set[str] = set()
        with self._guard(), self._session() as s:
            for i in range(0, len(wanted), _IN_CHUNK):
                chunk = wanted[i : i + _IN_CHUNK]
                present.update(s.scalars(select(BlobRow.id).where(self.one_of(BlobRow.id, chunk))))
        return set(wanted) - present

    def add_pack(self, pack_id: str, size: int, blobs: Sequence[BlobLocation], *, revive: bool = True) -> None:
        """Record a pack already written to the store, and the blobs it holds (first writer wins).
        `revive`: un-condemn its row (a publish that will name it); reindex, which records every pack it
        finds, leaves gc's condemnations be."""
        # By blob id, not pack order (which follows paths): the canonical lock order.
        rows = sorted(({"id": b.id, "pack_id": pack_id, "offset": b.offset, "length": b.length, "size": b.size}
                       for b in blobs), key=lambda row: row["id"])  # fmt: skip

        def work(s: Session) -> None:
            s.execute(self.insert_ignore(PackRow, [{"id": pack_id, "size": size, "created_at": _now()}]))
            if revive:  # a publish that reuses a condemned pack saves it from GC's second phase (a live row is left)
                condemned = (PackRow.id == pack_id, PackRow.condemned_at.is_not(None))
                s.query(PackRow).filter(*condemned).update({"condemned_at": None})
            self.insert_many(s, BlobRow, rows)

        self.transaction(work)

    def locate(self, blob_ids: Iterable[str]) -> dict[str, BlobLocation]:
        """Where each known blob lives; unknown ids are absent from the result."""
        wanted = sorted(set(blob_ids))
        found: dict[str, BlobLocation] = {}
        with self._guard(), self._session() as s:
            for i in range(0, len(wanted), _IN_CHUNK):
                # Plain columns, not ORM objects: a 20k-file bundle locates in a tenth of the time.
                columns = select(BlobRow.id, BlobRow.pack_id, BlobRow.offset, BlobRow.length, BlobRow.size)
                for row in s.execute(columns.where(self.one_of(BlobRow.id, wanted[i : i + _IN_CHUNK]))):
                    found[row[0]] = BlobLocation(*row)
        return found

    def add_bundle(self, bundle: Bundle, *, keep_time: bool = False, if_newest: str | None | object = ANY) -> bool:
        """The commit point of a publish. False if this exact manifest was already a bundle.

        The row is stamped with the index's clock, not `bundle.created_at`: "newest" must not be
        whatever the publisher's clock claims (a node a year ahead would stay newest for a year).
        PostgreSQL stamps with its server time; SQLite, a file on this host, with this host's.
        `keep_time` keeps the given time, for `kcache reindex` rebuilding history from the store.

        With `if_newest` (a bundle id, or None for none), the row goes in only while that is still
        the key's newest active bundle (or this one is): else NewestChanged and nothing committed.
        A carrying publish commits so (kcache.publish). Commits and status changes of one key run
        one at a time (lock_key), so none lands between the look and the insert.
        """
        def work(s: Session) -> bool:
            self.lock_key(s, bundle.bundle_key)
            if if_newest is not ANY:
                newest = s.scalar(_newest_id(BundleRow.bundle_key == bundle.bundle_key))
                if newest not in (if_newest, bundle.id):
                    raise NewestChanged(self.url, bundle.bundle_key, if_newest, newest)  # type: ignore[arg-type]
            # Stamped once the lock is held: a commit that waited for another is newer than it.
            row = _row_of(bundle, bundle.created_at if keep_time else self._stamp())
            # RETURNING, not rowcount: psycopg reports -1 for ON CONFLICT inserts.
            stmt = self.insert_ignore(BundleRow, [row]).returning(BundleRow.id)
            return s.connection().execute(stmt).first() is not None

        return self.transaction(work)

    def repair_bundle(self, bundle: Bundle) -> bool:
        """Put `bundle` (with its own time) in place of the row of its id when that row does not read
        back: a hand edit, a bad migration or a writer of the index left it so, and every read refuses
        it (ls, gc and verify stop there; restores of its key start cold). False when the row reads
        back, or is gone. `kcache reindex` repairs so, from the bundle's manifest."""

        def work(s: Session) -> bool:
            self.lock_key(s, bundle.bundle_key)
            if s.scalar(select(BundleRow.id).where(BundleRow.id == bundle.id)) is None:
                return False
            try:
                row = s.scalars(select(BundleRow).where(BundleRow.id == bundle.id, _small_row())).first()
                if row is not None:
                    bundle_of(row)
                    return False
            except (BadRow, ValueError, TypeError):  # what _guard reports as a row that does not read back
                s.expunge_all()
            s.execute(delete(BundleRow).where(BundleRow.id == bundle.id))
            s.execute(insert(BundleRow).values(_row_of(bundle, bundle.created_at)))
            return True

        return self.transaction(work)

    def lock_key(self, s: Session, bundle_key: str) -> None:
        """Hold, until `s`'s transaction ends, the lock that orders the commits and status changes of
        `bundle_key`'s bundles. PostgreSQL: a transaction-scoped advisory lock named by the key (READ
        COMMITTED alone would let two commits each see the other's absence). SQLite has one writer:
        a write as the transaction's first statement takes the database's write lock before anything
        is read (a read first would pin a snapshot that a later write can no longer upgrade)."""
        if self.engine.dialect.name == "postgresql":
            name = hashlib.sha256(b"kcache bundle key " + bundle_key.encode()).digest()[:8]
            s.execute(select(func.pg_advisory_xact_lock(int.from_bytes(name, "big", signed=True))))
        else:
            s.execute(update(PublishLeaseRow).where(literal(False)).values(holder=PublishLeaseRow.holder))

    def _stamp(self):
        """The index's time for a row written now, inside a transaction: PostgreSQL's time at this
        statement (now() is the transaction's start, which may be before a lock was waited for)."""
        return func.statement_timestamp() if self.engine.dialect.name == "postgresql" else _now()

    @staticmethod
    def check_bundle(bundle: Bundle) -> None:
        """Refuse, before anything is uploaded, a bundle row the database would refuse after."""
        if bundle.model is not None and len(bundle.model) > MAX_MODEL_ID:
            raise ConfigError("--model", bundle.model[:40] + "...", f"is longer than {MAX_MODEL_ID} characters")
        for column in BundleRow.__table__.columns:
            limit = getattr(column.type, "length", None)
            value = getattr(bundle, column.name, None)
            if limit and isinstance(value, str) and len(value) > limit:
                raise ConfigError(f"bundle {column.name}", value[:40] + "...", f"is longer than {limit} characters")

    def newest_bundle(self, bundle_key: str) -> Bundle | None:
        """The newest active bundle for `bundle_key`: what restore lays down."""
        return self._newest_active(BundleRow.bundle_key == bundle_key)

    def newest_for_toolchain(self, toolchain_key: str) -> Bundle | None:
        """The newest active bundle built on this toolchain, whatever its workload (--fallback toolchain)."""
        return self._newest_active(BundleRow.toolchain_key == toolchain_key)

    def _newest_active(self, match) -> Bundle | None:
        # The id first, from the (key, status, created_at DESC, id) index alone, then its row. Asked for the
        # whole row at once, PostgreSQL may instead walk all bundles newest first when a key holds many of
        # them, and pass every newer bundle when that key's newest is old (docs/index-scale.md).
        newest_id = _newest_id(match).scalar_subquery()
        small = _small_row()
        # One statement names the newest bundle and says whether its row may be loaded; asked again in a
        # second statement, PostgreSQL (READ COMMITTED) would see a bundle a publisher committed meanwhile,
        # and a fresh small row was taken for an oversized one. Loaded by its primary key next, the row
        # may be gone (gc deleted it) or yanked (a yank committed in between: it was given back as the
        # newest active bundle): then the newest is asked for again.
        for _ in range(_LOOKUP_TRIES):
            with self._guard(), self._session() as s:
                newest = s.execute(select(_short_id(), small).where(BundleRow.id == newest_id)).first()
                if newest is None:
                    return None
                if not newest[1]:
                    raise _oversized(newest[0])
                row = s.get(BundleRow, newest[0])
                if row is not None and row.status == "active":
                    return bundle_of(row)
        return None

    def get_bundle(self, id_or_prefix: str) -> Bundle:
        """A bundle by its id or an unambiguous prefix of at least 6 hex digits."""
        if not _HEX_ID_PREFIX.match(id_or_prefix):
            raise NotFound("bundle (give at least 6 hex digits of its id)", id_or_prefix)
        with self._guard(), self._session() as s:
            query = select(_short_id(), _small_row()).where(BundleRow.id.startswith(id_or_prefix, autoescape=True))
            found = s.execute(query.limit(2)).all()
            if len(found) != 1:
                raise NotFound("bundle" if not found else "unique bundle with prefix", id_or_prefix)
            if not found[0][1]:
                raise _oversized(found[0][0])
            row = s.get(BundleRow, found[0][0])
            if row is None:  # gc deleted it meanwhile
                raise NotFound("bundle", id_or_prefix)
            return bundle_of(row)

    def was_yanked(self, bundle_id: str) -> bool:
        """Whether gc deleted `bundle_id`'s row while it was yanked (kcache.index.lifecycle)."""
        return self.read(lambda s: s.get(YankRow, bundle_id) is not None)

    def list_bundles(self, *, bundle_key: str | None = None, model: str | None = None, limit: int = 50) -> list[Bundle]:
        """Bundles newest first, optionally filtered by bundle key (or prefix) and model."""
        query = select(BundleRow).order_by(BundleRow.created_at.desc(), BundleRow.id).limit(limit)
        if bundle_key:
            if not _HEX_KEY_PREFIX.match(bundle_key):
                raise NotFound("bundle key (bundle keys are 32 hex digits)", bundle_key)
            query = query.where(BundleRow.bundle_key.startswith(bundle_key, autoescape=True))
        if model:
            query = query.where(BundleRow.model == model)
        with self._guard(), self._session() as s:
            return [bundle_of(row) for row in s.scalars(query)]

    def count_bundles(self) -> int:
        with self._guard(), self._session() as s:
            return s.scalar(select(func.count()).select_from(BundleRow)) or 0

    def bound_store(self) -> tuple[str, str] | None:
        """(store id, store URL) of the store these rows describe; None while unbound."""
        cut = MAX_SHORT_TEXT + 1  # read no more than that of either: a longer one is refused
        with self._guard(), self._session() as s:
            row = s.execute(select(func.substr(StoreBindingRow.store_id, 1, cut), func.substr(StoreBindingRow.store_url,
                                   1, cut)).where(StoreBindingRow.slot == 1)).first()  # fmt: skip
            if row is None:
                return None
            if max(len(row[0] or ""), len(row[1] or "")) > MAX_SHORT_TEXT:
                raise BadRow(f"its store binding holds more than {MAX_SHORT_TEXT} characters of store id or URL")
            return str(row[0]), str(row[1])

    def bind_store(self, store_id: str, store_url: str) -> tuple[str, str]:
        """Bind this index to a store unless it is bound already; returns the binding that holds."""
        row = {"slot": 1, "store_id": store_id, "store_url": store_url, "bound_at": _now()}
        self.transaction(lambda s: s.execute(self.insert_ignore(StoreBindingRow, [row])))  # a racing binder may win
        return self.bound_store() or (store_id, store_url)

    def knows_key(self, bundle_key: str) -> bool:
        """Whether any bundle row, active or yanked, has this bundle key."""
        with self._guard(), self._session() as s:
            return s.scalar(select(BundleRow.id).where(BundleRow.bundle_key == bundle_key).limit(1)) is not None

    def record_event(self, event: Event) -> None:
        """Stamped by the index's clock, like bundles: `kcache stats --since` windows agree across pods."""
        self.transaction(lambda s: s.add(EventRow(**event.__dict__, created_at=self._clock())))

    def take_lease(self, bundle_key: str, holder: str, seconds: float) -> datetime | None:
        """Hold the publish lease of `bundle_key` for `seconds` from now by the index's clock: a new
        one, ours renewed, or another's that expired. None when held; else when the holder's ends."""
        now = self.now()
        until = now + timedelta(seconds=seconds)
        key = PublishLeaseRow.bundle_key == bundle_key

        def work(s: Session) -> datetime | None:
            # The UPDATE's condition is judged again on a row another writer just changed (PostgreSQL
            # READ COMMITTED; SQLite has one writer): of two takers of an expired lease, one wins.
            mine_or_free = (PublishLeaseRow.holder == holder) | (PublishLeaseRow.expires_at < now)
            if s.query(PublishLeaseRow).filter(key, mine_or_free).update({"holder": holder, "expires_at": until}):
                return None
            row = {"bundle_key": bundle_key, "holder": holder, "expires_at": until}
            s.execute(self.insert_ignore(PublishLeaseRow, [row]))
            held = s.execute(select(PublishLeaseRow.holder, PublishLeaseRow.expires_at).where(key)).first()
            if held is None:  # released between the two statements: the next call takes it
                return now
            if held[0] == holder:
                return None
            return held[1] if held[1].tzinfo else held[1].replace(tzinfo=timezone.utc)

        return self.transaction(work)

    def lease_held(self, bundle_key: str) -> bool:
        """Whether a publish holds `bundle_key`'s lease now (by the index's clock): one is between
        hashing and its last ref write, its manifest perhaps written and its row not yet."""
        now = self.now()
        held = select(PublishLeaseRow.holder).where(PublishLeaseRow.bundle_key == bundle_key,
                                                    PublishLeaseRow.expires_at >= now)  # fmt: skip
        return self.read(lambda s: s.execute(held.limit(1)).first() is not None)

    def release_lease(self, bundle_key: str, holder: str) -> None:
        """Give up our lease of `bundle_key`; one another publish took over is left to it."""
        self.transaction(lambda s: s.query(PublishLeaseRow).filter(
            PublishLeaseRow.bundle_key == bundle_key, PublishLeaseRow.holder == holder).delete())  # fmt: skip

    def now(self) -> datetime:
        """What `_clock` reads now: the clock this index's rows are stamped by, so what gc holds their
        times against (a gc host's own clock may be hours off the PostgreSQL server's)."""
        if self.engine.dialect.name != "postgresql":
            return _now()
        with self._guard(), self._session() as s:
            now = s.scalar(select(func.now()))
        return now if now.tzinfo else now.replace(tzinfo=timezone.utc)

    def _clock(self):
        """The index's own time: PostgreSQL's server clock; SQLite's file lives on this host."""
        return func.now() if self.engine.dialect.name == "postgresql" else _now()

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn SQLAlchemy's exceptions into IndexDbError with the driver's first line."""
        try:
            yield
        # Each text clipped first: a driver's message may quote a value of any length from the index.
        except SQLAlchemyError as exc:
            raise IndexDbError(self.url, one_line(describe_error(exc), _QUOTED)) from None
        except BadRow as exc:
            raise IndexDbError(self.url, f"{one_line(exc, _QUOTED)}; repair or delete that row (`kcache reindex` "
                                         "rewrites it from its manifest)") from None  # fmt: skip
        except (ValueError, TypeError) as exc:  # a column the driver cannot read back (a date that is no date)
            raise IndexDbError(self.url, f"a row does not read back: {one_line(exc, _QUOTED)}; repair or delete it "
                                         "(`kcache reindex` rewrites a bundle's row from its manifest)") from None
