"""Index queries for a bundle's life after publish: yank, and GC's mark and sweep.

GC's two phases meet publishers in these rows:

    delete_expired_bundle   GC: a bundle row goes only if, in the same statement, it is still outside
                            its key's newest keep-last active bundles and older than the cutoff (a
                            yank since the plan, or a publish that committed it again, keeps it);
                            a yanked one leaves its id in `yanks`, so a copy put back stays yanked
    condemn(packs)          GC, phase 1: packs no retained bundle references get condemned_at = now,
                            by the index's clock (Index.now), as the bundles' created_at are
    adopt(packs)            GC, phase 1: a pack object with no row at all (a publish crashed before
                            its rows) gets a row that is condemned from the start, so it is swept by
                            the same two-phase rule, and a re-publish that rebuilds it revives it
    revive(packs)           publish, before its commit point: condemned_at = NULL on every pack the
                            new manifest uses; reports packs whose rows are already gone
    delete_condemned(...)   GC, phase 2: rows of packs still condemned since before the cutoff are
                            deleted in one statement, so a pack revived a moment earlier survives

A publisher that finds a pack gone re-uploads its blobs; GC deletes a pack object only after its
row is gone. Together: no committed bundle ever points at a deleted pack.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from datetime import datetime

from sqlalchemy import delete, exists, literal, select, update
from sqlalchemy.orm import aliased

from kcache.errors import NotFound
from kcache.index.models import BlobRow, BundleRow, PackRow, YankRow
from kcache.index.repo import BadRow, Index, aware, bundle_of, check_columns
from kcache.records import Bundle

_CHUNK = 500
_STREAM = 1000  # rows fetched at a time where every bundle is walked
_NEWEST = (BundleRow.created_at.desc(), BundleRow.id)  # "newest first", as every bundle query orders


@dataclass(frozen=True)
class BundleHead:
    """A bundle row without its facts and layers: what gc and verify plan with. Parsed facts take a few
    KiB a bundle; all 110k rows with them, held at once, took ~1.3 GiB (docs/index-scale.md)."""

    id: str
    bundle_key: str
    model: str | None
    status: str
    created_at: datetime


@dataclass(frozen=True)
class PackInfo:
    id: str
    size: int
    created_at: datetime
    condemned_at: datetime | None


def set_status(index: Index, bundle_id: str, status: str) -> Bundle:
    """Mark a bundle active or yanked; returns it as it is now."""
    bundle = index.get_bundle(bundle_id)

    def work(s) -> None:
        index.lock_key(s, bundle.bundle_key)  # a carrying publish's commit sees the yank, or lands first
        s.execute(update(BundleRow).where(BundleRow.id == bundle.id).values(status=status))
        if status == "active":  # an undone yank: a record of it from an earlier gc must not list it still
            s.execute(delete(YankRow).where(YankRow.id == bundle.id))

    index.transaction(work)
    return index.get_bundle(bundle.id)


def bundle_heads(index: Index) -> list[BundleHead]:
    """Every bundle's head, newest first; the rows are streamed, and no facts are read."""
    names = [field.name for field in fields(BundleHead)]
    query = select(*(getattr(BundleRow, name) for name in names)).order_by(*_NEWEST)

    def work(s) -> list[BundleHead]:
        heads = []
        for row in s.execute(query.execution_options(yield_per=_STREAM)):
            check_columns(row, names)
            heads.append(BundleHead(row.id, row.bundle_key, row.model, row.status, aware(row.created_at)))
        return heads

    return index.read(work)


def bundle(index: Index, bundle_id: str) -> Bundle | None:
    """The bundle with this whole id, loaded as every lookup is (its size checked first); None when it
    has no row (any more)."""
    try:
        return index.get_bundle(bundle_id)
    except NotFound:
        return None


def bundle_keys(index: Index, model: str | None = None) -> list[str]:
    """Every bundle key the index holds (of `model`, if given), sorted."""
    query = select(BundleRow.bundle_key).distinct().order_by(BundleRow.bundle_key)
    if model is not None:
        query = query.where(BundleRow.model == model)

    def work(s) -> list[str]:
        keys = list(s.scalars(query))
        wrong = next((key for key in keys if not isinstance(key, str)), None)  # see check_columns
        if wrong is not None:
            raise BadRow(f"a bundle's bundle_key holds a {type(wrong).__name__}, not text")
        return keys

    return index.read(work)


