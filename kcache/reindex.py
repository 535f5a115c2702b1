"""Rebuild the SQL index from the store alone: pack trailers give blobs, manifests give bundles.

The index is a cache of the store. After losing it (or to move from SQLite to PostgreSQL),
`kcache reindex` reads every pack's trailer with one ranged read and every manifest, and
inserts what is missing. Every blob a trailer lists is read and hashed first (as `verify
--read-data` does), and only the blobs that hash to their ids get rows: publish trusts a blob row
and names its pack instead of uploading the file, so one forged trailer (any store writer can
name a pack by its hash) claiming the id of a file publishers will publish would make every later
bundle unrestorable. `trust_trailers` skips the reads, for a store whose writers are trusted.
Any store writer can also plant packs whose trailers reach _MAX_TRAILER: the trailer bytes all
threads hold at once are bounded (TrailerBudget), whatever --jobs.

A manifest becomes a bundle only when restore could lay it out and the index can hold its row:
it is at manifests/<hh>/<id>, every pack it names is at packs/<hh>/<id> and long enough for its
ranges (a bundle whose packs are gone, made newest, would fail every restore of its key), its keys
are those of its facts (else `ls --model` and `refresh --model` would file it under a model it is
not), and its model id and facts fit a row that restore and `ls` will load. Packs elsewhere than
packs/<hh>/<id> are not indexed either: publish would name a pack restore never finds.

Bundle times come from their refs where a ref names them, else from
the manifest object's modification time (also when the ref is damaged: a writer who garbles a ref
must not make reindex leave out its key's bundles, which gc would then delete as orphans). A bundle
is yanked when `yanks/<id>` exists or its key's ref lists it (a yank never comes back as active
just because the index was lost).

Every write is insert-or-ignore by id, so reindex can run again after an interruption, into an
index that has rows, and while publishes commit to it; only a row that does not read back (every
other read of the index refuses it, naming reindex as the repair) is rewritten from its manifest.
A pack published after the listing is asked for by its key before a manifest naming it is left
out. A manifest without a row, written in the last minutes, whose bundle key a publish holds the
lease of is left to that publish (listed in `publishing`): it may be the one it wrote just before
its commit point, and a row reindex put in first, dated before the key's ref, made its commit find
the bundle there already, older than the key's newest: published, and restored by no pod.
"""

from __future__ import annotations

import json
import re
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from kcache import fetch, fingerprint, limits, packs, refs, signing
from kcache import manifest as manifests
from kcache.errors import ConfigError, IntegrityError, KcacheError, ObjectTooLarge, SignatureError
from kcache.records import BlobLocation, Bundle
from kcache.store import Store, manifest_key, pack_key
from kcache.streams import Discard

if TYPE_CHECKING:  # the SQL layer loads only when a caller opens an index
    from kcache.index import Index
from kcache.store.base import ObjectInfo, listed_size, store_now

_TAIL = 256 * 1024  # most trailers fit; longer ones get a second read
_MAX_TRAILER = 64 * 1024 * 1024  # ~700k blobs: more than a 32 MiB pack of real files holds
_TRAILER_BUDGET = 2 * _MAX_TRAILER  # trailer bytes held at once by all threads (see TrailerBudget)
_FAILURES_SHOWN = 3  # of one pack's blobs that failed, the rest counted
# A trailer is charged for what parsing it makes too: its entries (73 bytes each at least, see
# packs.parse_trailer) take about 2-3 times their bytes as objects, so two planted 64 MiB
# trailers are never parsed at once (16 of them held 2.9 GB before entries were counted).
_PARSED_PER_BYTE = 4
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
# How recent a manifest without a row must be for a held lease to leave it to its publish: a publish
# commits within seconds of writing it (a carrying one retries for a minute, kcache.publish._CARRY_SECONDS).
_PUBLISHING = timedelta(minutes=10)


