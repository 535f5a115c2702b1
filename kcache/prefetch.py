"""Prefetch: keep the packs of named bundles in a node cache before any pod on the node asks for them.

For each target (a fingerprint, or a bare bundle key) the bundle is chosen exactly as restore would
choose it (kcache.choice: the catalog's answer, ref signatures and expiry, yanks, the manifest's
size and signature), so a node never warms what its pods would refuse; then every pack the manifest
names is warmed in the node cache (kcache.store.nodecache), which verifies each against its id.
A target without a bundle yet is a miss, not an error: the first pod publishes it.

A DaemonSet lives for months beside pods that come and go: no lock one of them holds (a frozen
pod, or a hostile one that can write the node directory) may stop it. Each pack's warm and the
round's trim wait at most LOCK_WAIT for their locks; a pack still locked then is this round's
error for its target, and the next round tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kcache import choice, fetch
from kcache.errors import KcacheError
from kcache.fingerprint import Fingerprint
from kcache.progress import Meter, Report
from kcache.store import Store
from kcache.store.nodecache import NodeCacheStore

log = logging.getLogger(__name__)

# As long as restore's default --timeout: a pod's fill that holds a pack's lock longer is stuck.
LOCK_WAIT = 300.0


@dataclass(frozen=True)
class Target:
    """What to prefetch: `name` for humans (a model id or the key), the fingerprint to pick a bundle by."""

    name: str
    fingerprint: Fingerprint


@dataclass(frozen=True)
class Prefetched:
    target: str
    bundle_key: str
    status: str  # cached | miss | error | stopped
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


def prefetch(store: Store, index, cache: NodeCacheStore, targets: tuple[Target, ...], policy: choice.Policy, *,
             jobs: int = 4, stop: threading.Event | None = None,
             report: Report | None = None) -> tuple[Prefetched, ...]:  # fmt: skip
    """Warm each target's packs in `cache`; one outcome per target (errors are outcomes, not raised).
    `report` hears each target's progress (kcache.progress), a pack at a time."""
    stop = stop or threading.Event()
    results = []
    for target in targets:
        try:
            results.append(_one(store, index, cache, target, policy, jobs, stop, report))
        except KcacheError as exc:
            log.warning("prefetch of %s failed: %s", target.name, exc)
            results.append(Prefetched(target.name, target.fingerprint.bundle_key, "error", reason=str(exc), error=exc))
    cache.trim(wait=LOCK_WAIT)
    return tuple(results)


def _one(store, index, cache, target: Target, policy, jobs: int, stop: threading.Event,
         report: Report | None = None) -> Prefetched:  # fmt: skip
    fp = target.fingerprint
    if fp.mismatches:  # as restore: the facts file describes another kind of node
        return Prefetched(target.name, fp.bundle_key, "miss", reason=fp.mismatch_reason())
    chosen = choice.pick(store, index, fp, None, None, policy)
    if isinstance(chosen, str):
        return Prefetched(target.name, fp.bundle_key, "miss", reason=chosen)
    manifest, _signer, _size = choice.read_manifest(store, chosen, fp, policy)
    needs = fetch.pack_extents(manifest.entries)
    packs = sorted(needs)
    started = time.perf_counter()
    meter = Meter(f"prefetching {target.name}", files=len(packs), bytes=sum(needs.values()), report=report,
                  unit="packs")  # fmt: skip

    def warm(pack_id: str):
        if stop.is_set():
            return None
        warmed = cache.warm(pack_id, needs[pack_id], wait=LOCK_WAIT)
        meter.add(files=1, bytes=needs[pack_id])
        return warmed

    with meter, ThreadPoolExecutor(max_workers=max(1, jobs), thread_name_prefix="kcache-prefetch") as pool:
        warmed = list(pool.map(warm, packs))
    done = [w for w in warmed if w is not None]
    fetched = [w for w in done if w.fetched]
    log.info("prefetch of %s: %d packs (%d fetched) in %.2fs", target.name, len(packs), len(fetched),
             time.perf_counter() - started)  # fmt: skip
    return Prefetched(
        target.name, fp.bundle_key, "stopped" if len(done) < len(packs) else "cached", manifest.id, len(packs),
        len(fetched), sum(w.bytes for w in done), sum(w.bytes for w in fetched),
    )  # fmt: skip
