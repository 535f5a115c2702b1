"""Aggregates over the events table: restores, hits, bytes, and the compile time hits saved.

Every number is computed by the database (counts, sums, percentiles by ORDER BY ... OFFSET), so a
year of events costs a few small queries, not a download of the table. The same SQL runs on SQLite
and PostgreSQL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timezone
from decimal import Decimal

from sqlalchemy import Float, case, cast, func, select

from kcache.index.models import BundleRow, EventRow
from kcache.index.repo import Index


@dataclass(frozen=True)
class EventStats:
    since: datetime | None  # events at or after this instant (UTC); None means all
    model: str | None
    restores: int
    hits: int
    partials: int  # --fallback toolchain|layers: some kernel layers restored, the rest compiled cold
    misses: int
    errors: int
    bytes_restored: int  # hits' and partials' bytes: everything restore laid down
    partial_bytes: int  # the partials' share of bytes_restored
    median_restore_seconds: float | None  # over hits: the time a warm pod waits; None without hits
    p95_restore_seconds: float | None
    publishes: int  # every publish, including re-publishes of an unchanged cache
    published: int  # publishes that created a new bundle
    bytes_uploaded: int  # pack bytes sent to the store
    seconds_saved: float  # over hits with an estimate: bundle's compile_seconds - restore seconds, >= 0
    hits_with_estimate: int
    hits_without_estimate: int  # the bundle has no compile_seconds (or is gone from the index)

    @property
    def hit_rate(self) -> float | None:
        """Full hits over all restore attempts (errors included: the pod started cold). A partial
        is no hit: the pod still compiled its workload's graphs."""
        return self.hits / self.restores if self.restores else None


def event_stats(index: Index, *, since: datetime | None = None, model: str | None = None) -> EventStats:
    """Aggregate the events recorded at or after `since`, optionally for one model's bundle keys.

    Events carry no model: with `model`, an event counts when its bundle key belongs to a bundle
    of that model, so misses on a key that was never published cannot be attributed.
    """
    if since is not None:
        # SQLite stores naive UTC text; compare in UTC on every dialect.
        since = since.astimezone(timezone.utc) if since.tzinfo else since.replace(tzinfo=timezone.utc)
    filters = []
    if since is not None:
        filters.append(EventRow.created_at >= since)
    if model is not None:
        filters.append(EventRow.bundle_key.in_(select(BundleRow.bundle_key).where(BundleRow.model == model)))
    # The guard makes a value that is no number (_number) an IndexDbError, as any row that does not read back.
    with index._guard(), index.engine.connect() as conn:
        totals = _totals(conn, filters)
        hits = totals.get(("restore", "hit"), (0, 0))[0]
        median, p95 = _hit_percentiles(conn, filters, hits)
        saved, with_estimate = _saved(conn, filters)
    count = lambda kind, status: totals.get((kind, status), (0, 0))[0]  # noqa: E731
    return EventStats(
        since=since, model=model,
        restores=sum(n for (kind, _), (n, _) in totals.items() if kind == "restore"),
        hits=hits, partials=count("restore", "partial"), misses=count("restore", "miss"),
        errors=count("restore", "error"),
        bytes_restored=totals.get(("restore", "hit"), (0, 0))[1] + totals.get(("restore", "partial"), (0, 0))[1],
        partial_bytes=totals.get(("restore", "partial"), (0, 0))[1],
        median_restore_seconds=median, p95_restore_seconds=p95,
        publishes=sum(n for (kind, _), (n, _) in totals.items() if kind == "publish"),
        published=count("publish", "published"),
        bytes_uploaded=sum(b for (kind, _), (_, b) in totals.items() if kind == "publish"),
        seconds_saved=saved, hits_with_estimate=with_estimate, hits_without_estimate=hits - with_estimate,
    )  # fmt: skip


def _totals(conn, filters) -> dict[tuple[str, str], tuple[int, int]]:
    """(kind, status) -> (events, bytes)."""
    query = (
        select(EventRow.kind, EventRow.status, func.count(), func.coalesce(func.sum(EventRow.bytes), 0))
        .where(*filters)
        .group_by(EventRow.kind, EventRow.status)
    )
    return {(kind, status): (int(n), int(_number(b, f"the bytes of {kind} events", finite=True))) for kind, status, n, b
            in conn.execute(query)}  # fmt: skip


def _hit_percentiles(conn, filters, hits: int) -> tuple[float | None, float | None]:
    if not hits:
        return None, None
    ordered = (
        select(EventRow.id, EventRow.seconds)
        .where(EventRow.kind == "restore", EventRow.status == "hit", *filters)
        .order_by(EventRow.seconds, EventRow.id)
    )
    # Median: the middle value, or the mean of the two middle ones. p95: nearest rank.
    seconds = lambda rows: [_number(s, f"event {i}'s seconds") for i, s in conn.execute(rows)]  # noqa: E731
    middle = seconds(ordered.offset((hits - 1) // 2).limit(2 - hits % 2))
    p95 = seconds(ordered.offset(math.ceil(0.95 * hits) - 1).limit(1))
    return sum(middle) / len(middle), float(p95[0])


def _saved(conn, filters) -> tuple[float, int]:
    """(seconds saved over hits with an estimate, how many hits had one)."""
    gain = BundleRow.compile_seconds - EventRow.seconds
    query = (
        select(
            func.coalesce(func.sum(case((gain > 0, gain), else_=cast(0.0, Float))), 0.0),
            func.count(BundleRow.compile_seconds),
        )
        .select_from(EventRow)
        .outerjoin(BundleRow, BundleRow.id == EventRow.bundle_id)
        .where(EventRow.kind == "restore", EventRow.status == "hit", *filters)
    )
    saved, with_estimate = conn.execute(query).one()
    return float(_number(saved, "the seconds saved")), int(with_estimate)


def _number(value, what: str, *, finite: bool = False):
    """`value`, a number read or summed from the events (`finite`: one int() takes). SQLite keeps
    whatever a writer stores in any column (text in `seconds`, 9e999 in `bytes`), and the index is
    untrusted: summed as they were, such values crashed `kcache stats` as a bug in kcache. An
    infinite number of seconds is shown as none (cli.format), as a bundle's compile_seconds is."""
    if type(value) not in (int, float, Decimal) or (finite and not math.isfinite(value)):
        held = repr(value) if type(value) in (int, float) else f"a {type(value).__name__}"  # never the text itself
        raise ValueError(f"{what} holds {held}, not a number")
    return value
