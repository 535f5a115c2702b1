"""Refs: `refs/<bundle-key>` names the newest manifest of a bundle key, in the store itself.

    refs/<bundle-key>  ->  {"signed": {"schema": 2, "type": "kcache-ref", "bundle_key": ...,
                                       "manifest": <id>, "created_at": <iso UTC>, "generation": <n>,
                                       "expires": <iso UTC> | null, "yanked": [<id>, ...]},
                            "signatures": {<key name>: <base64 Ed25519 over canonical "signed">}}
    yanks/<bundle-id>  ->  why the bundle was yanked (present = never restore it)

A pod that may read the bucket but not the SQL index restores through its ref. Publishers move
a ref forward with compare-and-swap, and only forward: a slow publisher whose bundle is older
than the ref's never overwrites it. A ref dated more than MAX_CLOCK_SKEW ahead of the writer's
clock holds nothing off: a fast clock must not freeze its key.

A store writer without the signing key must not be able to roll pods back, so under
`--require-signature` the ref itself must be signed (like TUF's timestamp role):

- `generation` grows with every write: one more than the ref it replaces, and never less than the
  writer's clock in milliseconds, so a replayed old ref cannot pull the next write's number back.
  Pods keep no state, so they cannot compare it with what they saw before; it lets anything that
  does remember (an operator, a monitor) see a replayed ref, and orders the signed history.
- `expires` (set when signed; `KCACHE_REF_TTL`, default 1 day) bounds replay: an old signed ref
  copied back into the store is refused once it expires. `kcache refresh`, and every signed
  publish that finds the ref past half its lifetime, re-sign it.
- `yanked` lists the bundles of this key the signer's index has yanked, so deleting a
  `yanks/<id>` marker does not un-yank a pinned bundle, and a signed ref never names a yanked one.
  The list comes from the writer's index, never from the ref it replaces (which anyone could edit).

Yank markers stay unsigned on purpose: a marker can only make a pod start cold or take the
previous bundle, so honouring one from an untrusted writer is fail-safe.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from kcache import canonical, durations, limits, signing
from kcache.errors import IntegrityError, KcacheError, NotFound, ObjectTooLarge
from kcache.store import Store, ref_key

if TYPE_CHECKING:
    from kcache.index import Index

log = logging.getLogger(__name__)
SCHEMA = 2
TYPE = "kcache-ref"  # in the signed bytes: a ref signature can never pass for a manifest signature
DEFAULT_TTL = timedelta(days=1)  # the replay window; signed publishes and `kcache refresh` renew it
TTL_ENV = "KCACHE_REF_TTL"
_CAS_ATTEMPTS = 20
_FAILED_IN_A_ROW = 3  # refresh_all: keys failing one after another that end it (see there)
_YANK_SCAN = 10_000  # bundles of one key looked at for its yank list; gc keeps far fewer
# Ids in a ref's yank list, ~67 bytes each: the ref stays well inside the limits.REF_BYTES pods read.
_YANK_LIST = 12_000
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_KEEP = object()  # a decision: leave the ref as it is
# How far ahead of the writer's clock a ref's created_at may be and still hold a newer bundle off.
# Further ahead is a fast clock (or a store writer): obeying it would freeze the key until then.
MAX_CLOCK_SKEW = timedelta(minutes=10)


@dataclass(frozen=True)
class Ref:
    bundle_key: str
    manifest: str
    created_at: datetime  # the bundle's: orders publishes
    generation: int = 0  # set by each write: above the ref it replaced and the writer's clock (ms)
    expires: datetime | None = None  # set when signed
    yanked: tuple[str, ...] = ()  # sorted bundle ids of this key that must never be restored
    signatures: tuple[tuple[str, str], ...] = ()  # (key name, base64 signature of `message()`)

    @property
    def id(self) -> str:
        """The bundle id (= manifest id), as the index's Bundle names it."""
        return self.manifest

    def message(self) -> bytes:
        """The bytes a signature covers: everything but the signatures."""
        return canonical.dumps({
            "schema": SCHEMA, "type": TYPE, "bundle_key": self.bundle_key, "manifest": self.manifest,
            "created_at": _iso(self.created_at), "generation": self.generation,
            "expires": _iso(self.expires) if self.expires else None, "yanked": list(self.yanked),
        })  # fmt: skip

    def to_bytes(self) -> bytes:
        return canonical.dumps({"signed": json.loads(self.message()), "signatures": dict(self.signatures)})

    def expired(self, now: datetime) -> bool:
        return self.expires is not None and self.expires <= now


