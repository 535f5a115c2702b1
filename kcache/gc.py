"""Garbage collection in two phases, safe while publishes run. Plan first; execute the plan.

    retain   per bundle key, the newest --keep-last active bundles, plus every bundle younger than
             --older-than; everything else is deleted (row, ref, signatures, manifest; a yank
             marker stays, so publishing the same bytes again is still yanked), each row
             only if the rule still dooms it when it is deleted: a yank since the plan keeps the
             bundle it falls back to, and then this run condemns and sweeps nothing (its pack
             lists assumed that bundle gone); a publish that commits the bundle again while its
             objects go gets them back (see _delete_objects). An active bundle with a yank marker
             (a yank cut off before its row) is kept and counts for none of --keep-last
    mark     the packs that retained bundles' manifests name; a retained active bundle whose manifest
             is missing or does not verify is reported as broken, and while one is, nothing is
             swept (which packs it names is unknown); a yanked one is not: nothing can restore it
    condemn  phase 1: packs nobody references get condemned_at = now (the index's now)
    sweep    phase 2: packs condemned more than --grace ago and still condemned lose their rows,
             then their objects (a publish that reused one revived it: see index/lifecycle.py);
             --grace must outlast a publish's revive-to-commit span (MIN_GRACE)
    adopt    pack objects with no row at all (a publish that crashed) older than --grace get a row
             condemned now: a later run sweeps them by the phase-2 rule, unless a publish that
             rebuilt the identical pack revived the row first (the store's "already there" does
             not refresh an object's age, so age alone would sweep a pack a publish is reusing)
    orphans  manifests and signatures no row names, older than --grace, are deleted; if a publish
             committed a bundle on one meanwhile, GC puts the bytes back (and the publish, looking
             after its commit point, writes it again): see _delete_orphan. Not a yanked bundle's
             (its `yanks/` marker or its key's ref's yank list names it): no ref names one, so an
             index that lags the publishers' lacks it unnoticed; it is kept with the packs it names
    leftovers writes killed part-way (file:// temp files, S3 multipart uploads never completed),
             begun more than --grace ago, are removed: no reader sees them, yet they take space

Deletion runs in the reverse order of publish: rows before objects, so no committed bundle ever
points at a missing pack; a deleted bundle's ref moves off it before its row goes (and again after),
so a run cut off part-way leaves no ref naming a bundle the index lacks; its layer refs move with it
(to the next bundle that gives their layer, or away). Condemnations are stamped when they are
written, not when the plan began.

Every age is judged by the clock that stamped it, never by this host's: a row's created_at and
condemned_at by the index's (Index.now: PostgreSQL's server clock), an object's or an unfinished
write's time by the store's (Store.now: S3's Date). A CronJob on a node 7 h ahead otherwise took a
pack condemned a minute ago, or a multipart upload in flight, for one older than a 6 h --grace.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from typing import TYPE_CHECKING

from kcache import fingerprint, layerkeys, limits, refs, signing
from kcache import manifest as manifests
from kcache.config import redact_url
from kcache.errors import (
    ConfigError,
    IntegrityError,
    KcacheError,
    ObjectMissing,
    ObjectTooLarge,
    StoreError,
    UnsafePath,
)
from kcache.records import Bundle
from kcache.store import Store, manifest_key, pack_key
from kcache.store.base import Leftover, ObjectInfo, store_now
from kcache.untrusted import one_line

if TYPE_CHECKING:
    from kcache.index import Index
    from kcache.index.lifecycle import BundleHead, PackInfo


log = logging.getLogger(__name__)
_ID = re.compile(r"[0-9a-f]{64}\Z")  # a pack id; anything else under packs/ (a temp file) no publish reuses
_NEXT_SCAN = 100  # rows looked at for the bundle a ref falls back to; none among them: the ref is removed
_SKEW = timedelta(minutes=1)  # this host's clock further off the index's or store's than this is reported
# The shortest --grace `kcache gc` takes without --allow-short-grace. A run planned before a publish revived
# a pack condemns it after the revive; a second run then sweeps it if it was condemned more than --grace
# ago, and the publish commits a bundle naming a pack the store no longer has. So --grace must outlast a
# publish's revive-to-commit span: its pack checks, manifest and signature writes, and a carrying
# publish's commit retries (publish._CARRY_SECONDS, a minute), with room for a slow store or index.
MIN_GRACE = timedelta(hours=1)


@dataclass(frozen=True)
class Policy:
    keep_last: int = 3
    older_than: timedelta = timedelta(days=7)
    grace: timedelta = timedelta(hours=6)


@dataclass(frozen=True)
class Plan:
    now: datetime  # the index's clock when the plan began
    policy: Policy
    delete_bundles: tuple[BundleHead, ...]  # newest first; execute loads each one's row (its facts) in turn
    condemn: tuple[PackInfo, ...]  # unreferenced, not condemned yet
    sweep: tuple[PackInfo, ...]  # unreferenced, condemned before now - grace
    waiting: tuple[PackInfo, ...]  # unreferenced, condemned within the grace period (or held: see broken)
    orphans: tuple[ObjectInfo, ...]  # manifests, signatures and temp files without rows, older than the grace period
    adopt: tuple[ObjectInfo, ...] = ()  # pack objects without rows, older than the grace period
    broken: tuple[BundleHead, ...] = ()  # retained bundles whose manifest is missing or does not verify
    leftovers: tuple[Leftover, ...] = ()  # killed writes begun before the grace period
    yanked_without_rows: tuple[str, ...] = ()  # yanked in the store, unknown to the index: kept, packs and all
    half_yanked: tuple[tuple[str, str], ...] = ()  # (bundle key, id) of active rows with a yank marker: _half_yanked

    @property
    def bytes_freed(self) -> int:
        return sum(p.size for p in self.sweep) + sum(o.size for o in self.orphans + self.leftovers)


@dataclass(frozen=True)
class Result:
    bundles_deleted: int
    packs_condemned: int
    packs_deleted: int
    orphans_deleted: int
    bytes_freed: int
    orphan_packs_condemned: int = 0
    bundles_kept: int = 0  # planned for deletion, protected by the time gc got to them
    leftovers_removed: int = 0


def plan(store: Store, index: Index, policy: Policy, now: datetime | None = None) -> Plan:
    """`now`: judge by this time instead of the index's and the store's clocks (what a run then would do)."""
    from kcache.index import lifecycle

    if now is None:
        now, store_time = index.now(), store_now(store)
        _report_skew(index.url, now, store.url, store_time)
    else:
        store_time = now
    bundles = lifecycle.bundle_heads(index)
    stored = _stored_manifests(store)
    listed_yanked = _check_covers(store, index, {b.id for b in bundles}, stored)
    markers = {info.key[len("yanks/"):] for info in store.list("yanks/")}
    half_yanked = _half_yanked(bundles, markers)
    doomed = _expired(bundles, policy, now, frozenset(bundle_id for _key, bundle_id in half_yanked))
    doomed_ids = {d.id for d in doomed}  # once: built per bundle, it took ~10 s at 20k bundles
    retained = [b for b in bundles if b.id not in doomed_ids]
    referenced, broken = _mark(store, retained)
    lost, lost_packs = _yanked_without_rows(store, index, {b.id for b in bundles}, markers | listed_yanked, stored)
    referenced |= lost_packs
    unreferenced = [p for p in lifecycle.packs(index) if p.id not in referenced]
    cutoff = now - policy.grace
    due = not broken  # a broken manifest may name any pack: hold every sweep until it is fixed
    sweep = tuple(p for p in unreferenced if p.condemned_at and _utc(p.condemned_at) < cutoff and due)
    swept = {p.id for p in sweep}
    waiting = tuple(p for p in unreferenced if p.condemned_at and p.id not in swept)
    condemn = tuple(p for p in unreferenced if p.condemned_at is None)
    known = {p.id for p in lifecycle.packs(index)} | {b.id for b in bundles} | set(lost) | lost_packs
    store_cutoff = store_time - policy.grace
    found = list(_orphans(store, known, store_cutoff))
    adopt = tuple(o for o in found if o.key.startswith("packs/") and _ID.match(_owner(o.key)))
    orphans = tuple(o for o in found if o not in adopt)
    leftovers = tuple(left for left in store.leftovers() if _utc(left.modified) < store_cutoff)
    return Plan(now, policy, tuple(doomed), condemn, sweep, waiting, orphans, adopt, broken, leftovers, lost,
                half_yanked)


def execute(store: Store, index: Index, gc_plan: Plan, *, signer: signing.SigningKey | None = None) -> Result:
    """Carry out the plan. `signer` signs the refs gc moves, so pods requiring signatures follow them."""
    refs.default_ttl()  # a bad KCACHE_REF_TTL fails before the first delete, not at the first ref it moves
    from kcache.index import lifecycle

    deleted = sum(_delete_bundle(store, index, gc_plan, bundle, signer) for bundle in gc_plan.delete_bundles)
    kept = len(gc_plan.delete_bundles) - deleted
    # A kept bundle names packs the plan counted as unreferenced: its pack lists are stale, the next run's are not.
    condemn, sweep = (gc_plan.condemn, gc_plan.sweep) if not kept else ((), ())
    # Stamped now, not when the plan began: a publish may have revived a pack since, and a plan that
    # took longer than --grace would otherwise condemn it "grace ago", for the next run to sweep at once.
    # By the index's clock, as the sweep's cutoff is: this host's may be hours off it.
    condemned_at = max(gc_plan.now, index.now())
    lifecycle.condemn(index, (p.id for p in condemn), condemned_at)
    lifecycle.adopt(index, ((_owner(o.key), o.size) for o in gc_plan.adopt), condemned_at)
    swept = lifecycle.delete_condemned(index, (p.id for p in sweep), gc_plan.now - gc_plan.policy.grace)
    for pack_id in swept:
        store.delete(pack_key(pack_id))
    for what, delete in [*((o.key, partial(_delete_orphan, store, index, o)) for o in gc_plan.orphans),
                         *((left.key, partial(store.remove_leftover, left)) for left in gc_plan.leftovers)]:
        try:
            delete()
        except StoreError as exc:  # one object the store will not let go must not stop the rest, or every later run
            log.warning("cannot delete %s: %s", one_line(what), one_line(exc))
    freed = sum(p.size for p in sweep if p.id in swept) + sum(o.size for o in gc_plan.orphans + gc_plan.leftovers)
    return Result(deleted, len(condemn), len(swept), len(gc_plan.orphans), freed, len(gc_plan.adopt), kept,
                  len(gc_plan.leftovers))  # fmt: skip


def _check_covers(store: Store, index: Index, rows: set[str], stored: set[str]) -> set[str]:
    """Refuse an index that lacks a bundle the store's refs name: it is not the index this store's
    publishers commit to (another KCACHE_HOME, a backup missing recent rows), and to it every
    manifest they published is an orphan and every pack unreferenced. Returns the ids the refs
    list as yanked (a yanked bundle is named by no ref: see _yanked_without_rows) among those
    `stored`: a planted ref lists up to ~15k ids, each of which gc would otherwise hold and ask for."""
    from kcache.index import lifecycle

    unknown, yanked = [], set()
    for info in store.list("refs/"):
        bundle_key = info.key[len("refs/"):]
        if not fingerprint.is_bundle_key(bundle_key):
            continue
        try:
            ref = refs.read(store, bundle_key)
        except KcacheError:  # a damaged ref names nothing gc could keep
            continue
        if ref is None:
            continue
        yanked.update(bundle_id for bundle_id in ref.yanked if bundle_id in stored)
        # (has_bundle: a publish may have committed since the rows were read. A manifest the store lacks:
        # a store writer's ref, or a lost bundle; either way nothing of it for gc to delete, nothing to tell.)
        rowless = ref.manifest not in rows and not lifecycle.has_bundle(index, ref.manifest)
        if rowless and store.exists(manifest_key(ref.manifest)):
            unknown.append((info.key, ref.manifest))
    if unknown:
        where, bundle_id = unknown[0]
        raise ConfigError("--index", index.url, f"has no row for {len(unknown)} bundles the store's refs name (e.g. "
                          f"{bundle_id[:12]}, which {one_line(where)} names): it is not the index this store's "
                          "publishers use; gc with that one, or run `kcache reindex` into this one first")  # fmt: skip
    return yanked


def _yanked_without_rows(store: Store, index: Index, rows: set[str], named: set[str],
                         stored: set[str]) -> tuple[tuple[str, ...], set[str]]:  # fmt: skip
    """Yanked bundles the index has no row for whose manifest the store still holds, and their packs.

    A yank marker or a ref's yank list (`named`) names them, yet no ref does (a signed ref never names a
    yanked bundle; a key whose only bundle is yanked has no ref), so `_check_covers` cannot tell
    that this index lags the publishers'. gc keeps them, manifest, signatures and packs, or
    `yank --undo` on the publishers' index would bring back a bundle with nothing left. (They are
    what reindex brings back as yanked; a bundle gc deleted keeps its marker but not its manifest.)
    """
    from kcache.index import lifecycle

    kept, packs = [], set()
    for bundle_id in sorted((named & stored) - rows):  # without a manifest there is nothing to keep
        try:
            entries = manifests.fetch(store, bundle_id).entries
        except (ObjectMissing, IntegrityError, UnsafePath):  # gone (the usual case), or nothing to restore anyway
            continue
        if lifecycle.has_bundle(index, bundle_id):  # published (yanked) since the rows were read: not lost
            continue
        if index.was_yanked(bundle_id):  # this index's gc deleted it: a copy put back since is an orphan
            continue
        kept.append(bundle_id)
        packs.update(e.pack for e in entries)
    if kept:
        log.warning("keeping %d yanked bundles the index has no row for (e.g. %s): is it behind the publishers' "
                    "index? `kcache reindex` brings their rows back", len(kept), kept[0][:12])  # fmt: skip
    return tuple(kept), packs


def _stored_manifests(store: Store) -> set[str]:
    """The ids of the manifests the store holds where restore reads them (manifests/<hh>/<id>)."""
    owners = ((_owner(info.key), info.key) for info in store.list("manifests/"))
    return {owner for owner, key in owners if _ID.match(owner) and key == manifest_key(owner)}


def _half_yanked(bundles: list[BundleHead], markers: set[str]) -> tuple[tuple[str, str], ...]:
    """Active bundles whose yank marker the store holds: a yank cut off after its marker (which alone
    stops pods taking the bundle) and before its row; or an un-yank cut off after its row."""
    half = tuple((b.bundle_key, b.id) for b in bundles if b.status == "active" and b.id in markers)
    if half:
        log.warning("%d bundles are active in the index yet yanked in the store (e.g. %s): a yank was cut off? "
                    "They and the bundles a yank falls back to are kept; run `kcache yank` (or `yank --undo`) "
                    "on them again", len(half), half[0][1][:12])  # fmt: skip
    return half


def _expired(bundles: list[BundleHead], policy: Policy, now: datetime,
             half_yanked: frozenset[str] = frozenset()) -> list[BundleHead]:  # fmt: skip
    """Bundles neither among their key's newest `keep_last` active ones nor younger than `older_than`.

    A `half_yanked` bundle is kept and takes none of those places: its yank, run again, falls back
    to the ones after it, which a --keep-last 1 counting it had deleted."""
    by_key: dict[str, list[BundleHead]] = defaultdict(list)
    for bundle in bundles:  # newest first
        by_key[bundle.bundle_key].append(bundle)
    doomed = []
    for group in by_key.values():
        active = [b for b in group if b.status == "active" and b.id not in half_yanked]
        kept = {b.id for b in active[: policy.keep_last]} | {b.id for b in group if b.id in half_yanked}
        doomed += [b for b in group if b.id not in kept and _utc(b.created_at) < now - policy.older_than]
    return doomed


def _delete_bundle(store: Store, index: Index, gc_plan: Plan, head: BundleHead,
                   signer: signing.SigningKey | None) -> bool:  # fmt: skip
    """The refs away from it, then the row (index restores stop seeing it), then the refs again, then
    the objects. False if the bundle stays.

    The ref moves first so that a run cut off after the row's delete leaves no ref naming a bundle
    the index lacks: `_check_covers` would take that for another store's index and refuse every
    later run. It moves again after the delete, for a yank or refresh that pointed it back meanwhile.
    Its layer refs (kcache.layerkeys) move the same way, to the next bundle that gives their layer.
    """
    from kcache.index import lifecycle

    # Its row now, one at a time: the plan holds no facts (which name its layer refs) for all it dooms.
    bundle = lifecycle.bundle(index, head.id)
    if bundle is None:  # deleted since the plan (another gc, which moved its refs): as if kept, sweep nothing
        return False
    policy = gc_plan.policy
    away = _ref_without(index, bundle)
    moved = refs.repoint(store, bundle.bundle_key, bundle.id, away, signer=signer, index=index)
    layerkeys.move_off(store, index, bundle, signer=signer)
    spare = [bundle_id for key, bundle_id in gc_plan.half_yanked if key == bundle.bundle_key]
    if not lifecycle.delete_expired_bundle(index, bundle, policy.keep_last, gc_plan.now - policy.older_than,
                                           spare=spare):  # fmt: skip
        if moved:  # it stays (a yank since the plan): its key's ref is what the index says again
            refs.refresh(store, index, bundle.bundle_key, signer=signer)
        layerkeys.catch_up(store, index, bundle, signer=signer)
        return False
    _ref_after_delete(store, index, bundle, signer, moved=moved)
    layerkeys.move_off(store, index, bundle, signer=signer)  # a yank's move_off may have chosen it meanwhile
    # A yank marker stays: a warmup that compiles the same kernels makes the same manifest id, and
    # publish commits a bundle whose marker it finds as yanked (the marker is a few bytes).
    signatures = [s.key for s in store.list(f"signatures/{bundle.id}/")]
    return not _delete_objects(store, index, bundle.id, [*signatures, manifest_key(bundle.id)])


def _ref_without(index: Index, bundle: Bundle) -> refs.Ref | None:
    """The ref its key should have once `bundle` is gone: its newest other active bundle, else none."""
    newest = index.newest_bundle(bundle.bundle_key)
    if newest is not None and newest.id == bundle.id:  # keep-last 0: the next one (most likely doomed too)
        newer_first = index.list_bundles(bundle_key=bundle.bundle_key, limit=_NEXT_SCAN)
        newest = next((b for b in newer_first if b.bundle_key == bundle.bundle_key and b.status == "active"
                       and b.id != bundle.id), None)  # fmt: skip
    return refs.for_bundle(index, newest.id) if newest is not None else None


def _ref_after_delete(store: Store, index: Index, bundle: Bundle, signer: signing.SigningKey | None, *,
                      moved: bool) -> None:  # fmt: skip
    """Move the ref off the deleted `bundle` again, written from the index like every signer's ref.

    After either move (`moved`: the one before the row's delete) the ref may have been removed, and
    a publish's with it: removal is what a move to nothing, or to a bundle yanked since, comes to.
    """
    newest = index.newest_bundle(bundle.bundle_key)
    again = refs.repoint(store, bundle.bundle_key, bundle.id, refs.for_bundle(index, newest.id) if newest else None,
                         signer=signer, index=index)  # fmt: skip
    if moved or again:
        _ref_back(store, index, bundle.bundle_key, signer)


def _ref_back(store: Store, index: Index, bundle_key: str, signer: signing.SigningKey | None) -> None:
    """After gc removed a ref: a publish of the key may have committed meanwhile, and its ref gone with
    ours (a delete cannot be conditional). Put the index's newest back; a ref already there is left be."""
    newest = index.newest_bundle(bundle_key)
    if newest is not None:
        refs.advance(store, refs.for_bundle(index, newest.id), signer=signer, index=index)


def _delete_objects(store: Store, index: Index, bundle_id: str, keys: list[str]) -> bool:
    """Delete a deleted bundle's manifest and signatures; put them back if its row is back (True).

    A publish of the identical manifest may find these objects "already there" and commit the
    bundle again while we delete them. It checks its manifest and signature after its commit
    point, and we check its row after our deletes: whichever looks last sees the other's step.
    """
    from kcache.index import lifecycle

    kept: dict[str, bytes] = {}
    for key in keys:
        data = _read_kept(store, key)
        store.delete(key)
        if data:
            kept[key] = data
    if not lifecycle.has_bundle(index, bundle_id):
        return False
    for key, data in kept.items():
        store.put_bytes(key, data)  # "already there" if the publish wrote it first
    return True


def _delete_orphan(store: Store, index: Index, orphan: ObjectInfo) -> None:
    """Delete a manifest (or signature, or temp file) no bundle row names, unless one does now.

    A publish may commit a bundle on an identical manifest it found "already there" while we
    delete it: if its row shows up after our delete, the bytes go back. The publish checks from
    its side after its commit point, so whichever of the two looks last sees the other's step.
    """
    from kcache.index import lifecycle

    owner = _owner(orphan.key)
    if not _ID.match(owner):  # a stray upload or temp file: no publish can name it, nothing to keep
        store.delete(orphan.key)
        return
    data = _read_kept(store, orphan.key)
    if data is None or lifecycle.has_bundle(index, owner):
        return
    store.delete(orphan.key)
    if data and lifecycle.has_bundle(index, owner):
        store.put_bytes(orphan.key, data)


def _read_kept(store: Store, key: str) -> bytes | None:
    """The bytes to put back should a bundle claim `key` after we delete it; None if it is gone.

    Capped: a stray object can be gigabytes. One over the cap is refused by every restore anyway,
    so it is deleted unread (b""); a publish that committed on it writes it again.
    """
    limit = limits.SIGNATURE_BYTES if key.startswith("signatures/") else limits.max_manifest_bytes()
    try:
        return limits.read_capped(store, key, limit, "orphan")
    except ObjectTooLarge:
        return b""


def _mark(store: Store, retained: list[BundleHead]) -> tuple[set[str], tuple[BundleHead, ...]]:
    """The packs the retained bundles' manifests name, and the active bundles whose manifest cannot be read.

    A yanked one's is no reason to hold the sweeps: `yank --undo` refuses a bundle without its
    manifest, and a publish of the same files again uploads whatever packs it lacks.
    """
    referenced: set[str] = set()
    broken = []
    for bundle in retained:
        try:
            referenced.update(e.pack for e in manifests.fetch(store, bundle.id).entries)
        except (ObjectMissing, IntegrityError, UnsafePath):  # ObjectTooLarge is one: no restore reads it either
            if bundle.status != "yanked":
                broken.append(bundle)
    return referenced, tuple(broken)


def _orphans(store: Store, known: set[str], cutoff: datetime):
    """Packs and manifests no row names, and signatures of manifests no row names, older than cutoff."""
    for prefix in ("packs/", "manifests/", "signatures/"):
        for info in store.list(prefix):
            owner = _owner(info.key)
            if owner not in known and _utc(info.modified) < cutoff:
                yield info


def _owner(key: str) -> str:
    """The content id an object belongs to: packs/<hh>/<id>, manifests/<hh>/<id>, signatures/<id>/<key>."""
    parts = key.split("/")
    return (parts[1] if parts[0] == "signatures" else parts[2]) if len(parts) >= 3 else ""


def _report_skew(index_url: str, index_time: datetime, store_url: str, store_time: datetime) -> None:
    """Warn when this host's clock is off the ones gc judges by: gc does not use it, but whatever
    else runs on this host does (S3 signs requests with it, for one)."""
    host = _host_now()
    for name, url, theirs in (("index", index_url, index_time), ("store", store_url, store_time)):
        off = (host - _utc(theirs)).total_seconds()
        if abs(off) > _SKEW.total_seconds():
            where = "ahead of" if off > 0 else "behind"
            log.warning("this host's clock is %d s %s the %s's (%s); gc judges ages by the %s's clock",
                        abs(off), where, name, one_line(redact_url(url)), name)  # fmt: skip


def _host_now() -> datetime:
    """This host's clock: gc judges no age by it (see _report_skew)."""
    return datetime.now(timezone.utc)


def _utc(ts: datetime) -> datetime:
    return ts if ts.tzinfo else ts.replace(tzinfo=timezone.utc)
