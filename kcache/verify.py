"""Verify: every bundle's manifest parses and hashes to its id, its signatures hold, and every blob
it names is there.

Without --read-data, each pack a manifest names must exist under the key restore reads it from,
packs/<hh>/<id>, and be long enough for every blob range in it (one listing of packs/, no data read).
Every signature object of a bundle (one listing of signatures/, each read capped as restore reads
it) must be an Ed25519 signature; one by a trusted key (--trusted-key) must verify, and with trusted
keys a bundle none of them signed is a problem too (restore --require-signature refuses it).

With --read-data, every blob is fetched the way restore fetches it and re-hashed, each copy in each
pack that holds it; `--subset n/t` reads only the packs whose id falls in the n-th of t slices, so a
large store can be checked a slice a night.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kcache import fetch, limits, progress, signing
from kcache import manifest as manifests
from kcache.errors import ConfigError, KcacheError, ObjectMissing, SignatureError
from kcache.packs import unpack_frame
from kcache.store import Store, manifest_key, pack_key
from kcache.store.base import ObjectInfo
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
    trusted: tuple[signing.TrustedKey, ...] = (),
) -> VerifyResult:
    """Check every bundle (see the module docstring); `report` receives --read-data's progress;
    signatures by `trusted` keys must verify, and each bundle needs one when any are given."""
    from kcache.index import lifecycle

    problems: list[str] = []
    # By the whole key: a pack restore cannot find at packs/<hh>/<id> is missing, whatever lies elsewhere.
    sizes = {info.key: info.size for info in store.list("packs/")}
    signatures = _signatures(store)
    bundles = lifecycle.all_bundles(index)
    # Every stored copy, not every blob: restore of a bundle reads the copy in the pack its manifest
    # names, so a bad copy fails that bundle even where another pack holds the blob intact.
    to_read: dict[tuple[str, str, int], manifests.Entry] = {}
    for bundle in bundles:
        try:
            manifest, manifest_size = _fetch_manifest(store, bundle.id)
        except KcacheError as exc:
            problems.append(f"bundle {bundle.id[:12]}: {exc}")
            continue
        signed = signing.message(manifest.bundle_key, bundle.id, manifest_size)
        for problem in _signature_problems(store, signatures.get(bundle.id, {}), signed, trusted):
            problems.append(f"bundle {bundle.id[:12]}: {problem}")
        for entry in manifest.entries:
            size = sizes.get(pack_key(entry.pack))
            if size is None:
                problems.append(f"bundle {bundle.id[:12]}: {entry.path}: pack {entry.pack[:12]} is missing")
            elif entry.offset + entry.length > size:
                problems.append(f"bundle {bundle.id[:12]}: {entry.path}: pack {entry.pack[:12]} is too short")
            elif read_data and in_subset(entry.pack, subset):
                to_read.setdefault((entry.blob, entry.pack, entry.offset), entry)
    read = _read_all(store, list(to_read.values()), jobs, problems, report) if read_data else (0, 0)
    packs = len({e.pack for e in to_read.values()}) if read_data else len(sizes)
    return VerifyResult(len(bundles), packs, read[0], read[1], tuple(dict.fromkeys(problems)))


def _fetch_manifest(store: Store, manifest_id: str) -> tuple[manifests.Manifest, int]:
    """The manifest, as manifests.fetch reads it, and its size in the store (what a signature covers)."""
    key = manifest_key(manifest_id)
    data = limits.read_capped(store, key, limits.max_manifest_bytes(), "manifest")
    if data is None:
        raise ObjectMissing(store.url, key)
    return manifests.parse(data, manifest_id), len(data)


def _signatures(store: Store) -> dict[str, dict[str, ObjectInfo]]:
    """{manifest id: {key name: object}} from one listing of signatures/<manifest-id>/<key name>."""
    found: dict[str, dict[str, ObjectInfo]] = {}
    for info in store.list("signatures/"):
        parts = info.key.split("/")
        if len(parts) == 3:
            found.setdefault(parts[1], {})[parts[2]] = info
    return found


def _signature_problems(store: Store, present: Mapping[str, ObjectInfo], signed: bytes,
                        trusted: tuple[signing.TrustedKey, ...]) -> list[str]:  # fmt: skip
    """What is wrong with one bundle's signatures: each is read as restore reads it (capped); one by
    a trusted key must verify `signed`, any other must at least be an Ed25519 signature (its public
    key is not here to verify it); with trusted keys, one of them must have signed."""
    by_name = {key.name: key for key in trusted}
    problems, verified, refused = [], False, False  # refused: a trusted key's signature is there but bad
    for name in sorted(present):
        try:
            raw = limits.read_capped(store, present[name].key, limits.SIGNATURE_BYTES, "signature")
        except KcacheError as exc:  # ObjectTooLarge, a read that failed: restore would fail alike
            problems.append(f"the signature by {name!r}: {exc}")
            refused = refused or name in by_name
            continue
        if raw is None:  # deleted since the listing (gc of a deleted bundle)
            continue
        text = raw.decode("ascii", "replace")  # as signing.verify reads it
        if name in by_name:
            try:
                signing.check((by_name[name],), {name: text}, signed, "")  # it is there: verifies or raises
                verified = True
            except SignatureError as exc:
                problems.append(exc.why)
                refused = True
        elif not _is_signature(text):
            problems.append(f"the signature by {name!r} is no Ed25519 signature (64 bytes in base64)")
    if trusted and not verified and not refused:
        problems.append(f"not signed by a trusted key ({', '.join(sorted(by_name))})")
    return problems


def _is_signature(text: str) -> bool:
    try:
        return len(base64.b64decode(text, validate=True)) == 64
    except (ValueError, binascii.Error):
        return False


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