def yank_key(bundle_id: str) -> str:
    """Marker object of a yanked bundle, so pods that restore through refs see the yank too."""
    return f"yanks/{bundle_id}"


def default_ttl(env: Mapping[str, str] | None = None) -> timedelta:
    """How long a signed ref stays valid: KCACHE_REF_TTL (a duration such as 12h or 7d), else 1 day."""
    text = (os.environ if env is None else env).get(TTL_ENV, "").strip()
    return durations.parse(text, TTL_ENV, positive=True) if text else DEFAULT_TTL


def parse(data: bytes, bundle_key: str) -> Ref:
    try:
        doc = json.loads(data)
        ref = _legacy(doc) if doc.get("schema") == 1 else _from_signed(doc["signed"], doc["signatures"])
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, OverflowError) as exc:
        raise IntegrityError("ref", bundle_key, f"does not parse: {exc}") from None
    if ref.bundle_key != bundle_key:
        raise IntegrityError("ref", bundle_key, f"names bundle key {ref.bundle_key}")
    return ref


def _from_signed(signed: dict, signatures: dict) -> Ref:
    if signed["schema"] != SCHEMA or signed["type"] != TYPE:
        raise ValueError(f"schema {signed['schema']!r} of type {signed['type']!r} is not {SCHEMA} {TYPE}")
    generation = signed["generation"]
    if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
        raise ValueError("generation is not a non-negative integer")
    if not all(isinstance(v, str) for v in signatures.values()):
        raise ValueError("a signature is not a string")
    return Ref(
        _text(signed["bundle_key"]), _hex(signed["manifest"]), _time(signed["created_at"]), generation,
        _time(signed["expires"]) if signed["expires"] is not None else None,
        tuple(_hex(y) for y in signed["yanked"]), tuple(sorted((str(k), v) for k, v in signatures.items())),
    )  # fmt: skip


def _legacy(doc: dict) -> Ref:
    """Schema 1 (kcache before signed refs): unsigned, so a pod requiring signatures refuses it."""
    return Ref(_text(doc["bundle_key"]), _hex(doc["manifest"]), _time(doc["created_at"]))


