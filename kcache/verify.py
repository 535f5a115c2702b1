"""Verify: every bundle's manifest parses and hashes to its id, its signatures hold, and every blob
it names is there.

Without --read-data, each pack a manifest names must exist under the key restore reads it from,
packs/<hh>/<id>, and be long enough for every blob range in it (one listing of packs/, no data read).
An object a listing lacks is asked for by its key before it is called missing, as is the signatures
listing of a bundle it lacks under trusted keys: a publish may have written it since, and committed
its bundle or moved its ref before verify got there (a sound store was reported damaged). A bundle
whose manifest is gone with its row was deleted by gc after the rows were read: no damage either.
Every signature object of a bundle (one listing of signatures/, each read capped as restore reads
it) must be an Ed25519 signature; one by a trusted key (--trusted-key) must verify, and with trusted
keys a bundle none of them signed is a problem too (restore --require-signature refuses it).

With --read-data, every blob is fetched the way restore fetches it and re-hashed, each copy in each
pack that holds it; `--subset n/t` reads only the packs whose id falls in the n-th of t slices, so a
large store can be checked a slice a night.

Every refs/<bundle-key> is checked as a pod restoring with `--index none` would follow it. Each ref is read capped
(limits.REF_BYTES) and must parse for its key; with trusted keys it must be signed by one, verify
and be unexpired (restore --require-signature refuses it otherwise); its signatures must be
Ed25519 signatures; and the bundle it names must have a manifest under the cap (one listing of
manifests/), for its bundle key, be neither yanked (the index's status, a yanks/ marker from one
listing, the ref's own yank list) nor absent from the index: then index-mode pods and
`--index none` pods take different bundles, or none. Such a bundle's manifest signature is checked
as restore checks it, from the listings alone.

Every refs/layers/<layer>/<layer key> is checked as `restore --fallback layers` follows it: it must
parse, its manifest must be in the store and name a bundle key in its first bytes, and that key's
newest active bundle in the index (the donor) must be unyanked and record and derive the ref's layer
key. Otherwise no pod reuses the layer through it (kcache.layerkeys).

A read the store failed (an error other than a missing object) is neither sound nor damaged: it
lands in `unchecked`, so a caller can tell "damage found" from "could not check" (`status`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from kcache import choice, fetch, fingerprint, layerkeys, limits, progress, refs, signing
from kcache import manifest as manifests
from kcache import packs as pack_format
from kcache.errors import (
    ConfigError,
    IntegrityError,
    KcacheError,
    NotFound,
    ObjectMissing,
    SignatureError,
    StoreError,
)
from kcache.packs import unpack_frame
from kcache.store import Store, manifest_key, pack_key
from kcache.store.base import ObjectInfo, listed_size
from kcache.streams import Discard
from kcache.untrusted import one_line

if TYPE_CHECKING:
    from kcache.index import Index
    from kcache.index.lifecycle import BundleHead
    from kcache.records import Bundle

# How long a publish may take between committing its bundle and writing its key's ref (an S3
# compare-and-swap, retried) before a ref that names an older bundle is reported.
REF_CATCH_UP = timedelta(minutes=5)


@dataclass(frozen=True)
class VerifyResult:
    bundles: int
    refs: int  # refs/<bundle-key> objects checked
    packs: int
    blobs_read: int
    bytes_read: int
    problems: tuple[str, ...]  # damage: what makes some pod fail, miss, or take another bundle
    layer_refs: int = 0  # refs/layers/<layer>/<layer key> objects checked
    unchecked: tuple[str, ...] = ()  # reads the store failed: neither sound nor damaged

    @property
    def status(self) -> str:
        """The outcome: "damaged" when anything checked is wrong, else "unchecked" when a read failed, else "ok"."""
        return "damaged" if self.problems else "unchecked" if self.unchecked else "ok"


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
    unchecked: list[str] = []
    # By the whole key: a pack restore cannot find at packs/<hh>/<id> is missing, whatever lies elsewhere.
    sizes: dict[str, int | None] = {info.key: info.size for info in store.list("packs/")}
    signatures = _signatures(store)
    bundles = lifecycle.bundle_heads(index)
    # Every stored copy, not every blob: restore of a bundle reads the copy in the pack its manifest
    # names, so a bad copy fails that bundle even where another pack holds the blob intact.
    to_read: dict[tuple[str, str, int], manifests.Entry] = {}
    keys_named: dict[str, str] = {}  # bundle id -> the bundle key its manifest names
    claims: dict[str, dict[tuple[str, ...], str]] = {}  # blob -> {chunk digests a manifest gives: its bundle id}
    layer_keys: dict[str, dict[str, str]] = {}  # bundle id -> {layer: the layer key it gives}
    for bundle in bundles:
        try:
            manifest, manifest_size = _fetch_manifest(store, bundle.id)
        except KcacheError as exc:
            if isinstance(exc, ObjectMissing) and not lifecycle.has_bundle(index, bundle.id):
                continue  # gc deleted it (row, then manifest) since the rows were read: no pod takes it
            _failed(exc, f"bundle {bundle.id[:12]}: {exc}", problems, unchecked)
            continue
        keys_named[bundle.id] = manifest.bundle_key
        if manifest.bundle_key != bundle.bundle_key:  # pods of the row's key are offered it, and refuse it
            problems.append(f"bundle {bundle.id[:12]}: the index files it under bundle key {bundle.bundle_key}, "
                            f"its manifest names {manifest.bundle_key}")  # fmt: skip
        layer_keys[bundle.id] = _layer_keys(manifest)
        for blob, digests in manifest.chunks.items():
            claims.setdefault(blob, {}).setdefault(digests, bundle.id)
        signed = signing.message(manifest.bundle_key, bundle.id, manifest_size)
        if trusted and bundle.id not in signatures:  # unsigned, or signed since the listing by its publish
            signatures[bundle.id] = _signatures(store, f"signatures/{bundle.id}/").get(bundle.id, {})
        for problem in _signature_problems(store, signatures.get(bundle.id, {}), signed, trusted, unchecked,
                                           f"bundle {bundle.id[:12]}: "):  # fmt: skip
            problems.append(f"bundle {bundle.id[:12]}: {problem}")
        for entry in manifest.entries:
            try:  # a pack the listing lacks is asked for: the bundle may have been published since
                size = listed_size(store, sizes, pack_key(entry.pack))
            except StoreError as exc:
                unchecked.append(f"bundle {bundle.id[:12]}: {entry.path}: {exc}")
                continue
            if size is None:
                problems.append(f"bundle {bundle.id[:12]}: {entry.path}: pack {entry.pack[:12]} is missing")
            elif entry.offset + entry.length > size:
                problems.append(f"bundle {bundle.id[:12]}: {entry.path}: pack {entry.pack[:12]} is too short")
            elif read_data and in_subset(entry.pack, subset):
                to_read.setdefault((entry.blob, entry.pack, entry.offset), entry)
    # After the rows were read: a ref a publish moved since then names a row the index is asked for again.
    seen = _Seen({bundle.id: bundle for bundle in bundles}, keys_named, signatures, limits.max_manifest_bytes(),
                 layer_keys, index.now() - REF_CATCH_UP)  # fmt: skip
    ref_count, layer_ref_count = _check_refs(store, index, seen, trusted, problems, unchecked)
    read = _read_all(store, list(to_read.values()), jobs, problems, report, unchecked, claims) if read_data else (0, 0)
    packs = len({e.pack for e in to_read.values()}) if read_data else sum(size is not None for size in sizes.values())
    return VerifyResult(len(bundles), ref_count, packs, read[0], read[1], tuple(dict.fromkeys(problems)),
                        layer_ref_count, tuple(dict.fromkeys(unchecked)))  # fmt: skip


def _failed(exc: KcacheError, text: str, problems: list[str], unchecked: list[str]) -> None:
    """A check that raised: damage when the object is missing, over its cap or does not verify; a
    read the store itself failed (a timeout, a refused request) says nothing either way."""
    (unchecked if _unreadable(exc) else problems).append(text)


def _unreadable(exc: KcacheError) -> bool:
    return isinstance(exc, StoreError) and not isinstance(exc, ObjectMissing)


def _layer_keys(manifest: manifests.Manifest) -> dict[str, str]:
    """{layer: key} for each layer this manifest can give `restore --fallback layers` (layerkeys.refusal)."""
    recorded = {layer: manifest.layer_info.get(layer, {}).get("key") for layer in manifest.layers}
    return {layer: key for layer, key in recorded.items() if key and not layerkeys.refusal(layer, key, manifest)}


def _fetch_manifest(store: Store, manifest_id: str) -> tuple[manifests.Manifest, int]:
    """The manifest, as manifests.fetch reads it, and its size in the store (what a signature covers)."""
    key = manifest_key(manifest_id)
    data = limits.read_manifest(store, key)
    if data is None:
        raise ObjectMissing(store.url, key)
    return manifests.parse(data, manifest_id), len(data)


def _signatures(store: Store, prefix: str = "signatures/") -> dict[str, dict[str, ObjectInfo]]:
    """{manifest id: {key name: object}} from one listing of signatures/<manifest-id>/<key name> (under `prefix`)."""
    found: dict[str, dict[str, ObjectInfo]] = {}
    for info in store.list(prefix):
        parts = info.key.split("/")
        if len(parts) == 3:
            found.setdefault(parts[1], {})[parts[2]] = info
    return found


def _signature_problems(store: Store, present: Mapping[str, ObjectInfo], signed: bytes,
                        trusted: tuple[signing.TrustedKey, ...], unchecked: list[str],
                        where: str) -> list[str]:  # fmt: skip
    """What is wrong with one bundle's signatures: each is read as restore reads it (capped); one by
    a trusted key must verify `signed`, any other must at least be an Ed25519 signature (its public
    key is not here to verify it); with trusted keys, one of them must have signed. A read the store
    failed goes to `unchecked` (after `where`), and then no missing trusted signature is claimed."""
    by_name = {key.name: key for key in trusted}
    problems, verified, refused = [], False, False  # refused: a trusted key's signature is there but bad
    for name in sorted(present):
        try:
            raw = limits.read_capped(store, present[name].key, limits.SIGNATURE_BYTES, "signature")
        except KcacheError as exc:  # ObjectTooLarge, a read that failed: restore would fail alike
            if _unreadable(exc):  # neither good nor bad, and no "not signed" claim rests on it
                unchecked.append(f"{where}the signature by {name!r}: {exc}")
                refused = True
            else:
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


@dataclass(frozen=True)
class _Seen:
    """What the bundle pass already learned, so the ref pass reads nothing twice."""

    rows: Mapping[str, BundleHead]  # the index's bundles by id (heads: no facts)
    keys_named: Mapping[str, str]  # bundle id -> the bundle key its (verified) manifest names
    signatures: Mapping[str, Mapping[str, ObjectInfo]]  # from the listing of signatures/
    manifest_cap: int  # limits.max_manifest_bytes(), as restore reads it
    layer_keys: Mapping[str, Mapping[str, str]]  # bundle id -> {layer: the layer key its manifest gives}
    settled_before: datetime | None = None  # a bundle created before this has had time for its ref (REF_CATCH_UP)


def _check_refs(store: Store, index: Index, seen: _Seen, trusted: tuple[signing.TrustedKey, ...],
                problems: list[str], unchecked: list[str]) -> tuple[int, int]:  # fmt: skip
    """Check every refs/<bundle-key> and refs/layers/<layer>/<layer key> (see the module docstring);
    returns how many of each there were."""
    manifest_sizes: dict[str, int | None] = {info.key: info.size for info in store.list("manifests/")}
    marked = {info.key for info in store.list("yanks/")}
    counts = {"ref": 0, "layer ref": 0}
    for info in store.list("refs/"):
        name = info.key[len("refs/"):]
        layer = _layer_of(name)
        if layer is None and not fingerprint.is_bundle_key(name):  # a name restore never reads
            continue
        what = "layer ref" if layer else "ref"
        try:
            ref = refs.read(store, name)  # capped at limits.REF_BYTES, refused unread above it
        except KcacheError as exc:
            why = exc.why if isinstance(exc, IntegrityError) else str(exc)
            _failed(exc, one_line(f"{what} refs/{name}: {why}"), problems, unchecked)
            counts[what] += 1
            continue
        if ref is None:  # removed since the listing (gc, or a yank of a key's last bundle)
            continue
        counts[what] += 1
        if layer:
            found = _layer_ref_problems(store, index, ref, layer, seen, manifest_sizes, marked, unchecked)
        else:
            found = _ref_problems(store, index, ref, seen, manifest_sizes, marked, trusted, unchecked)
        problems.extend(one_line(p) for p in found)  # text from the store: bounded, one line
    return counts["ref"], counts["layer ref"]


def _layer_of(name: str) -> str | None:
    """The layer a ref name layers/<layer>/<layer key> is for; None for any other name."""
    parts = name.split("/")
    if len(parts) == 3 and parts[0] == "layers" and parts[1] in layerkeys.FACTS:
        return parts[1] if fingerprint.is_bundle_key(parts[2]) else None  # an xxh3 key, as bundle keys are
    return None


def _layer_ref_problems(store: Store, index: Index, ref: refs.Ref, layer: str, seen: _Seen,
                        manifest_sizes: dict[str, int | None], marked: set[str],
                        unchecked: list[str]) -> list[str]:  # fmt: skip
    """Why `restore --fallback layers` reuses no layer through this ref: the bundle it names says only
    which bundle key holds the layer, and that key's newest active bundle (the donor) must give it."""
    where, named = f"layer ref refs/{ref.bundle_key}", f"names bundle {ref.manifest[:12]}"
    lost = f"no pod reuses its {layer} layer through it"
    holder = seen.keys_named.get(ref.manifest)
    try:
        if listed_size(store, manifest_sizes, manifest_key(ref.manifest)) is None:  # a publish's since the listing
            raise ObjectMissing(store.url, manifest_key(ref.manifest))
        holder = holder or manifests.bundle_key_hint(store, ref.manifest)
    except ObjectMissing:
        return [f"{where}: {named}, whose manifest is missing ({lost})"]
    except StoreError as exc:
        unchecked.append(f"{where}: {exc}")
        return []
    if holder is None:
        return [f"{where}: {named}, whose manifest names no bundle key in its first bytes ({lost})"]
    donor = index.newest_bundle(holder)
    if donor is None:
        return [f"{where}: {named} of bundle key {holder}, which has no active bundle in the index ({lost} until "
                "a publish with this layer key moves it)"]  # fmt: skip
    if refs.yank_key(donor.id) in marked:
        return [f"{where}: {named} of bundle key {holder}, whose newest bundle {donor.id[:12]} is yanked by "
                f"{refs.yank_key(donor.id)} ({lost}); `kcache yank` it so the index moves past it"]  # fmt: skip
    given = seen.layer_keys.get(donor.id)
    if given is None and donor.id in seen.rows:  # its manifest failed: reported with its bundle
        return []
    if given is None:  # committed since the rows were read
        try:
            given = _layer_keys(_fetch_manifest(store, donor.id)[0])
        except KcacheError as exc:
            found: list[str] = []
            _failed(exc, f"{where}: bundle {donor.id[:12]}: {exc}", found, unchecked)
            return found
    key = ref.bundle_key.rsplit("/", 1)[-1]
    if given.get(layer) != key:
        return [f"{where}: {named} of bundle key {holder}, whose newest bundle {donor.id[:12]} does not give the "
                f"{layer} layer under this key ({lost})"]  # fmt: skip
    return []


