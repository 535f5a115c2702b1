"""SQL tables of the index. Rows point into the store; the store can rebuild them.

    bundles  one row per published manifest (id = manifest id); the commit point of a publish
    packs    one row per pack object; condemned_at is set by GC's first phase
    blobs    content id -> the pack, offset and compressed length that hold it
    events   restore/publish outcomes, the source of hit-rate and time-saved stats
    store_binding  one row: the id of the store these rows describe (kcache.binding)
    publish_leases  bundle key -> the publish uploading for it now, until when (kcache.publish)
    yanks    bundles gc deleted while yanked: the yank outlives the row (see YankRow)

Schema changes go through a new Alembic migration in migrations/versions; a test checks that
these models and the migrations agree.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, DateTime, Float, ForeignKey, Index, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

# PostgreSQL refuses a btree entry over ~2.7 kB: an indexed TEXT column still needs a bound.
MAX_MODEL_ID = 1024


class Base(DeclarativeBase):
    pass


class BundleRow(Base):
    __tablename__ = "bundles"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    bundle_key: Mapped[str] = mapped_column(String(64))
    toolchain_key: Mapped[str] = mapped_column(String(64))
    workload_key: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(Text)  # at most MAX_MODEL_ID (btree entry limit)
    facts: Mapped[str] = mapped_column(Text)  # canonical JSON
    layers: Mapped[str] = mapped_column(Text)  # comma-separated layer names
    files: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16), default="active")
    # Cold warmup/compile seconds the publisher measured; what a hit on this bundle saves.
    compile_seconds: Mapped[float | None] = mapped_column(Float, nullable=True)


# The fleet's bundle queries, each served by one index: equality columns first, then the query's own
# ORDER BY (created_at DESC, id) exactly, so PostgreSQL reads the rows it returns and never prefers
# walking every bundle newest first in search of an old key's rows. varchar_pattern_ops lets the id
# and bundle_key prefix searches (LIKE 'abc%') use an index under any collation, not only "C";
# equality still can. See migrations/versions/0100_index_scale.py and docs/index-scale.md.
_NEWEST = (BundleRow.created_at.desc(), BundleRow.id)
Index(
    "ix_bundles_key_newest",
    BundleRow.bundle_key,
    BundleRow.status,
    *_NEWEST,
    postgresql_ops={"bundle_key": "varchar_pattern_ops"},
)
Index("ix_bundles_toolchain_newest", BundleRow.toolchain_key, BundleRow.status, *_NEWEST)
Index("ix_bundles_model_created", BundleRow.model, *_NEWEST)
Index("ix_bundles_created", *_NEWEST)
Index("ix_bundles_id_prefix", BundleRow.id, postgresql_ops={"id": "varchar_pattern_ops"})


class PackRow(Base):
    __tablename__ = "packs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    condemned_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class BlobRow(Base):
    __tablename__ = "blobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    pack_id: Mapped[str] = mapped_column(String(64), ForeignKey("packs.id"), index=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    length: Mapped[int] = mapped_column(BigInteger)
    size: Mapped[int] = mapped_column(BigInteger)


class EventRow(Base):
    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_kind_created", "kind", "created_at"),
        Index("ix_events_created", "created_at"),
        Index("ix_events_key_created", "bundle_key", "created_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))  # restore | publish
    status: Mapped[str] = mapped_column(String(16))  # hit | miss | error | published
    bundle_key: Mapped[str | None] = mapped_column(String(64), nullable=True)
    bundle_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    files: Mapped[int] = mapped_column(Integer, default=0)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    seconds: Mapped[float] = mapped_column(Float, default=0.0)
    reason: Mapped[str | None] = mapped_column(Text, nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class StoreBindingRow(Base):
    __tablename__ = "store_binding"

    slot: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # always 1: one store
    store_id: Mapped[str] = mapped_column(String(64))
    store_url: Mapped[str] = mapped_column(Text)  # as first bound; for messages, never compared
    bound_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class PublishLeaseRow(Base):
    """A publish of `bundle_key` under way: others of the same key wait for it, then upload what it did
    not. Only saves uploads: a lease that is lost, expires or is never taken changes no outcome."""

    __tablename__ = "publish_leases"

    bundle_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(128))  # host:pid:token of the publish, for messages
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # by the index's clock


class YankRow(Base):
    """A yanked bundle whose row gc deleted. Its signed manifest still verifies wherever a copy of it
    is put back (a store writer may have kept one), so the yank must outlive the row: pins to it and
    its key's signed ref yank list are answered from here (kcache.choice, kcache.refs)."""

    __tablename__ = "yanks"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the bundle (manifest) id
    bundle_key: Mapped[str] = mapped_column(String(64), index=True)
    deleted_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))  # by the index's clock
