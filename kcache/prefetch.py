"""Prefetch: keep the packs of named bundles in a node cache before any pod on the node asks for them.

For each target (a fingerprint, or a bare bundle key) the bundle is chosen exactly as restore would
choose it (kcache.choice: the catalog's answer, ref signatures and expiry, yanks, the manifest's
size and signature), so a node never warms what its pods would refuse; then every pack the manifest
names is warmed in the node cache (kcache.store.nodecache), which verifies each against its id.
A target without a bundle yet is a miss, not an error: the first pod publishes it.

Targets are fitted under the cap (--max-bytes) in their order, by the bytes their manifests name,
before anything is fetched: one that does not fit beside those before it is over_cap, an error
outcome, and nothing of it is fetched. Packs a round warmed are not evicted by that round: under a
cap too small, a round had evicted what it had just warmed, reported every target cached, and
fetched it all again each round.

A DaemonSet lives for months beside pods that come and go: no lock one of them holds (a frozen
pod, or a hostile one that can write the node directory) may stop it. A target's warm (all its
packs' locks together) and the round's trim wait at most LOCK_WAIT for their locks; a pack still
locked then is this round's error for its target, and the next round tries again.

Nor may a store or an index that answers too slowly: choosing a target's bundle (the catalog's
answer, a ref, the manifest) runs on a thread of its own and is waited for at most `lookup_timeout`
(LOOKUP_TIMEOUT); past it the target is this round's LookupTimeout. A store that trickles bytes,
which no socket read timeout catches, had held a round for ever. The look-up runs on until the store
lets go, and `Lookups` (one for the DaemonSet's life) starts no second one for that target while it
does: the next rounds report it still running, where each had left one more thread behind.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

from kcache import choice, fetch
from kcache.errors import KcacheError, LookupTimeout, NodeCacheFull, RootError
from kcache.fingerprint import Fingerprint
from kcache.progress import Meter, Report
from kcache.store import Store
from kcache.store.nodecache import NodeCacheStore

log = logging.getLogger(__name__)

# As long as restore's default --timeout: a pod's fill that holds a pack's lock longer is stuck.
LOCK_WAIT = 300.0
# As long as restore's default --timeout too: a look-up slower than that fails every pod's restore on
# the node, so there is nothing to warm for them (`--lookup-timeout`).
LOOKUP_TIMEOUT = 300.0
_STOP_SLICE = 0.1  # how often a wait for a look-up looks at the stop event


@dataclass(frozen=True)
class Target:
    """What to prefetch: `name` for humans (a model id or the key), the fingerprint to pick a bundle by."""

    name: str
    fingerprint: Fingerprint


@dataclass(frozen=True)
class Prefetched:
    target: str
    bundle_key: str
    status: str  # cached | miss | over_cap | error | stopped
    bundle_id: str | None = None
    packs: int = 0
    fetched: int = 0  # packs downloaded by this run (the rest were cached and verified)
    bytes: int = 0  # bytes of all the bundle's packs
    fetched_bytes: int = 0
    reason: str = ""
    error: KcacheError | None = None


def bundle_key_target(bundle_key: str) -> Target:
    """A target named by its bundle key alone (`--bundle-key`): no facts to probe or compare."""
    return Target(bundle_key, Fingerprint(facts={}, toolchain_key="", workload_key="", bundle_key=bundle_key))


class Lookups:
    """The look-ups of a long-lived prefetch that outlived their round's wait, by target: at most one
    runs per target (pass the same Lookups to every round)."""

    def __init__(self):
        self._guard = threading.Lock()
        self._running: dict[tuple[str, str], float] = {}  # (name, bundle key) -> when its look-up started

    def run(self, target: Target, fn, timeout: float | None, stop: threading.Event | None = None):
        """`fn()`'s result, waited for at most `timeout` seconds; LookupTimeout past it, or at once while
        an earlier look-up of the target still runs. None once `stop` is set (SIGTERM): the kubelet's
        grace period is no time to wait out a look-up in."""
        if timeout is None:
            return fn()
        key = (target.name, target.fingerprint.bundle_key)
        with self._guard:
            since = self._running.get(key)
            if since is None:
                self._running[key] = time.monotonic()
        if since is not None:
            raise LookupTimeout(target.name, timeout, f"is still running, {time.monotonic() - since:.0f} s after "
                                                      "an earlier round started it; not started again")  # fmt: skip
        box: dict = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["result"] = fn()
            except BaseException as exc:  # handed to the waiter, if it still waits
                box["error"] = exc
            finally:
                with self._guard:
                    self._running.pop(key, None)
                done.set()

        threading.Thread(target=run, name="kcache-prefetch-lookup", daemon=True).start()
        until = time.monotonic() + timeout
        # In slices, to hear `stop`: one Event cannot be waited for together with another.
        while not done.wait(max(0.0, min(_STOP_SLICE, until - time.monotonic()))):
            if stop is not None and stop.is_set():
                return None
            if time.monotonic() >= until:
                break
        if not done.is_set():
            raise LookupTimeout(target.name, timeout, f"took more than {timeout:g} s (--lookup-timeout)")
        if "error" in box:
            raise box["error"]
        return box["result"]


def prefetch(store: Store, index, cache: NodeCacheStore, targets: tuple[Target, ...], policy: choice.Policy, *,
             jobs: int = 4, stop: threading.Event | None = None, report: Report | None = None,
             lookup_timeout: float | None = LOOKUP_TIMEOUT, lookups: Lookups | None = None,
             ) -> tuple[Prefetched, ...]:  # fmt: skip
    """Warm each target's packs in `cache`; one outcome per target (errors are outcomes, not raised).
    `report` hears each target's progress (kcache.progress), a pack at a time. Targets are fitted
    under the cap in their order before anything is fetched (`_fit`); what this round warmed, its
    own later fills and trim do not evict. Choosing each target's bundle takes at most
    `lookup_timeout` seconds (None: no limit); `lookups` carries the look-ups still running from one
    round to the next."""
    stop = stop or threading.Event()
    lookups = lookups or Lookups()
    chosen = [_choose(store, index, target, policy, lookups, lookup_timeout, stop) for target in targets]
    planned = _fit(chosen, cache)
    outcomes: list[tuple[Prefetched, dict[str, int]]] = []
    kept: set[str] = set()
    with cache.keeping(kept):
        for item in planned:
            if isinstance(item, _Chosen):
                kept.update(item.needs)
                outcomes.append((_guarded(item.target, partial(_warm, cache, item, jobs, stop, report)), item.needs))
            else:
                outcomes.append((item, {}))
        try:
            cache.trim(wait=LOCK_WAIT)
        except KcacheError as exc:  # the round's outcomes stand: the next round trims again
            log.warning("prefetch: trimming the node cache failed: %s", exc)
    return tuple(_still_held(cache, result, needs) for result, needs in outcomes)


@dataclass(frozen=True)
class _Chosen:
    """A target's bundle, chosen, and what it needs of each pack (the largest offset+length named)."""

    target: Target
    bundle_id: str
    needs: dict[str, int]