def newest_holders(index: Index, layer: str, gives: Callable[[Bundle], bool], limit: int, *,
                   without: str = "") -> list[Bundle]:  # fmt: skip
    """Newest first, the first `limit` bundles that are active, their key's newest active bundle (both
    but `without`), list `layer` and satisfy `gives`: the donors a layer ref may name (kcache.layerkeys).

    Only rows that pass the first three tests are loaded, streamed, until `limit` satisfy `gives`: a
    yank or gc asks once per layer ref it moves, and every bundle held at once took ~1.3 GiB at 110k.
    """
    newer = aliased(BundleRow)
    alive = lambda row: (row.status == "active") & (row.id != without)  # noqa: E731
    before = (newer.created_at > BundleRow.created_at) | (
        (newer.created_at == BundleRow.created_at) & (newer.id < BundleRow.id))  # the order of _NEWEST
    superseded = exists().where(newer.bundle_key == BundleRow.bundle_key, alive(newer), before)
    listed = (literal(",") + BundleRow.layers + literal(",")).contains(f",{layer},", autoescape=True)
    query = select(BundleRow).where(alive(BundleRow), listed, ~superseded).order_by(*_NEWEST)

    def work(s) -> list[Bundle]:
        found: list[Bundle] = []
        for row in s.scalars(query.execution_options(yield_per=_STREAM)):
            if len(found) == limit:
                break
            candidate = bundle_of(row)
            if gives(candidate):
                found.append(candidate)
        return found

    return index.read(work)


def has_bundle(index: Index, bundle_id: str) -> bool:
    """Whether a row has this id; only the id is read, so a row that does not read back has one too."""
    return index.read(lambda s: s.scalar(select(BundleRow.id).where(BundleRow.id == bundle_id)) is not None)


def delete_expired_bundle(index: Index, bundle: Bundle, keep_last: int, cutoff: datetime, *,
                          spare: Iterable[str] = ()) -> bool:  # fmt: skip
    """Delete `bundle`'s row if it is still expired by gc's rule; True if it was deleted.

    One statement re-checks the rule against the rows as they are now: not among its key's newest
    `keep_last` active bundles (the order of `bundle_heads`) but those in `spare` (which hold no
    place: half-yanked ones, see kcache.gc._half_yanked), created before `cutoff`. A yank that
    committed before the statement is seen, so the bundle it falls back to stays; one that commits
    after it is ordered after this GC (a ref it points at the deleted bundle meanwhile, gc re-points).
    """
    kept = (
        select(BundleRow.id)
        .where(BundleRow.bundle_key == bundle.bundle_key, BundleRow.status == "active")
        .order_by(BundleRow.created_at.desc(), BundleRow.id)
        .limit(keep_last)
    )
    spared = sorted(set(spare))
    if spared:  # bundles gc itself never dooms (the caller passes only this key's)
        kept = kept.where(BundleRow.id.not_in(spared))
    doomed = (BundleRow.id == bundle.id, BundleRow.created_at < cutoff, BundleRow.id.not_in(kept))
    stmt = delete(BundleRow).where(*doomed).returning(BundleRow.id, BundleRow.bundle_key, BundleRow.status)

    def work(s) -> bool:
        gone = s.execute(stmt, execution_options={"synchronize_session": False}).first()
        if gone is not None and gone.status == "yanked":  # in the same transaction: no moment without the yank
            row = {"id": gone.id, "bundle_key": gone.bundle_key, "deleted_at": index._clock()}  # the rows' clock
            s.execute(index.insert_ignore(YankRow, [row]))
        return gone is not None

    return index.transaction(work)


