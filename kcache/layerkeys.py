"""Layer keys: each reusable layer keyed by only the facts its contents depend on.

A bundle is keyed by every fact, so a driver upgrade or a new model version misses it whole,
though most of its Triton kernels or CUDA JIT entries are still valid. A layer key hashes the
subset of facts a layer's engine cannot itself tell apart; publish records it in the manifest
(layer_info[<layer>]["key"]) and points a ref at the bundle:

    refs/layers/<layer>/<layer key>   ->  the newest manifest holding that layer (kcache.refs format)

`restore --fallback layers` assembles, on a miss, each reusable layer from the newest bundle whose
layer key matches ours, and reports "partial" with where each layer came from. Restore checks no
signature of a layer ref (publish writes them unsigned), so a ref only names the bundle key that
holds the layer: the donor is that key's newest bundle as the catalog gives it, checked like any
restore's (its signed ref, yanks, size, signature before a byte of the manifest is read), and its
manifest must itself derive our layer key. All the donors' manifests together stay within
KCACHE_MAX_MANIFEST_BYTES, each read once.

Default: off (`--fallback layers` asks for it). The layers in SAFE_BY_CONSTRUCTION are guarded by
their engines' own keys, so reusing them is never a wrong hit, and turning it on by default would be
sound; but a partial restore fetches bytes the workload may never use, that cost and the benefit
have only been measured on CPU, and none of these layers has been restored on a GPU yet (see
docs/gpu.md). Turn it on by default once scripts/gpu_check has figures.

A yank, and gc deleting a bundle, move each layer ref naming that bundle (`move_off`) to the newest
active bundle the index knows that gives the layer under that layer key and is its own key's newest
(what restore would then take through it), or remove the ref; `yank --undo` moves them forward to
the newest again (`catch_up`). Both compare-and-swap as publish does, so a publish that moved the
ref meanwhile wins, and sign what they write when given the signing key (restore does not ask).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from kcache import canonical, fingerprint, probes, refs
from kcache import manifest as manifests
from kcache.errors import KcacheError
from kcache.records import Bundle
from kcache.signing import SigningKey
from kcache.store import Store
from kcache.untrusted import one_line

if TYPE_CHECKING:
    from kcache.index import Index

log = logging.getLogger(__name__)

SCHEMA = 1
TOOLCHAIN = "toolchain"  # every fact except the workload's: the layer is as specific as the toolchain key

# The facts each reusable layer's key hashes, and why those suffice. A layer missing here is never
# reused across bundles: its entries are keyed by the workload, or by facts kcache does not probe.
FACTS: dict[str, tuple[str, ...] | str] = {
    # The driver JIT-compiles PTX for one device and keys entries by PTX text, device and driver;
    # an entry of another driver is dead weight (the driver ignores and evicts it).
    "cuda": ("gpu.name", "gpu.sm", "gpu.driver", "os", "arch"),
    # Triton names each kernel directory by a hash of the source, its own version key (its sources
    # and libtriton), the target (backend, arch, warp size), the options and TRITON_* settings (not
    # its kernel overrides: WHERE_SET); the host launchers it caches are compiled against Python and
    # the C library.
    "triton": ("triton.version", "gpu.sm", "os", "arch", "python", "libc"),
    # DeepGEMM names each kernel by its name, a hash of its headers, the compiler and the flags
    # (GPU arch, include path): only what it runs on is left, and what nvcc reads besides (WHERE_SET).
    "deep_gemm": ("gpu.sm", "os", "arch"),
    # CuTe DSL hashes the generated IR with its Python sources, shared libraries and CUTE_DSL_*
    # settings; the cached bytecode is loaded by this Python.
    "cute_dsl": ("gpu.sm", "os", "arch", "python"),
    # Inductor keys graphs by content but bakes the ISA, compiler, torch build and settings into
    # kernels it does not key on (TORCH_FACTS.md): reusable across workloads, never across toolchains.
    "inductor": TOOLCHAIN,
    "inductor-pch": TOOLCHAIN,
}
# Facts a layer's key hashes too, but only where a machine has them: a fact keyed only where some
# setting is made, so that every other machine's layer key is what it was. DeepGEMM runs nvcc, which
# reads these settings, and keys its kernels by its own flags and nvcc's major.minor only: two pods
# differing in NVCC_APPEND_FLAGS (--use_fast_math) had shared the layer. Triton builds a kernel from
# the files of TRITON_OVERRIDE_DIR (TRITON_KERNEL_OVERRIDE) or TRITON_SWAP_MIR in place of its own
# code, and files it under the key its own build has (neither is in that key): with the installed
# triton 3.9 an overridden x * 5.0 landed in x * 3.0's folder (tests/test_layer_reuse.py); so did x * 7.0 from
# another pod's override files, whose digest (probes.probe_triton_files) is keyed beside the switch.
WHERE_SET: dict[str, tuple[str, ...]] = {
    "deep_gemm": tuple(f"env.{name}" for name in probes.NVCC_ENV),
    "triton": ("env.TRITON_KERNEL_OVERRIDE", "env.TRITON_SWAP_MIR", "triton.override_files", "triton.swap_mir_files"),
}
# Layers whose own engine keys guard every entry (with WHERE_SET's facts): a foreign entry is a miss,
# never a wrong hit.
SAFE_BY_CONSTRUCTION = ("cuda", "triton", "deep_gemm", "cute_dsl")
_DONOR_READS = 20  # donor manifests read for one layer ref before it is removed instead


def layer_facts(layer: str, facts: Mapping[str, str]) -> dict[str, str] | None:
    """The facts `layer`'s key hashes, or None when the layer is never reused across bundles."""
    chosen = FACTS.get(layer)
    if chosen is None:
        return None
    if chosen == TOOLCHAIN:
        return {k: v for k, v in facts.items() if not fingerprint.is_workload_fact(k)}
    extra = {name: facts[name] for name in WHERE_SET.get(layer, ()) if name in facts}
    return {**{name: facts.get(name, fingerprint.NONE) for name in chosen}, **extra}