def _guarded(target: Target, fn):
    try:
        return fn()
    except KcacheError as exc:
        log.warning("prefetch of %s failed: %s", target.name, exc)
        return Prefetched(target.name, target.fingerprint.bundle_key, "error", reason=str(exc), error=exc)


def _choose(store, index, target: Target, policy, lookups: Lookups, timeout: float | None,
            stop: threading.Event) -> _Chosen | Prefetched:  # fmt: skip
    def pick() -> _Chosen | Prefetched:
        fp = target.fingerprint
        if fp.mismatches:  # as restore: the facts file describes another kind of node
            return Prefetched(target.name, fp.bundle_key, "miss", reason=fp.mismatch_reason())
        chosen = choice.pick(store, index, fp, None, None, policy)
        if isinstance(chosen, str):
            return Prefetched(target.name, fp.bundle_key, "miss", reason=chosen)
        manifest, _signer, _size = choice.read_manifest(store, chosen, fp, policy)
        return _Chosen(target, manifest.id, fetch.pack_extents(manifest.entries))

    if not stop.is_set():
        chosen = _guarded(target, partial(lookups.run, target, pick, timeout, stop))
        if chosen is not None:
            return chosen
    return Prefetched(target.name, target.fingerprint.bundle_key, "stopped", reason="stopped before its bundle "
                      "was chosen")  # fmt: skip


