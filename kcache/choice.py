"""Which bundle restore may take: the catalog's answer checked against signatures, refs and yanks.

Order matters, because everything here comes from a store or index that may be hostile:

    1. the catalog's answer (an index row, or a ref from the store)
    2. a ref: its signature and expiry (a miss with the reason when it does not hold)
    3. yanks: the index row's status, the signed ref's yank list, the `yanks/<id>` marker
    4. the manifest's size in the store, against KCACHE_MAX_MANIFEST_BYTES
    5. its signature, which covers that size: checked before a byte of the manifest is read
    6. the manifest, read up to that size, hashed, and matched to the bundle key
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

from kcache import limits, refs, signing
from kcache import manifest as manifests
from kcache.errors import IntegrityError, ManifestTooLarge, NotFound, ObjectMissing, SignatureError
from kcache.fingerprint import Fingerprint
from kcache.store import Store, manifest_key

if TYPE_CHECKING:
    from kcache.restore import Catalog

log = logging.getLogger(__name__)

_NONE = "no bundle published for this fingerprint"


@dataclass(frozen=True)
class Policy:
    """What this pod trusts: signing keys, whether a signature is required, the manifest cap."""

    trusted: tuple[signing.TrustedKey, ...]
    required: bool
    max_manifest_bytes: int = field(default_factory=limits.max_manifest_bytes)

    def check(self, store: Store, bundle_key: str, manifest_id: str, size: int) -> str | None:
        """Who signed the manifest (None when no trusted key did and none is required)."""
        if not self.trusted:
            return None
        signer = signing.verify(store, self.trusted, bundle_key, manifest_id, size)
        if signer is None and self.required:
            names = ", ".join(k.name for k in self.trusted)
            raise SignatureError(manifest_id, f"is not signed by a trusted key (trusted: {names})")
        if signer is None:
            log.warning("bundle %s is not signed by a trusted key; restoring it anyway", manifest_id[:12])
        return signer

    def ref_problem(self, ref: refs.Ref) -> str | None:
        """Why this ref may not be followed (a miss), or None. Refs matter only with trusted keys."""
        if not self.trusted:
            return None
        where = f"ref refs/{ref.bundle_key}"
        try:
            signer = signing.check(self.trusted, dict(ref.signatures), ref.message(), ref.bundle_key)
        except SignatureError as exc:
            return f"{where}: {exc.why}"
        if signer is None:
            problem = f"{where} is not signed by a trusted key"
        elif ref.expired(datetime.now(timezone.utc)):
            problem = f"{where} expired at {ref.expires:%Y-%m-%d %H:%M} UTC; run `kcache refresh` with the signing key"
        else:
            return None
        if self.required:
            return problem
        log.warning("%s; following it anyway (no --require-signature)", problem)
        return None


@dataclass(frozen=True)
class Choice:
    """The bundle picked, before its manifest is read."""

    manifest_id: str
    bundle_key: str  # the key its signature must name: ours, or another workload's for a partial hit
    partial: bool = False


def pick(store: Store, index: Catalog, fp: Fingerprint, pinned: str | None, fallback: str | None,
         policy: Policy) -> Choice | str:  # fmt: skip
    """The bundle to restore for this fingerprint, or why there is none (a miss)."""
    if pinned:
        why = _pinned_yanked(store, index, fp.bundle_key, pinned, policy) or _pinned_elsewhere(store, fp, pinned)
        choice = None if why else Choice(pinned, fp.bundle_key)
    else:
        choice, why = _newest(index, fp.bundle_key, policy)
        if why == _NONE and fallback == "toolchain":  # none at all; a ref that fails its checks is a miss
            other = index.newest_for_toolchain(fp.toolchain_key)
            if other is not None:
                choice = Choice(other.id, other.bundle_key, partial=True)
    if choice is None:
        return why
    return _unless_marked(store, choice)


def newest_of(store: Store, index: Catalog, bundle_key: str, policy: Policy) -> Choice | str:
    """The newest bundle of `bundle_key` that restore may take, checked as `pick` checks ours; or why not.

    For `--fallback layers`: a layer ref (unsigned, anyone's to rewrite) only says which bundle key
    holds a layer; what that key's catalog entry names (its signed ref, under signatures) is the
    donor. So no rewritten layer ref can bring back a yanked or an older bundle.
    """
    choice, why = _newest(index, bundle_key, policy)
    return why if choice is None else _unless_marked(store, choice)


def _unless_marked(store: Store, choice: Choice) -> Choice | str:
    # The index's word is not enough: a yank marker in the store stops the bundle everywhere.
    if store.exists(refs.yank_key(choice.manifest_id)):
        return f"bundle {choice.manifest_id[:12]} is yanked"
    return choice


def _newest(index: Catalog, bundle_key: str, policy: Policy) -> tuple[Choice | None, str]:
    answer = index.newest_bundle(bundle_key)
    if isinstance(answer, refs.Ref):  # from the store: anyone who can write the bucket wrote it
        problem = policy.ref_problem(answer)
        if problem:
            return None, problem
        if answer.manifest in answer.yanked:
            return None, f"bundle {answer.manifest[:12]} is yanked (the ref says so)"
    if answer is not None:
        return Choice(answer.id, bundle_key), ""
    return None, _NONE


def _pinned_elsewhere(store: Store, fp: Fingerprint, pinned: str) -> str | None:
    """Why a pinned bundle is not ours to restore: not in the store, or built for another fingerprint.

    Read from the manifest's first bytes, before its signature is checked (the signature names the
    bundle key, so it would only fail to verify). From the store, so only ever a reason to miss.
    """
    try:
        theirs = manifests.bundle_key_hint(store, pinned)
    except ObjectMissing:
        return f"pinned bundle {pinned[:12]} is not in the store"
    if theirs is not None and theirs != fp.bundle_key:
        return (f"pinned bundle {pinned[:12]} was built for another fingerprint "
                f"(bundle key {theirs}, ours {fp.bundle_key})")
    return None


def _pinned_yanked(store: Store, index: Catalog, bundle_key: str, pinned: str, policy: Policy) -> str | None:
    """Why a pinned bundle may not be restored: yanked in the index or in the (signed) ref."""
    if isinstance(index, refs.RefCatalog):
        ref = index.newest_bundle(bundle_key)
        problem = "there is no ref for this fingerprint" if ref is None else policy.ref_problem(ref)
        if problem and policy.required:  # without a trusted yank list, a deleted marker would un-yank
            return f"pinned bundle {pinned[:12]} cannot be checked for yanks: {problem}"
        yanked = ref.yanked if ref else ()  # honoured even unsigned: a yank can only cost a cold start
    else:
        try:
            yanked = (pinned,) if index.get_bundle(pinned).status == "yanked" else ()
        except NotFound:  # pinned by id from elsewhere: the store's ref holds its yank list, as without an index
            if index.was_yanked(pinned):  # gc deleted it while yanked; a copy may have been put back
                return f"bundle {pinned[:12]} is yanked (gc deleted it)"
            return _pinned_yanked(store, refs.RefCatalog(store), bundle_key, pinned, policy)
    return f"bundle {pinned[:12]} is yanked" if pinned in yanked else None


def yanked_among(store: Store, index: Catalog, bundle_key: str, ids: set[str], policy: Policy) -> set[str]:
    """Which of `ids` (bundles whose files a kept ROOT holds) are yanked: by a marker, the index's word
    (its row, or gc's record once the row is gone), or this key's ref's yank list, signed or not (a yank
    honoured from anybody only costs the layers' own compiles, as a marker costs a cold start). Requiring
    signatures, all of them without a valid signed ref to vouch for them, as for a pinned bundle: a store
    writer who deleted the ref and the markers would otherwise have the yanked kernels kept."""
    try:
        answer = index.newest_bundle(bundle_key)
    except IntegrityError:  # a ref that does not parse vouches for nothing
        if policy.required:
            return set(ids)
        answer = None
    if isinstance(index, refs.RefCatalog) or isinstance(answer, refs.Ref):  # answered from the store's refs
        if policy.required and (answer is None or policy.ref_problem(answer)):
            return set(ids)
        listed = set(answer.yanked) if answer is not None else set()
    else:
        listed = set()
        for bundle_id in ids:
            try:
                if index.get_bundle(bundle_id).status == "yanked":
                    listed.add(bundle_id)
            except NotFound:
                if index.was_yanked(bundle_id):
                    listed.add(bundle_id)
    return {i for i in ids if i in listed or store.exists(refs.yank_key(i))}


def read_manifest(store: Store, choice: Choice, fp: Fingerprint, policy: Policy, cap: int | None = None):
    """The chosen manifest, its signer and its size in the store. Size and signature are checked
    before a byte is read.

    `cap` lowers the size cap (what a partial restore from several donors has left of it).

    A manifest takes ~950 bytes an entry while it is parsed (see manifest.py), so the size cap
    bounds restore's memory, and the signature check (which covers the size) means an untrusted
    writer cannot make a pod read even a capped manifest when signatures are required.
    """
    key = manifest_key(choice.manifest_id)
    size = store.size(key)
    limit = policy.max_manifest_bytes if cap is None else min(cap, policy.max_manifest_bytes)
    if size > limit:
        raise ManifestTooLarge("manifest", key, size, limit)
    signer = policy.check(store, choice.bundle_key, choice.manifest_id, size)
    manifest = manifests.parse(limits.read_exactly(store, key, size), choice.manifest_id)
    if choice.partial and manifest.toolchain_key != fp.toolchain_key:
        raise IntegrityError(
            "manifest", manifest.id, f"is for toolchain {manifest.toolchain_key}, not {fp.toolchain_key}"
        )
    if manifest.bundle_key != choice.bundle_key:
        raise IntegrityError("manifest", manifest.id, f"is for bundle key {manifest.bundle_key}, "
                             f"not {choice.bundle_key}")  # fmt: skip
    return manifest, signer, size