def layer_key(layer: str, facts: Mapping[str, str]) -> str | None:
    chosen = layer_facts(layer, facts)
    return None if chosen is None else canonical.xxh3({"schema": SCHEMA, "layer": layer, "facts": chosen})


def ref_name(layer: str, key: str) -> str:
    return f"layers/{layer}/{key}"  # read and moved through kcache.refs: refs/layers/<layer>/<key>


def annotate(info: Mapping[str, Mapping[str, str]], layers, facts: Mapping[str, str]) -> dict:
    """`info` with each reusable layer's key added, for the manifest publish writes."""
    out = {name: dict(value) for name, value in info.items()}
    for layer in layers:
        key = layer_key(layer, facts)
        if key is not None:
            out.setdefault(layer, {})["key"] = key
    return out


def advance(store: Store, manifest: manifests.Manifest, created_at, now=None) -> None:
    """After the commit point: point each reusable layer's ref at this bundle (forward only; `now`,
    the clock that stamped `created_at`, judges a ref from the future)."""
    for layer in manifest.layers:
        key = manifest.layer_info.get(layer, {}).get("key")
        if key:
            refs.advance(store, refs.Ref(ref_name(layer, key), manifest.id, created_at), now=now)


def keys_of(bundle: Bundle) -> dict[str, str]:
    """{layer: layer key} of each reusable layer an index row holds: the refs publish pointed at it."""
    keys = {layer: layer_key(layer, bundle.facts) for layer in bundle.layers}
    return {layer: key for layer, key in keys.items() if key is not None}


def move_off(store: Store, index: Index, bundle: Bundle, *, signer: SigningKey | None = None) -> None:
    """Each layer ref naming `bundle` (yanked, or being deleted) to the next donor (`donor_ref`), or removed.

    A removal is unconditional, so a publish's ref that landed just before it may have gone too:
    the index's newest donor is put back after one (that publish committed its row first).
    """
    for layer, key in keys_of(bundle).items():
        name, choose = ref_name(layer, key), partial(donor_ref, store, index, layer, key, without=bundle.id)
        if refs.repoint_chosen(store, name, bundle.id, choose, signer=signer):
            refs.advance_chosen(store, name, choose, signer=signer)


def catch_up(store: Store, index: Index, bundle: Bundle, *, signer: SigningKey | None = None) -> None:
    """Each layer ref of `bundle` (restorable again: `yank --undo`, or kept by gc) forward to it, if it
    is now the donor it can be: its key's newest, giving the layer. Every other donor was one before."""
    for layer, key in keys_of(bundle).items():
        refs.advance_chosen(store, ref_name(layer, key), partial(_if_newest, store, index, bundle, layer, key),
                            signer=signer)  # fmt: skip


def _if_newest(store: Store, index: Index, bundle: Bundle, layer: str, key: str) -> refs.Ref | None:
    newest = index.newest_bundle(bundle.bundle_key)
    if newest is None or newest.id != bundle.id or not _gives(store, bundle.id, layer, key):
        return None
    return refs.Ref(ref_name(layer, key), bundle.id, newest.created_at)


def donor_ref(store: Store, index: Index, layer: str, key: str, *, without: str = "") -> refs.Ref | None:
    """The ref refs/layers/<layer>/<key> should hold by the index: its newest active bundle (but
    `without`) that is its own key's newest, as restore takes it, and gives `layer` under `key`
    (`refusal`; no yank marker), as verify checks it. None when it knows none."""
    from kcache.index import lifecycle

    holders = lifecycle.newest_holders(index, layer, lambda b: keys_of(b).get(layer) == key, _DONOR_READS,
                                       without=without)  # fmt: skip
    for bundle in holders:
        if _gives(store, bundle.id, layer, key):
            return refs.Ref(ref_name(layer, key), bundle.id, bundle.created_at)
    return None