def _ref_problems(store: Store, index: Index, ref: refs.Ref, seen: _Seen, manifest_sizes: dict[str, int | None],
                  marked: set[str], trusted: tuple[signing.TrustedKey, ...],
                  unchecked: list[str]) -> list[str]:  # fmt: skip
    """What stops a pod restoring through this ref, or makes it take another bundle than the index's."""
    where, named = f"ref refs/{ref.bundle_key}", f"names bundle {ref.manifest[:12]}"
    problems = _ref_signature_problems(ref, trusted)
    if ref.manifest in ref.yanked:
        problems.append(f"{where}: {named}, which its own yank list names (pods restoring through it start cold)")
    if refs.yank_key(ref.manifest) in marked:
        problems.append(f"{where}: {named}, yanked by {refs.yank_key(ref.manifest)} (pods restoring through it "
                        "start cold); `kcache yank` it so the ref moves to the bundle before it")  # fmt: skip
    try:  # a manifest the listing lacks is asked for: a publish may have moved the ref to it since
        size, cap = listed_size(store, manifest_sizes, manifest_key(ref.manifest)), seen.manifest_cap
    except StoreError as exc:
        unchecked.append(f"{where}: {exc}")
        return problems
    if size is None:
        problems.append(f"{where}: {named}, whose manifest is missing")
    elif size > cap:
        problems.append(f"{where}: {named}, whose manifest is {size} bytes, over the {cap}-byte limit")
    row = seen.rows.get(ref.manifest) or _row(index, ref.manifest)
    if row is None:
        problems.append(_absent(index, ref, where, named))
        if size is not None and size <= cap:  # what a pod would check before reading it
            signed = signing.message(ref.bundle_key, ref.manifest, size)
            present = seen.signatures.get(ref.manifest, {})
            found = _signature_problems(store, present, signed, trusted, unchecked, f"{where}: {named}: ")
            problems += [f"{where}: {named}: {p}" for p in found]
        return problems
    if row.status == "yanked":
        problems.append(f"{where}: {named}, which is yanked in the index; `kcache refresh` re-points it")
    theirs = seen.keys_named.get(row.id, row.bundle_key)
    if theirs != ref.bundle_key:
        problems.append(f"{where}: {named}, which is for bundle key {theirs}")
    elif row.status == "active":
        newest = index.newest_bundle(ref.bundle_key)
        # A publish commits its row, then writes the ref: one that has had minutes to do so is not catching up.
        settled = newest is not None and seen.settled_before is not None and newest.created_at < seen.settled_before
        if settled and newest.id != row.id and newest.created_at > row.created_at:
            problems.append(f"{where}: {named}, older than the index's newest {newest.id[:12]}: pods restoring "
                            "through refs take the older one (a replayed ref, or none rewritten since); "
                            "`kcache refresh` re-points it")  # fmt: skip
    return problems