@dataclass(frozen=True)
class ReindexResult:
    packs: int
    blobs: int
    bundles: int
    new_bundles: int
    skipped: tuple[str, ...]  # objects that failed verification, with the reason
    # Manifests without a row whose bundle key a publish holds the lease of: left to that publish's commit
    publishing: tuple[str, ...] = ()
    # Bundles whose row did not read back (every read of the index refuses it), rewritten from their manifest
    repaired: tuple[str, ...] = ()


class TrailerBudget:
    """The trailer bytes all reindex threads may hold at once; `take` waits until they are free.

    Any store writer can plant packs whose trailers reach _MAX_TRAILER: without a bound, --jobs
    threads would hold that many at once (16 x 64 MiB, and their parsed blobs on top).
    """

    def __init__(self, total: int):
        self.total = total
        self.held = 0
        self.peak = 0  # the most ever held at once
        self._freed = threading.Condition()

    def take(self, n: int) -> int:
        """Wait until `n` bytes (at most the whole budget, so one large trailer never waits for
        ever) are free and hold them; returns how many are held."""
        n = min(n, self.total)
        with self._freed:
            self._freed.wait_for(lambda: self.held + n <= self.total)
            self.held += n
            self.peak = max(self.peak, self.held)
        return n

    def give(self, n: int) -> None:
        with self._freed:
            self.held -= n
            self._freed.notify_all()


class _Lease:
    """What one pack holds of the budget, from its trailer's first read until its rows are in."""

    def __init__(self, budget: TrailerBudget):
        self._budget, self._held = budget, 0

    def hold(self, n: int) -> None:
        # What was held goes back first: a thread that waited while holding some could wait on
        # others that wait on it.
        self.release()
        self._held = self._budget.take(n)

    def release(self) -> None:
        held, self._held = self._held, 0
        if held:
            self._budget.give(held)

    def __enter__(self) -> _Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _pack_blobs(store: Store, info: ObjectInfo, lease: _Lease) -> tuple[packs.PackedBlob, ...]:
    """The pack's trailer, read from its end: one read, or two when it is longer than _TAIL. The
    `lease` holds the bytes read, and goes on holding them for the blobs parsed from them."""
    pack_id = info.key.rsplit("/", 1)[-1]
    if not _HEX64.match(pack_id):  # a stray object (a failed upload, a hand copy) can be gigabytes: unread
        raise IntegrityError("pack", info.key, "is not named by a pack id")
    if info.key != pack_key(pack_id):  # restore reads packs/<hh>/<id> only: blobs here would be named, never found
        raise IntegrityError("pack", info.key, f"is not at {pack_key(pack_id)}, where restore reads it")
    lease.hold(min(info.size, _TAIL))
    tail = _read_end(store, info, min(info.size, _TAIL))
    span = packs.trailer_span(pack_id, tail, info.size)
    if span > len(tail):
        if span > _MAX_TRAILER:  # a hostile footer must not make reindex read a whole huge pack
            raise ObjectTooLarge("pack trailer", info.key, span, _MAX_TRAILER)
        tail = None  # dropped before waiting for the whole trailer's bytes
        lease.hold(span * _PARSED_PER_BYTE)
        tail = _read_end(store, info, span)
    return packs.parse_trailer(pack_id, tail, info.size)


def _read_end(store: Store, info: ObjectInfo, length: int) -> bytes:
    with store.open_range(info.key, info.size - length, length) as f:
        return f.read()