def yanked_gone(index: Index, bundle_key: str, limit: int) -> list[str]:
    """Ids of `bundle_key`'s yanked bundles gc deleted, at most `limit` (the newest deletions first)."""
    query = (select(YankRow.id).where(YankRow.bundle_key == bundle_key)
             .order_by(YankRow.deleted_at.desc(), YankRow.id).limit(limit))  # fmt: skip
    return index.read(lambda s: list(s.scalars(query)))


def packs(index: Index) -> list[PackInfo]:
    return index.read(lambda s: [PackInfo(r.id, r.size, r.created_at, r.condemned_at)
                                 for r in s.scalars(select(PackRow))])  # fmt: skip


def condemn(index: Index, pack_ids: Iterable[str], at: datetime) -> None:
    """Phase 1: condemn packs not yet condemned (an older condemnation keeps its time)."""
    ids = sorted(set(pack_ids))

    def work(s) -> None:
        for i in range(0, len(ids), _CHUNK):
            s.execute(
                update(PackRow)
                .where(index.one_of(PackRow.id, ids[i : i + _CHUNK]), PackRow.condemned_at.is_(None))
                .values(condemned_at=at)
            )

    index.transaction(work)


def adopt(index: Index, packs: Iterable[tuple[str, int]], at: datetime) -> None:
    """Phase 1 for orphan pack objects: a condemned row for each (id, size) that has no row yet.

    Insert-or-ignore: a publisher that recorded the pack meanwhile keeps its live row.
    """
    rows = sorted(({"id": p, "size": size, "created_at": at, "condemned_at": at} for p, size in packs),
                  key=lambda row: row["id"])  # fmt: skip

    def work(s) -> None:
        index.insert_many(s, PackRow, rows)

    if rows:
        index.transaction(work)


def forget(index: Index, pack_ids: Iterable[str]) -> None:
    """Drop the rows of packs the store has lost: the index must not offer their blobs any more."""
    ids = sorted(set(pack_ids))
    for i in range(0, len(ids), _CHUNK):
        index.transaction(lambda s, chunk=ids[i : i + _CHUNK]: _delete_rows(s, (PackRow.id.in_(chunk),)))


def revive(index: Index, pack_ids: Iterable[str]) -> set[str]:
    """Publish's side: un-condemn these packs. Returns the ids whose rows no longer exist."""
    ids = sorted(set(pack_ids))

    def work(s) -> set[str]:
        present: set[str] = set()
        for i in range(0, len(ids), _CHUNK):
            chunk = ids[i : i + _CHUNK]
            # Only condemned rows: rewriting every live pack row on each publish left one dead tuple per pack.
            condemned = (index.one_of(PackRow.id, chunk), PackRow.condemned_at.is_not(None))
            s.execute(update(PackRow).where(*condemned).values(condemned_at=None))
            present.update(s.scalars(select(PackRow.id).where(index.one_of(PackRow.id, chunk))))
        return present

    return set(ids) - index.transaction(work)


def delete_condemned(index: Index, pack_ids: Iterable[str], cutoff: datetime) -> set[str]:
    """Phase 2: delete rows of packs condemned before `cutoff` and still condemned. Returns deleted ids.

    Each statement re-checks the condition itself, so a pack revived between the two statements
    keeps its row (it only loses blob rows, which costs a later publish a re-upload, never data).
    """
    ids = sorted(set(pack_ids))
    deleted: set[str] = set()
    for i in range(0, len(ids), _CHUNK):
        doomed = (
            index.one_of(PackRow.id, ids[i : i + _CHUNK]),
            PackRow.condemned_at.is_not(None),
            PackRow.condemned_at < cutoff,
        )
        deleted.update(index.transaction(lambda s, doomed=doomed: _delete_rows(s, doomed)))
    return deleted


def _delete_rows(s, doomed) -> set[str]:
    """Blob rows, then pack rows, of the packs matching `doomed`; the ids of the packs deleted."""
    unsynced = {"synchronize_session": False}  # no ORM objects are loaded here
    s.execute(delete(BlobRow).where(BlobRow.pack_id.in_(select(PackRow.id).where(*doomed))), execution_options=unsynced)
    return set(s.execute(delete(PackRow).where(*doomed).returning(PackRow.id), execution_options=unsynced).scalars())