def _ref_signature_problems(ref: refs.Ref, trusted: tuple[signing.TrustedKey, ...]) -> list[str]:
    """With trusted keys, what restore --require-signature would refuse the ref for; and any signature
    in it that is no Ed25519 signature at all (whoever trusts that name would refuse it)."""
    problems = []
    if trusted:
        problem = choice.Policy(trusted, required=True).ref_problem(ref)
        problems += [problem] if problem else []
    checked = {key.name for key in trusted}  # those ref_problem verified
    bad = [name for name, text in ref.signatures if name not in checked and not _is_signature(text)]
    if bad:  # one line however many: a ref may carry a megabyte of them
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        problems.append(f"ref refs/{ref.bundle_key}: the signature by {bad[0]!r}{more} is no Ed25519 signature "
                        "(64 bytes in base64)")  # fmt: skip
    return problems


def _row(index: Index, bundle_id: str) -> Bundle | None:
    """The index's row for a bundle committed since the rows were read, or None."""
    try:
        return index.get_bundle(bundle_id)
    except NotFound:
        return None


def _absent(index: Index, ref: refs.Ref, where: str, named: str) -> str:
    if index.knows_key(ref.bundle_key):
        newest = index.newest_bundle(ref.bundle_key)
        takes = f"index-mode pods take {newest.id[:12]}" if newest else "index-mode pods start cold"
        return (f"{where}: {named}, and the index has no bundle of that id ({takes}); publishers use another "
                "index, or run `kcache reindex` into this one")  # fmt: skip
    return (f"{where}: {named} of a bundle key this index has never seen: publishers use another index; "
            "verify with that one, or run `kcache reindex` into this one")