def _verified(store: Store, pack_id: str, blobs: tuple[packs.PackedBlob, ...],
              skipped: list[str]) -> list[packs.PackedBlob]:  # fmt: skip
    """The blobs of one pack whose stored bytes decompress to content hashing to their ids."""
    good: list[packs.PackedBlob] = []
    listed = [b for b in blobs if _HEX64.match(b.id)]
    unnamed = [b.id for b in blobs if not _HEX64.match(b.id)]
    if unnamed:  # one line a pack: a planted trailer may list millions
        skipped.append(f"pack {pack_id[:12]}: {len(unnamed)} entries name no blob id (e.g. {unnamed[0][:64]!r})")
    entries = [manifests.Entry(f"blob {b.id[:12]}", 0o644, b.size, b.id, pack_id, b.offset, b.length) for b in listed]
    by_entry = {(b.id, b.offset): b for b in listed}

    failures: list[str] = []

    def check(entry: manifests.Entry, frame) -> None:
        try:
            packs.unpack_frame(frame, entry.blob, entry.size, Discard())
        except KcacheError as exc:
            failures.append(str(exc))
            return
        good.append(by_entry[(entry.blob, entry.offset)])

    for rng in fetch.plan_ranges(entries):
        try:
            fetch.read_range(store, rng, check, cancelled=lambda: False)
        except KcacheError as exc:  # the range ended early or overlaps: its unread blobs get no row
            failures.append(str(exc))
    skipped += [f"pack {pack_id[:12]}: {why}" for why in failures[:_FAILURES_SHOWN]]
    if len(failures) > _FAILURES_SHOWN:
        skipped.append(f"pack {pack_id[:12]}: and {len(failures) - _FAILURES_SHOWN} more blobs that failed")
    return good


def reindex(store: Store, index: Index, *, jobs: int = 16, trust_trailers: bool = False,
            trusted: tuple[signing.TrustedKey, ...] = (),
            budget: TrailerBudget | None = None) -> ReindexResult:  # fmt: skip
    """Index what the store holds; with `trust_trailers`, without reading any blob (see the module docstring).

    At most `budget` (default _TRAILER_BUDGET) trailer bytes are held at once, whatever `jobs`.

    With `trusted` keys, only manifests one of them signed become bundles, and only a ref one of
    them signed dates them: a store writer's unsigned manifests and refs would otherwise become
    the newest bundles, for pods to take and for gc to keep in place of the signed ones.
    """
    from kcache.index import lifecycle

    skipped: list[str] = []
    pack_infos = list(store.list("packs/"))
    pack_sizes = {info.key: info.size for info in pack_infos}  # by the whole key, as restore finds them
    blob_count = 0

    budget = TrailerBudget(_TRAILER_BUDGET) if budget is None else budget

    def one_pack(info: ObjectInfo) -> int:
        pack_id = info.key.rsplit("/", 1)[-1]
        with _Lease(budget) as lease:
            try:
                blobs = _pack_blobs(store, info, lease)
            except KcacheError as exc:  # reported per object; the rest is still indexed
                skipped.append(f"{info.key}: {exc}")
                return 0
            if not trust_trailers:
                blobs = tuple(_verified(store, pack_id, blobs, skipped))
            # Not revived: gc condemned it unnamed, and each reindex undid that (nothing swept, ever, with
            # reindex before each gc). The packs of a bundle it brings back are revived below.
            index.add_pack(pack_id, info.size, [BlobLocation(b.id, pack_id, b.offset, b.length, b.size) for b in blobs],
                           revive=False)  # fmt: skip
            return len(blobs)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        blob_count = sum(pool.map(one_pack, pack_infos))

    bundles = new = 0
    publishing: list[str] = []
    repaired: list[str] = []
    yanked = _yanked(store, skipped)
    key_refs: dict[str, refs.Ref | None] = {}
    for info in store.list("manifests/"):
        manifest_id = info.key.rsplit("/", 1)[-1]
        try:
            manifest = _restorable(store, info, manifest_id, trusted, pack_sizes)
            if isinstance(manifest, str):
                skipped.append(f"{info.key}: {manifest}")
                continue
            if manifest is None:  # deleted since it was listed (gc)
                continue
            if manifest.bundle_key not in key_refs:
                key_refs[manifest.bundle_key] = _ref(store, manifest.bundle_key, trusted, skipped)
            ref = key_refs[manifest.bundle_key]
        except KcacheError as exc:
            skipped.append(f"{info.key}: {exc}")
            continue
        # By the index's clock, which stamped the refs' times and stamps every later commit, read as each
        # bundle is dated (a reindex may take hours): on a host behind it, this host's clock took the newest
        # ref for one from the future and clamped every recent bundle to one time.
        created = _date(manifest, info.modified, ref, index.now(), signed=bool(trusted))
        evidence = manifest_id in yanked or (ref and manifest_id in ref.yanked) or index.was_yanked(manifest_id)
        status = "yanked" if evidence else "active"
        bundle = Bundle(
            manifest_id, manifest.bundle_key, manifest.toolchain_key, manifest.workload_key,
            manifest.facts.get("model.id"), dict(manifest.facts), manifest.layers, len(manifest.entries),
            manifest.total_size, created, f"reindex@{socket.gethostname()}", status,
        )  # fmt: skip
        unfit = _unfit(index, bundle)
        if unfit:
            skipped.append(f"{info.key}: {unfit}")
            continue
        if not lifecycle.has_bundle(index, manifest_id):
            if _being_published(store, index, manifest.bundle_key, info):  # see the module docstring
                publishing.append(manifest_id)
                continue
            lifecycle.revive(index, {entry.pack for entry in manifest.entries})  # as a publish does before its commit
        bundles += 1
        added = index.add_bundle(bundle, keep_time=True)
        new += added
        if not added and index.repair_bundle(bundle):
            repaired.append(manifest_id)
            continue
        if not added and status == "yanked" and _yanked_now(store, index, manifest):  # a row that outlived its
            lifecycle.set_status(index, manifest_id, "yanked")  # yank: the store's word wins
    return ReindexResult(len(pack_infos), blob_count, bundles, new, tuple(skipped), tuple(publishing),
                         tuple(repaired))  # fmt: skip


