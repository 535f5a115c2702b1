"""The index's queries. Returns plain frozen dataclasses, never ORM rows.

Writes are idempotent (insert-or-ignore on content ids), so any number of publishers can race:
the first row for a blob wins, and every row points at a pack that was stored before the row was.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone

from sqlalchemy import Engine, String, any_, func, literal, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from kcache.errors import IndexDbError, NotFound
from kcache.index.db import describe_error, ensure_schema, make_engine
from kcache.index.models import BlobRow, BundleRow, EventRow, PackRow
from kcache.records import BlobLocation, Bundle, Event

_IN_CHUNK = 500  # bound on bind parameters per IN (...) query


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _bundle(row: BundleRow) -> Bundle:
    created = row.created_at if row.created_at.tzinfo else row.created_at.replace(tzinfo=timezone.utc)
    return Bundle(
        row.id, row.bundle_key, row.toolchain_key, row.workload_key, row.model,
        json.loads(row.facts), tuple(filter(None, row.layers.split(","))),
        row.files, row.bytes, created, row.created_by, row.status, row.compile_seconds,
    )  # fmt: skip


class Index:
    """One SQL index. Open with `Index.open(url)`; every method is one short transaction."""

    def __init__(self, engine: Engine, url: str):
        self.engine, self.url = engine, url

    @classmethod
    def open(cls, url: str) -> Index:
        engine = make_engine(url)
        ensure_schema(engine, url)
        return cls(engine, url)

    def close(self) -> None:
        self.engine.dispose()

    def _session(self) -> Session:
        return Session(self.engine, expire_on_commit=False)

    def _insert_ignore(self, model, rows: list[dict]):
        dialect = postgresql if self.engine.dialect.name == "postgresql" else sqlite
        return dialect.insert(model).values(rows).on_conflict_do_nothing()

    def _one_of(self, column, values: list[str]):
        """`column IN values`. PostgreSQL gets one array parameter instead of one per value: the statement
        text stays the same, so neither SQLAlchemy nor psycopg re-renders and re-parses 500 placeholders on
        every call (about 1.4 ms of client time per 500 ids; the plan is the same)."""
        if self.engine.dialect.name == "postgresql":
            return column == any_(literal(values, postgresql.ARRAY(String)))
        return column.in_(values)

    def find_missing(self, blob_ids: Iterable[str]) -> set[str]:
        """The ids among `blob_ids` that no pack in the index holds."""
        wanted = sorted(set(blob_ids))
        present: set[str] = set()
        with self._guard(), self._session() as s:
            for i in range(0, len(wanted), _IN_CHUNK):
                chunk = wanted[i : i + _IN_CHUNK]
                present.update(s.scalars(select(BlobRow.id).where(self._one_of(BlobRow.id, chunk))))
        return set(wanted) - present

    def add_pack(self, pack_id: str, size: int, blobs: Sequence[BlobLocation]) -> None:
        """Record a pack already written to the store, and the blobs it holds (first writer wins)."""
        with self._guard(), self._session() as s, s.begin():
            s.execute(self._insert_ignore(PackRow, [{"id": pack_id, "size": size, "created_at": _now()}]))
            # A publish that reuses a condemned pack saves it from GC's second phase (a live row is left as is).
            condemned = (PackRow.id == pack_id, PackRow.condemned_at.is_not(None))
            s.query(PackRow).filter(*condemned).update({"condemned_at": None})
            rows = [dict(id=b.id, pack_id=pack_id, offset=b.offset, length=b.length, size=b.size) for b in blobs]
            for i in range(0, len(rows), _IN_CHUNK):
                s.execute(self._insert_ignore(BlobRow, rows[i : i + _IN_CHUNK]))

    def locate(self, blob_ids: Iterable[str]) -> dict[str, BlobLocation]:
        """Where each known blob lives; unknown ids are absent from the result."""
        wanted = sorted(set(blob_ids))
        found: dict[str, BlobLocation] = {}
        with self._guard(), self._session() as s:
            for i in range(0, len(wanted), _IN_CHUNK):
                # Plain columns, not ORM objects: a 20k-file bundle locates in a tenth of the time.
                columns = select(BlobRow.id, BlobRow.pack_id, BlobRow.offset, BlobRow.length, BlobRow.size)
                for row in s.execute(columns.where(self._one_of(BlobRow.id, wanted[i : i + _IN_CHUNK]))):
                    found[row[0]] = BlobLocation(*row)
        return found

    def add_bundle(self, bundle: Bundle) -> bool:
        """The commit point of a publish. False if this exact manifest was already a bundle."""
        row = dict(
            id=bundle.id, bundle_key=bundle.bundle_key, toolchain_key=bundle.toolchain_key,
            workload_key=bundle.workload_key, model=bundle.model,
            facts=json.dumps(bundle.facts, sort_keys=True), layers=",".join(bundle.layers),
            files=bundle.files, bytes=bundle.bytes, created_at=bundle.created_at,
            created_by=bundle.created_by, status=bundle.status, compile_seconds=bundle.compile_seconds,
        )  # fmt: skip
        with self._guard(), self._session() as s, s.begin():
            # RETURNING, not rowcount: psycopg reports -1 for ON CONFLICT inserts.
            stmt = self._insert_ignore(BundleRow, [row]).returning(BundleRow.id)
            return s.connection().execute(stmt).first() is not None

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
        newest_id = (
            select(BundleRow.id)
            .where(match, BundleRow.status == "active")
            .order_by(BundleRow.created_at.desc(), BundleRow.id)
            .limit(1)
            .scalar_subquery()
        )
        with self._guard(), self._session() as s:
            row = s.scalars(select(BundleRow).where(BundleRow.id == newest_id)).first()
            return _bundle(row) if row else None

    def get_bundle(self, id_or_prefix: str) -> Bundle:
        """A bundle by its id or an unambiguous prefix of at least 6 hex digits."""
        if len(id_or_prefix) < 6:
            raise NotFound("bundle (give at least 6 characters of its id)", id_or_prefix)
        with self._guard(), self._session() as s:
            rows = s.scalars(select(BundleRow).where(BundleRow.id.startswith(id_or_prefix)).limit(2)).all()
        if len(rows) != 1:
            raise NotFound("bundle" if not rows else "unique bundle with prefix", id_or_prefix)
        return _bundle(rows[0])

    def list_bundles(self, *, bundle_key: str | None = None, model: str | None = None, limit: int = 50) -> list[Bundle]:
        """Bundles newest first, optionally filtered by bundle key (or prefix) and model."""
        query = select(BundleRow).order_by(BundleRow.created_at.desc(), BundleRow.id).limit(limit)
        if bundle_key:
            query = query.where(BundleRow.bundle_key.startswith(bundle_key))
        if model:
            query = query.where(BundleRow.model == model)
        with self._guard(), self._session() as s:
            return [_bundle(row) for row in s.scalars(query)]

    def count_bundles(self) -> int:
        with self._guard(), self._session() as s:
            return s.scalar(select(func.count()).select_from(BundleRow)) or 0

    def record_event(self, event: Event) -> None:
        with self._guard(), self._session() as s, s.begin():
            s.add(EventRow(**event.__dict__, created_at=_now()))

    @contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn SQLAlchemy's exceptions into IndexDbError with the driver's first line."""
        try:
            yield
        except SQLAlchemyError as exc:
            raise IndexDbError(self.url, describe_error(exc)) from None