def _is_signature(text: str) -> bool:
    try:
        return len(base64.b64decode(text, validate=True)) == 64
    except (ValueError, binascii.Error):
        return False


def _read_all(store: Store, entries: list[manifests.Entry], jobs: int, problems: list[str],
              report: progress.Report | None, unchecked: list[str],
              claims: dict[str, dict[tuple[str, ...], str]]) -> tuple[int, int]:  # fmt: skip
    """Re-hash every blob; a bad one is a problem, and the rest of its pack is still read. A blob
    that manifests give chunk digests for is also hashed chunk by chunk: restore trusts its parts by
    them, so a manifest whose digests are not its content's fails that bundle's restore. Such a blob,
    once sound, is read again in parts as a restore that splits it reads it (fetch.read_split)."""
    lock = threading.Lock()
    done = {"blobs": 0, "bytes": 0}
    sound: list[tuple[manifests.Entry, tuple[str, ...]]] = []  # blobs with chunk digests, and their content's
    meter = progress.Meter("verifying", files=len(entries), bytes=sum(e.size for e in entries), report=report)

    def check(entry: manifests.Entry, frame) -> None:
        sink = _ChunkDigests() if entry.blob in claims else Discard()
        try:
            unpack_frame(frame, entry.blob, entry.size, sink)
        except KcacheError as exc:
            with lock:
                problems.append(f"pack {entry.pack[:12]}: {entry.path}: {exc}")
            return
        finally:
            meter.add(files=1, bytes=entry.size)  # checked, good or bad
        with lock:
            done["blobs"] += 1
            done["bytes"] += entry.size
            if isinstance(sink, _ChunkDigests):
                sound.append((entry, sink.digests()))
                problems.extend(f"bundle {bundle_id[:12]}: {entry.path}: its manifest's chunk digests are not "
                                f"those of blob {entry.blob[:12]}" for digests, bundle_id in claims[entry.blob].items()
                                if digests != sink.digests())  # fmt: skip

    def one_range(rng: fetch.Range) -> None:  # each on its own, so one bad pack does not hide the others
        try:
            fetch.read_range(store, rng, check, cancelled=lambda: False)
        except KcacheError as exc:
            with lock:
                _failed(exc, f"pack {rng.pack[:12]}: {exc}", problems, unchecked)

    with meter, ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one_range, fetch.plan_ranges(entries)))
    for entry, digests in sound:  # its parts, with the digests of the content the id vouched for
        try:
            fetch.read_split(store, entry, digests, jobs=jobs)
        except KcacheError as exc:
            _failed(exc, f"pack {entry.pack[:12]}: {entry.path}: read in parts as restore reads it: {exc}",
                    problems, unchecked)  # fmt: skip
    return done["blobs"], done["bytes"]


class _ChunkDigests:
    """A sink that hashes what it is given in CHUNK_BYTES pieces, as a publisher digests a large file."""

    def __init__(self):
        self._done: list[str] = []
        self._digest, self._held = hashlib.sha256(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        while view:
            take = min(len(view), pack_format.CHUNK_BYTES - self._held)
            self._digest.update(view[:take])
            self._held, view = self._held + take, view[take:]
            if self._held == pack_format.CHUNK_BYTES:
                self._done.append(self._digest.hexdigest())
                self._digest, self._held = hashlib.sha256(), 0
        return len(data)

    def digests(self) -> tuple[str, ...]:
        return tuple(self._done) + ((self._digest.hexdigest(),) if self._held else ())