def _restorable(store: Store, info: ObjectInfo, manifest_id: str, trusted: tuple,
                pack_sizes: dict[str, int | None]) -> manifests.Manifest | str | None:  # fmt: skip
    """The manifest at `info` if restore could lay it out (see the module docstring), else why not;
    None when it is gone. Raises what reading and parsing it raise."""
    if info.key != manifest_key(manifest_id):  # restore reads manifests/<hh>/<id>, and only there
        return f"is not at {manifest_key(manifest_id)}, where restore reads it"
    data = limits.read_manifest(store, info.key)
    if data is None:
        return None
    manifest = manifests.parse(data, manifest_id)
    if trusted and not signing.verify(store, trusted, manifest.bundle_key, manifest_id, len(data)):
        return "not signed by a trusted key"
    keys = fingerprint.compute(manifest.facts)
    if (keys.bundle_key, keys.toolchain_key, keys.workload_key) != (
            manifest.bundle_key, manifest.toolchain_key, manifest.workload_key):  # fmt: skip
        return "its keys are not those of its facts (a manifest made by hand, or claiming another model)"
    return _packs_missing(store, manifest, pack_sizes) or manifest


def _packs_missing(store: Store, manifest: manifests.Manifest, pack_sizes: dict[str, int | None]) -> str | None:
    """Why restore could not read every entry of `manifest` from the pack it names, or None.
    A pack not in the listing is asked for by its key: a publish may have written it since."""
    for entry in manifest.entries:
        size = listed_size(store, pack_sizes, pack_key(entry.pack))
        if size is None:
            return f"pack {entry.pack[:12]} is missing (for {entry.path[:200]!r}); `kcache refresh` re-points a ref"
        if entry.offset + entry.length > size:
            return f"pack {entry.pack[:12]} is too short for {entry.path[:200]!r}"
    return None


def _unfit(index: Index, bundle: Bundle) -> str | None:
    """Why the index cannot hold this row, or holds it only as one restore and `ls` refuse to load."""
    from kcache.index.repo import MAX_ROW_TEXT

    try:
        index.check_bundle(bundle)
    except ConfigError as exc:
        return str(exc)
    text = max(len(json.dumps(bundle.facts, sort_keys=True)), len(",".join(bundle.layers)))  # as the row has them
    if text > MAX_ROW_TEXT:
        return f"its facts or layers take {text} characters, over the {MAX_ROW_TEXT} an index row may hold"
    return None