def _text(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _hex(value) -> str:
    if not isinstance(value, str) or not _HEX64.match(value):
        raise ValueError(f"{value!r} is not a SHA-256 hex digest")
    return value


def _time(value) -> datetime:
    return _utc(datetime.fromisoformat(_text(value)))


def _utc(moment: datetime) -> datetime:
    # The index may hand back naive datetimes (SQLite); they are UTC by kcache's convention.
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment.astimezone(timezone.utc)


def _iso(moment: datetime) -> str:
    return _utc(moment).isoformat()


def read(store: Store, bundle_key: str) -> Ref | None:
    """The ref as the store has it (not yet verified), read with a size cap. One read of one version:
    a size asked first, then that many bytes, tore a ref rewritten in between with another length."""
    got = store.get_versioned(ref_key(bundle_key), limits.REF_BYTES)
    return parse(got[0], bundle_key) if got is not None else None


def advance(store: Store, ref: Ref, *, signer: signing.SigningKey | None = None, ttl: timedelta | None = None,
            index: Index | None = None, now: Callable[[], datetime] | None = None) -> bool:  # fmt: skip
    """Point the ref at `ref.manifest` unless it already names a newer bundle. True if it was written.

    With a signer, a ref that already names this bundle is re-signed when it is unsigned by this
    key or past half its lifetime, so a fleet that keeps publishing keeps its ref fresh. With
    `index`, the bundle and the key's yank list are read from it again on every attempt: a yank
    that landed since `ref` was made must not be overwritten by a ref naming the yanked bundle;
    nor is a bundle that is not the key's newest written: a ref a store writer removed, or made
    unreadable or dated ahead of every clock, holds nothing off, and a re-publish of an older
    bundle's files signed a fresh ref to it (a rollback past the TTL). `refresh` writes the newest.
    `now` (default: `index`'s clock, else this host's) judges whether the current ref is from the future.
    """

    def wanted() -> Ref | None:
        if index is None:
            return _unyanked(ref)
        newest = index.newest_bundle(ref.bundle_key)
        return _unyanked(for_bundle(index, ref.manifest)) if newest is not None and newest.id == ref.manifest else None

    clock = now or (index.now if index is not None else None)
    return advance_chosen(store, ref.bundle_key, wanted, signer=signer, ttl=ttl, now=clock)


def _unyanked(ref: Ref) -> Ref | None:
    """`ref`, or None when its own yank list names its bundle: a signed ref must never name a yanked bundle."""
    return None if ref.manifest in ref.yanked else ref


def advance_chosen(store: Store, name: str, choose: Callable[[], Ref | None], *,
                   signer: signing.SigningKey | None = None, ttl: timedelta | None = None,
                   now: Callable[[], datetime] | None = None) -> bool:  # fmt: skip
    """`advance` to whatever `choose()` gives (None: nothing to write), asked again on every attempt.

    For a ref the index cannot answer with `for_bundle` (a layer ref names a bundle of another key
    than its own name): `choose` reads the index itself, so a bundle yanked since is not written.
    Whether the current ref is from the future is judged by `now`: the clock that stamps created_at
    (the index's) where the caller has it, since a writer whose own clock runs behind took the newest
    bundle's ref for a fast clock's and rolled it back to an older bundle.
    """
    ttl = ttl or default_ttl()

    def decide(current: Ref | None):
        wanted = choose()
        if wanted is None:
            return _KEEP
        if current is None:
            return wanted
        if from_the_future(current, now):
            log.warning("replacing %s: its created_at %s is ahead of this clock by more than %s",
                        ref_key(name), _utc(current.created_at).isoformat(), MAX_CLOCK_SKEW)  # fmt: skip
            return wanted
        if (_utc(current.created_at), current.manifest) > (_utc(wanted.created_at), wanted.manifest):
            return _KEEP
        if current.manifest == wanted.manifest and not _stale(current, wanted, signer, ttl):
            return _KEEP
        return wanted

    return _write(store, name, decide, signer, ttl) is not _KEEP


def from_the_future(current: Ref, now: Callable[[], datetime] | None = None) -> bool:
    """Dated more than MAX_CLOCK_SKEW ahead of `now()` (default this host's clock): a fast clock's (or
    a forger's) ref."""
    return _utc(current.created_at) > _utc((now or _host_now)()) + MAX_CLOCK_SKEW


def _host_now() -> datetime:
    return datetime.now(timezone.utc)


def repoint(store: Store, bundle_key: str, away_from: str, to: Ref | None, *,
            signer: signing.SigningKey | None = None, ttl: timedelta | None = None,
            index: Index | None = None) -> bool:  # fmt: skip
    """Move a ref that names `away_from` (yanked or deleted) to `to`, or remove it when `to` is None.

    Unlike `advance` this may move backwards in time; it only acts while the ref still names
    `away_from`, so a publish that moved it meanwhile wins. True if it wrote or removed the ref;
    after a removal a publish's ref may have gone with it (a delete is unconditional), so the
    caller puts the index's newest back (see gc._ref_back). With `index`, `to` and the key's yank
    list are read from it again on every attempt, as `advance` does: a `to` yanked (or deleted)
    since it was chosen makes this a removal, never a ref naming it.
    """

    def wanted() -> Ref | None:
        if index is None or to is None:
            return to
        try:
            return _unyanked(for_bundle(index, to.manifest))
        except NotFound:
            return None

    return repoint_chosen(store, bundle_key, away_from, wanted, signer=signer, ttl=ttl)


def repoint_chosen(store: Store, name: str, away_from: str, choose: Callable[[], Ref | None], *,
                   signer: signing.SigningKey | None = None, ttl: timedelta | None = None) -> bool:  # fmt: skip
    """`repoint` to whatever `choose()` gives (None: remove the ref), asked again on every attempt
    while the ref still names `away_from`; for refs `for_bundle` cannot answer (layer refs)."""

    def decide(current: Ref | None):
        if current is None or current.manifest != away_from:
            return _KEEP
        return choose()

    return _write(store, name, decide, signer, ttl or default_ttl()) is not _KEEP


def refresh(store: Store, index: Index, bundle_key: str, *, signer: signing.SigningKey | None = None,
            ttl: timedelta | None = None) -> Ref | None:  # fmt: skip
    """Rewrite the ref from the index: its newest active bundle and its yank list, re-signed.

    What the ref named before does not matter (a writer without keys may have pointed it
    anywhere); only its generation is carried forward. No active bundle: the ref is removed.
    Without `signer`, a signed ref is left as it is (with a warning when it is behind the index):
    only its signer may rewrite what pods requiring signatures follow.
    """

    def decide(current: Ref | None):
        newest = index.newest_bundle(bundle_key)
        wanted = for_bundle(index, newest.id) if newest else None
        if signer is None and current is not None and current.signatures:
            if wanted is None or current.manifest != wanted.manifest or current.yanked != wanted.yanked:
                # Written unsigned, it would send every pod requiring signatures cold. Yank markers
                # still stop a yanked bundle meanwhile; the signer's next write brings the list up.
                log.warning("refs/%s is signed (by %s): left as it is; run `kcache refresh --signing-key KEY` "
                            "to write what the index holds now", bundle_key,
                            ", ".join(name for name, _ in current.signatures))  # fmt: skip
            return _KEEP
        return wanted

    written = _write(store, bundle_key, decide, signer, ttl or default_ttl())
    return None if written is _KEEP else written


def for_bundle(index: Index, bundle_id: str) -> Ref:
    """An unstamped ref naming this bundle as the index has it, with the key's yank list."""
    bundle = index.get_bundle(bundle_id)
    return Ref(bundle.bundle_key, bundle.id, _utc(bundle.created_at), yanked=yanked_in(index, bundle.bundle_key))


def yanked_in(index: Index, bundle_key: str) -> tuple[str, ...]:
    """The key's yanked bundles: rows yanked, and yanked bundles gc deleted (a signed copy of one may
    be put back in the store; only this list stops a pod pinned to it that trusts no marker)."""
    from kcache.index import lifecycle

    rows = index.list_bundles(bundle_key=bundle_key, limit=_YANK_SCAN)
    yanked = [b.id for b in rows if b.bundle_key == bundle_key and b.status == "yanked"]  # newest first
    room = _YANK_LIST - len(yanked)
    if room > 0:  # bundles whose rows exist first: only a yank stops them; then the newest gc deleted
        yanked += lifecycle.yanked_gone(index, bundle_key, room)
    return tuple(sorted(set(yanked[:_YANK_LIST])))


def _stale(current: Ref, wanted: Ref, signer: signing.SigningKey | None, ttl: timedelta) -> bool:
    if current.yanked != wanted.yanked:
        return True
    if signer is None:
        return False  # an unsigned publish never strips a signature from the same bundle
    left = (current.expires - datetime.now(timezone.utc)) if current.expires else timedelta(0)
    return signer.name not in dict(current.signatures) or left < ttl / 2


def _write(store: Store, bundle_key: str, decide: Callable, signer, ttl: timedelta):
    """Compare-and-swap loop: `decide(current)` gives the new ref, None (remove) or _KEEP.

    Returns the ref written, None when it was removed (even if another writer's ref is there by
    now: the one it replaced may have gone with ours), or _KEEP when nothing changed.
    """
    key = ref_key(bundle_key)
    removed = False
    for _ in range(_CAS_ATTEMPTS):
        current, version = _load(store, key, bundle_key)
        draft = decide(current)
        if draft is _KEEP or (draft is None and version is None):
            return None if removed else _KEEP
        if draft is None:
            # A delete cannot be conditional on the version read: decide again after it, so that
            # a publish whose ref went in between (and was deleted) gets its ref back.
            store.delete(key)
            removed = True
            continue
        stamped = _stamp(draft, current, signer, ttl)
        if store.put_if(key, stamped.to_bytes(), version):
            return stamped
    log.warning("gave up moving %s after %d contended attempts", key, _CAS_ATTEMPTS)
    return None if removed else _KEEP


def _load(store: Store, key: str, bundle_key: str) -> tuple[Ref | None, str | None]:
    """The current ref and its version. An unreadable ref is replaced rather than obeyed."""
    try:
        current = store.get_versioned(key, limits.REF_BYTES)
    except ObjectTooLarge as exc:  # hostile: too big to read for its version, so remove it and start over
        log.warning("removing %s: %s", key, exc)
        store.delete(key)
        return None, None
    if current is None:
        return None, None
    try:
        return parse(current[0], bundle_key), current[1]
    except IntegrityError as exc:
        log.warning("replacing a ref that cannot be read: %s", exc)
        return None, current[1]


def _stamp(draft: Ref, current: Ref | None, signer, ttl: timedelta) -> Ref:
    now = datetime.now(timezone.utc)
    # Never below the clock (in ms): a replayed old ref in the store cannot pull the next one back.
    # A generation past the clock's bound is a fast clock's or a forger's: carried, it would be
    # re-signed forever (or, past 4300 digits, make every write fail), so the clock restarts it.
    clock = int(now.timestamp() * 1000)
    bound = clock + int(MAX_CLOCK_SKEW.total_seconds() * 1000)
    carried = current.generation + 1 if current and current.generation < bound else 0
    generation = max(carried, clock)
    ref = replace(draft, generation=generation, signatures=(), expires=now + ttl if signer else None)
    if signer is None:
        return ref
    return replace(ref, signatures=((signer.name, signing.sign_message(signer, ref.message())),))


def refresh_all(store: Store, index: Index, *, bundle_keys=(), model: str | None = None,
                signer: signing.SigningKey | None = None, ttl: timedelta | None = None,
                failed: dict[str, KcacheError] | None = None) -> dict:  # fmt: skip
    """{bundle key: `refresh`} for the named keys, else for every key the index holds (of `model`, if given).

    With `failed`, a key whose refresh raises is recorded there and the rest are refreshed: one key's
    damaged row (or a ref the store will not take) must not leave every key after it to expire. Keys
    failing _FAILED_IN_A_ROW times in a row end it with the first of those errors: an index or store
    gone away fails every key, each after its own timeouts."""
    from kcache.index import lifecycle

    if not bundle_keys:
        bundle_keys = lifecycle.bundle_keys(index, model)
    done, in_a_row = {}, []
    for key in bundle_keys:
        try:
            done[key] = refresh(store, index, key, signer=signer, ttl=ttl)
            in_a_row = []
        except KcacheError as exc:
            in_a_row.append(exc)
            if failed is None or len(in_a_row) >= _FAILED_IN_A_ROW:
                raise in_a_row[0] from None
            log.warning("cannot refresh refs/%s: %s", key, exc)
            failed[key] = exc
    return done


class RefCatalog:
    """The part of the index restore needs, answered from refs: for pods without SQL access."""

    def __init__(self, store: Store):
        self.store = store

    def newest_bundle(self, bundle_key: str) -> Ref | None:
        """The ref, unverified: restore checks its signature, expiry and the yank marker."""
        return read(self.store, bundle_key)

    def newest_for_toolchain(self, toolchain_key: str) -> None:
        """Refs are per bundle key: a pod without the index cannot look for a partial hit."""
        return None

    def record_event(self, event) -> None:
        """Refs keep no statistics; a pod without the index has nowhere to record them."""

    def close(self) -> None:
        pass