def _gives(store: Store, bundle_id: str, layer: str, key: str) -> bool:
    try:
        refused = refusal(layer, key, manifests.fetch(store, bundle_id))
        if not refused and store.exists(refs.yank_key(bundle_id)):
            refused = f"bundle {bundle_id[:12]} has a yank marker"
    except KcacheError as exc:
        refused = str(exc)
    if refused:
        log.warning("layer %s: not moving its ref to bundle %s: %s", layer, bundle_id[:12], one_line(refused))
    return not refused


@dataclass(frozen=True)
class Donor:
    """Where one layer of a partial restore comes from."""

    layer: str
    key: str
    manifest: manifests.Manifest


@dataclass(frozen=True)
class Holder:
    """What a layer ref says: the bundle key whose newest bundle holds the layer. Unverified."""

    layer: str
    key: str
    bundle_key: str


def holder(store: Store, layer: str, facts: Mapping[str, str]) -> Holder | None:
    """Which bundle key holds `layer` under our layer key, by its ref; None when none (or unreadable).

    A layer ref is not signed, so it is only a pointer to a bundle key: the bundle restore then
    takes is that key's newest, chosen and checked as any bundle is (kcache.choice.newest_of), and
    its manifest must itself derive our layer key (`refusal`).
    """
    key = layer_key(layer, facts)
    if key is None:
        return None
    try:
        ref = refs.read(store, ref_name(layer, key))
        bundle_key = None if ref is None else manifests.bundle_key_hint(store, ref.manifest)
    except KcacheError as exc:  # a missing or broken ref costs this layer, not the restore
        log.warning("layer %s: cannot read its ref: %s", layer, exc)
        return None
    return None if bundle_key is None else Holder(layer, key, bundle_key)


def refusal(layer: str, key: str, manifest: manifests.Manifest) -> str | None:
    """Why `manifest` may not give `layer` under layer key `key`, or None when it may."""
    if layer not in manifest.layers or layer_key(layer, manifest.facts) != key:
        return f"bundle {manifest.id[:12]} does not derive layer key {key}"
    if manifest.layer_info.get(layer, {}).get("key") != key:
        return f"bundle {manifest.id[:12]} does not record layer key {key}"
    return None


@dataclass(frozen=True)
class Verdict:
    """For `kcache explain`: could `restore --fallback layers` reuse this layer, and from which bundle?"""

    layer: str
    key: str
    donor: str | None  # the bundle id a restore would take the layer from
    differing: tuple[str, ...]  # on no donor: the layer's facts in which the nearest holder differs
    verdict: str


def _differing(layer: str, ours: Mapping[str, str], bundle) -> tuple[str, ...]:
    theirs = layer_facts(layer, bundle.facts) or {}
    return tuple(sorted(n for n in ours.keys() | theirs.keys() if ours.get(n) != theirs.get(n)))


def verdicts(facts: Mapping[str, str], bundles) -> tuple[Verdict, ...]:
    """Per reusable layer, from index Bundle records (pure: the restore itself checks the manifests)."""
    active = [b for b in bundles if b.status == "active"]
    newest_of_key: dict[str, Bundle] = {}
    for bundle in sorted(active, key=lambda b: (b.created_at, b.id), reverse=True):
        newest_of_key.setdefault(bundle.bundle_key, bundle)
    return tuple(_verdict(layer, facts, active, newest_of_key) for layer in FACTS)


def _verdict(layer: str, facts: Mapping[str, str], active, newest_of_key: Mapping[str, Bundle]) -> Verdict:
    """A layer ref names a bundle key, and restore takes that key's newest bundle (`donor_ref`): an
    older bundle of the key holding the layer is no donor."""
    key = layer_key(layer, facts)
    ours = layer_facts(layer, facts) or {}
    holders = [b for b in active if layer in b.layers]
    matching = [b for b in holders if layer_key(layer, b.facts) == key]
    donors = [b for b in matching if newest_of_key[b.bundle_key].id == b.id]
    if donors:
        donor = max(donors, key=lambda b: (b.created_at, b.id))
        return Verdict(layer, key, donor.id, (), f"reusable from bundle {donor.id[:12]}")
    if matching:
        held = max(matching, key=lambda b: (b.created_at, b.id))
        newest = newest_of_key[held.bundle_key]
        return Verdict(layer, key, None, (), f"bundle {held.id[:12]} holds it, but its key's newest bundle "
                       f"{newest.id[:12]} does not, and restore takes a layer from a key's newest only")  # fmt: skip
    if not holders:
        return Verdict(layer, key, None, (), "no active bundle holds this layer")
    nearest = min(holders, key=lambda b: (len(_differing(layer, ours, b)), -b.created_at.timestamp(), b.id))
    names = _differing(layer, ours, nearest)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return Verdict(layer, key, None, names, f"nearest holder {nearest.id[:12]} differs in {', '.join(names[:3])}{more}")