def _ref(store: Store, bundle_key: str, trusted: tuple, skipped: list[str]) -> refs.Ref | None:
    """The key's ref, when it may date bundles: with trusted keys, only one signed by one of them.
    A damaged one dates nothing (its key's bundles are dated by their objects); a failed read raises."""
    try:
        ref = refs.read(store, bundle_key)
    except (IntegrityError, ObjectTooLarge) as exc:
        skipped.append(f"refs/{bundle_key}: {exc}; its bundles are dated by their objects")
        return None
    if ref is None or not trusted:
        return ref
    try:
        signed = signing.check(trusted, dict(ref.signatures), ref.message(), bundle_key)
    except SignatureError:
        signed = None
    if signed is None:
        skipped.append(f"refs/{bundle_key}: not signed by a trusted key; its bundles are dated by their content")
        return None
    if ref.expired(datetime.now(timezone.utc)):  # a replay holds until its expiry, and only that long
        skipped.append(f"refs/{bundle_key}: expired at {ref.expires:%Y-%m-%d %H:%M} UTC; its bundles are dated "
                       "by their content")  # fmt: skip
        return None
    return ref


def _date(manifest: manifests.Manifest, modified: datetime, ref: refs.Ref | None, now: datetime,
          signed: bool = False) -> datetime:  # fmt: skip
    """When a bundle was published, as far as the store can tell; `now` is the index's clock.

    The ref's time for the bundle it names (unless from the future: else newest for good). Any
    other bundle of the key is older than that one, whatever its object's time says: a store
    copied or migrated, or a manifest put back, has a new time, and made newest it would roll pods
    back and have gc delete the bundle the ref names. No object's time is taken past now.

    A `signed` manifest (checked against trusted keys) is also taken no later than its newest
    file's time, which its signature covers: the object's time is its last upload's, so a store
    writer who uploads an old signed manifest again would otherwise make it the key's newest.
    """
    manifest_id = manifest.id
    modified = min(modified, now)
    if signed:
        newest_file = max((e.mtime_ns or 0 for e in manifest.entries), default=0)
        if newest_file > 0:
            try:
                modified = min(modified, datetime.fromtimestamp(newest_file / 1e9, timezone.utc))
            except (OverflowError, OSError, ValueError):  # past a datetime's range: says nothing
                pass
    if ref is None or refs.from_the_future(ref, lambda: now):
        return modified
    if ref.manifest == manifest_id:
        return ref.created_at
    try:
        before = ref.created_at - timedelta(milliseconds=1)
    except OverflowError:  # a ref dated on a datetime's first day (a forger's): nothing is older
        before = ref.created_at
    return min(modified, before)


def _being_published(store: Store, index: Index, bundle_key: str, info: ObjectInfo) -> bool:
    """Whether the manifest at `info` (no row yet) may be one a publish of its key is about to commit:
    the key's lease is held and the manifest was written moments ago (by the store's clock). A fleet
    publishing a key holds its lease most of the time; its older manifests are reindexed as ever."""
    return index.lease_held(bundle_key) and info.modified > store_now(store) - _PUBLISHING


def _yanked_now(store: Store, index: Index, manifest: manifests.Manifest) -> bool:
    """Whether the store still says this bundle is yanked, asked again before an active row is made
    yanked: the listing of yanks/ and the key's ref were read when reindex began or reached the key,
    which may be hours ago on a large store, and a `yank --undo` since (its row active, its marker
    deleted, its ref rewritten) was yanked again by their stale word."""
    if store.exists(refs.yank_key(manifest.id)) or index.was_yanked(manifest.id):
        return True
    try:
        ref = refs.read(store, manifest.bundle_key)
    except (IntegrityError, ObjectTooLarge):  # damaged: no evidence (as _ref dates nothing by it)
        return False
    return ref is not None and manifest.id in ref.yanked


def _yanked(store: Store, skipped: list[str]) -> set[str]:
    """Bundle ids with a yank marker. Markers are honoured unsigned: a yank can only cost a cold start."""
    ids = set()
    for info in store.list("yanks/"):
        bundle_id = info.key.rsplit("/", 1)[-1]
        if _HEX64.match(bundle_id):
            ids.add(bundle_id)
        else:
            skipped.append(f"{info.key}: not a bundle id")
    return ids
