"""Verify: every bundle's manifest parses and hashes to its id, and every blob it names is there.

Without --read-data, each pack a manifest names must exist and be long enough for every blob
range in it (one listing of packs/, no data read). With --read-data, every blob is fetched the
way restore fetches it and re-hashed, each copy in each pack that holds it; `--subset n/t` reads
only the packs whose id falls in the n-th of t slices, so a large store can be checked a slice a
night.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kcache import fetch, progress
from kcache import manifest as manifests
from kcache.errors import ConfigError, KcacheError
from kcache.packs import unpack_frame
from kcache.store import Store
from kcache.streams import Discard

if TYPE_CHECKING:
    from kcache.index import Index


@dataclass(frozen=True)
class VerifyResult:
    bundles: int
    packs: int
    blobs_read: int
    bytes_read: int
    problems: tuple[str, ...]


def parse_subset(text: str) -> tuple[int, int]:
    """'n/t' with 1 <= n <= t."""
    try:
        n, t = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError("--subset", text, "expected n/t, e.g. 1/7") from None
    if not 1 <= n <= t:
        raise ConfigError("--subset", text, "needs 1 <= n <= t")
    return n, t


def in_subset(pack_id: str, subset: tuple[int, int]) -> bool:
    n, t = subset
    return int(pack_id[:8], 16) % t == n - 1


def verify(
    store: Store,
    index: Index,
    *,
    read_data: bool = False,
    subset: tuple[int, int] = (1, 1),
    jobs: int = 16,
    report: progress.Report | None = None,
) -> VerifyResult:
    """Check every bundle (see the module docstring); `report` receives --read-data's progress."""
    from kcache.index import lifecycle

    problems: list[str] = []
    sizes = {info.key.rsplit("/", 1)[-1]: info.size for info in store.list("packs/")}
    bundles = lifecycle.all_bundles(index)
    # Every stored copy, not every blob: restore of a bundle reads the copy in the pack its manifest
    # names, so a bad copy fails that bundle even where another pack holds the blob intact.
    to_read: dict[tuple[str, str, int], manifests.Entry] = {}
    for bundle in bundles:
        try:
            manifest = manifests.fetch(store, bundle.id)
        except KcacheError as exc:
            problems.append(f"bundle {bundle.id[:12]}: {exc}")
            continue
        for entry in manifest.entries:
            size = sizes.get(entry.pack)
            if size is None:
                problems.append(f"bundle {bundle.id[:12]}: {entry.path}: pack {entry.pack[:12]} is missing")
            elif entry.offset + entry.length > size:
                problems.append(f"bundle {bundle.id[:12]}: {entry.path}: pack {entry.pack[:12]} is too short")
            elif read_data and in_subset(entry.pack, subset):
                to_read.setdefault((entry.blob, entry.pack, entry.offset), entry)
    read = _read_all(store, list(to_read.values()), jobs, problems, report) if read_data else (0, 0)
    packs = len({e.pack for e in to_read.values()}) if read_data else len(sizes)
    return VerifyResult(len(bundles), packs, read[0], read[1], tuple(dict.fromkeys(problems)))


def _read_all(store: Store, entries: list[manifests.Entry], jobs: int, problems: list[str],
              report: progress.Report | None = None) -> tuple[int, int]:  # fmt: skip
    """Re-hash every blob; a bad one is a problem, and the rest of its pack is still read."""
    lock = threading.Lock()
    done = {"blobs": 0, "bytes": 0}
    meter = progress.Meter("verifying", files=len(entries), bytes=sum(e.size for e in entries), report=report)

    def check(entry: manifests.Entry, frame) -> None:
        try:
            unpack_frame(frame, entry.blob, entry.size, Discard())
        except KcacheError as exc:
            with lock:
                problems.append(f"pack {entry.pack[:12]}: {entry.path}: {exc}")
            return
        finally:
            meter.add(files=1, bytes=entry.size)  # checked, good or bad
        with lock:
            done["blobs"] += 1
            done["bytes"] += entry.size

    def one_range(rng: fetch.Range) -> None:  # each on its own, so one bad pack does not hide the others
        try:
            fetch.read_range(store, rng, check, cancelled=lambda: False)
        except KcacheError as exc:
            with lock:
                problems.append(f"pack {rng.pack[:12]}: {exc}")

    with meter, ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one_range, fetch.plan_ranges(entries)))
    return done["blobs"], done["bytes"]
