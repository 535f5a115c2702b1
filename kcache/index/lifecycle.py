"""Index queries for a bundle's life after publish: yank, and GC's mark and sweep.

GC's two phases meet publishers in these rows:

    condemn(packs)          GC, phase 1: packs no retained bundle references get condemned_at = now
    revive(packs)           publish, before its commit point: condemned_at = NULL on every pack the
                            new manifest uses; reports packs whose rows are already gone
    delete_condemned(...)   GC, phase 2: rows of packs still condemned since before the cutoff are
                            deleted in one statement, so a pack revived a moment earlier survives

A publisher that finds a pack gone re-uploads its blobs; GC deletes a pack object only after its
row is gone. Together: no committed bundle ever points at a deleted pack.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, update

from kcache.index.models import BlobRow, BundleRow, PackRow
from kcache.index.repo import Index, _bundle
from kcache.records import Bundle

_CHUNK = 500


@dataclass(frozen=True)
class PackInfo:
    id: str
    size: int
    created_at: datetime
    condemned_at: datetime | None


def set_status(index: Index, bundle_id: str, status: str) -> Bundle:
    """Mark a bundle active or yanked; returns it as it is now."""
    bundle = index.get_bundle(bundle_id)
    with index._guard(), index._session() as s, s.begin():
        s.execute(update(BundleRow).where(BundleRow.id == bundle.id).values(status=status))
    return index.get_bundle(bundle.id)


def all_bundles(index: Index) -> list[Bundle]:
    """Every bundle, newest first."""
    with index._guard(), index._session() as s:
        return [_bundle(r) for r in s.scalars(select(BundleRow).order_by(BundleRow.created_at.desc(), BundleRow.id))]


def delete_bundle(index: Index, bundle_id: str) -> None:
    with index._guard(), index._session() as s, s.begin():
        s.execute(delete(BundleRow).where(BundleRow.id == bundle_id))


def packs(index: Index) -> list[PackInfo]:
    with index._guard(), index._session() as s:
        rows = s.scalars(select(PackRow)).all()
        return [PackInfo(r.id, r.size, r.created_at, r.condemned_at) for r in rows]


def condemn(index: Index, pack_ids: Iterable[str], at: datetime) -> None:
    """Phase 1: condemn packs not yet condemned (an older condemnation keeps its time)."""
    ids = sorted(set(pack_ids))
    with index._guard(), index._session() as s, s.begin():
        for i in range(0, len(ids), _CHUNK):
            s.execute(
                update(PackRow)
                .where(index._one_of(PackRow.id, ids[i : i + _CHUNK]), PackRow.condemned_at.is_(None))
                .values(condemned_at=at)
            )


def revive(index: Index, pack_ids: Iterable[str]) -> set[str]:
    """Publish's side: un-condemn these packs. Returns the ids whose rows no longer exist."""
    ids = sorted(set(pack_ids))
    present: set[str] = set()
    with index._guard(), index._session() as s, s.begin():
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i : i + _CHUNK]
            # Only condemned rows: rewriting every live pack row on each publish left one dead tuple per pack.
            condemned = (index._one_of(PackRow.id, chunk), PackRow.condemned_at.is_not(None))
            s.execute(update(PackRow).where(*condemned).values(condemned_at=None))
            present.update(s.scalars(select(PackRow.id).where(index._one_of(PackRow.id, chunk))))
    return set(ids) - present


def delete_condemned(index: Index, pack_ids: Iterable[str], cutoff: datetime) -> set[str]:
    """Phase 2: delete rows of packs condemned before `cutoff` and still condemned. Returns deleted ids.

    Each statement re-checks the condition itself, so a pack revived between the two statements
    keeps its row (it only loses blob rows, which costs a later publish a re-upload, never data).
    """
    ids = sorted(set(pack_ids))
    deleted: set[str] = set()
    for i in range(0, len(ids), _CHUNK):
        doomed = (
            index._one_of(PackRow.id, ids[i : i + _CHUNK]),
            PackRow.condemned_at.is_not(None),
            PackRow.condemned_at < cutoff,
        )
        with index._guard(), index._session() as s, s.begin():
            unsynced = {"synchronize_session": False}  # no ORM objects are loaded here
            s.execute(
                delete(BlobRow).where(BlobRow.pack_id.in_(select(PackRow.id).where(*doomed))),
                execution_options=unsynced,
            )
            gone = s.execute(delete(PackRow).where(*doomed).returning(PackRow.id), execution_options=unsynced)
            deleted.update(gone.scalars())
    return deleted