def _fit(chosen: list[_Chosen | Prefetched], cache: NodeCacheStore) -> list[_Chosen | Prefetched]:
    """Each target whose packs fit under the cap beside those of the targets before it (a pack two
    share counts once), weighed by the bytes its manifest names; the others over_cap, not fetched: under
    a cap too small, a round had evicted what it had just warmed, and fetched it all again every round."""
    taken: dict[str, int] = {}
    planned: list[_Chosen | Prefetched] = []
    for item in chosen:
        if isinstance(item, _Chosen):
            more = {pack: need for pack, need in item.needs.items() if pack not in taken}
            if sum(taken.values()) + sum(more.values()) > cache.max_bytes:
                planned.append(_over_cap(item, cache, sum(taken.values())))
                continue
            taken.update(more)
        planned.append(item)
    return planned


def _over_cap(item: _Chosen, cache: NodeCacheStore, taken: int) -> Prefetched:
    size = sum(item.needs.values())
    why = (f"its packs need {size} bytes; the cap is {cache.max_bytes}"
           + (f", {taken} of which the targets before it take" if taken else "") + ": not prefetched")  # fmt: skip
    log.warning("prefetch of %s: %s", item.target.name, why)
    return Prefetched(item.target.name, item.target.fingerprint.bundle_key, "over_cap", item.bundle_id,
                      len(item.needs), bytes=size, reason=why,
                      error=NodeCacheFull(str(cache.directory), why))  # fmt: skip


def _still_held(cache: NodeCacheStore, result: Prefetched, needs: dict[str, int]) -> Prefetched:
    """A target reported cached has every pack in the node cache once the round is over: a peer's
    fills (or removals) may have taken some meanwhile."""
    gone = [pack for pack in needs if not cache.holds(pack)] if result.status == "cached" else []
    if not gone:
        return result
    why = f"{len(gone)} of its {len(needs)} packs left the node cache during the round (other fills on the node)"
    return replace(result, status="error", reason=why, error=RootError(str(cache.directory), why))


def _warm(cache: NodeCacheStore, item: _Chosen, jobs: int, stop: threading.Event,
          report: Report | None = None) -> Prefetched:  # fmt: skip
    target, needs = item.target, item.needs
    packs = sorted(needs)
    started = time.perf_counter()
    meter = Meter(f"prefetching {target.name}", files=len(packs), bytes=sum(needs.values()), report=report,
                  unit="packs")  # fmt: skip

    # One wait for the target's locks, not one a pack: a frozen pod holding every lock of a target's
    # packs held the round (and the targets after it) LOCK_WAIT a pack, 25 waits for 100 packs and 4 jobs.
    until = time.monotonic() + LOCK_WAIT

    def warm(pack_id: str):
        if stop.is_set():
            return None
        warmed = cache.warm(pack_id, needs[pack_id], wait=max(0.0, until - time.monotonic()))
        meter.add(files=1, bytes=needs[pack_id])
        return warmed

    # Every pack is tried before a failure is the target's outcome: pool.map would cancel those not yet
    # started at the first that raised, and one bad copy in the node cache kept the rest out of it.
    with meter, ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="kcache-prefetch") as pool:
        futures = [pool.submit(warm, pack) for pack in packs]
    warmed = [future.result() for future in futures]
    done = [w for w in warmed if w is not None]
    fetched = [w for w in done if w.fetched]
    log.info("prefetch of %s: %d packs (%d fetched) in %.2fs", target.name, len(packs), len(fetched),
             time.perf_counter() - started)  # fmt: skip
    return Prefetched(
        target.name, target.fingerprint.bundle_key, "stopped" if len(done) < len(packs) else "cached", item.bundle_id,
        len(packs), len(fetched), sum(w.bytes for w in done), sum(w.bytes for w in fetched),
    )  # fmt: skip
