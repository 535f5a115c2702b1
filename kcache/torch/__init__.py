"""Helpers a torch service calls: Mega-Cache save/load and Inductor's cache counters.

Part of the `torch` extra; torch is imported inside the functions, so importing this module is
free and works where torch is not installed.

    $KCACHE_MEGACACHE/artifacts.bin     the blob of torch.compiler.save_cache_artifacts()
    $KCACHE_MEGACACHE/artifacts.json    its entries: {type: [sorted keys]}, canonical JSON
                                        (kcache.env points KCACHE_MEGACACHE at ROOT/megacache)

A service calls `load_megacache()` once at start-up, before its first compile, and
`save_megacache()` after warmup (`kcache warmup --entrypoint` does the latter for you). Also at
start-up, `kcache.torch.isa.trust_restored_probes()` answers Inductor's ISA probes in process when
a restore hit laid the cache down (a no-op otherwise; see that module), and
`kcache.torch.pch.remember_headers()` names the restored precompiled header without preprocessing. The
Mega-Cache is torch's portable bundle of FX-graph, AOTAutograd, autotune and PGO entries (and,
on GPU, the Triton kernels inside them). On CPU it carries graph entries only: every C++ kernel
and the precompiled header are rebuilt after a load (~22 s instead of ~7 s for a full restore,
see TORCH_FACTS.md), so the inductor layers stay the main warm path and this blob is a fallback.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kcache import atomic
from kcache.errors import ConfigError

log = logging.getLogger(__name__)

ENV_VAR = "KCACHE_MEGACACHE"
BLOB_NAME = "artifacts.bin"


@dataclass(frozen=True)
class MegaCache:
    path: Path
    bytes: int
    artifacts: Mapping[str, int]  # artifact type (inductor, aot_autograd, ...) -> entries


def megacache_path(path: Path | str | None = None, env: Mapping[str, str] | None = None) -> Path | None:
    """The blob file: `path` itself when given, else $KCACHE_MEGACACHE/artifacts.bin, else None."""
    if path is not None:
        return Path(path)
    env = os.environ if env is None else env
    return Path(env[ENV_VAR]) / BLOB_NAME if env.get(ENV_VAR) else None


def save_megacache(path: Path | str | None = None) -> MegaCache | None:
    """Write every cache artifact this process compiled or loaded; None when there were none."""
    target = megacache_path(path)
    if target is None:
        raise ConfigError(ENV_VAR, "", "is not set; pass a path or source ROOT/kcache.env first")
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    blob, info = saved
    listing = json.dumps({kind: sorted(keys) for kind, keys in info.artifacts.items()}, sort_keys=True,
                         separators=(",", ":")).encode()  # fmt: skip
    entries = target.with_suffix(".json")
    # Torch orders the blob by the order it met the entries, so the same entries saved by a warm
    # run give other bytes; keeping the old blob lets an unchanged cache publish as unchanged.
    if target.is_file() and entries.is_file() and entries.read_bytes() == listing:
        return MegaCache(target, target.stat().st_size, _counts(info))
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(target, blob)
    atomic.write_bytes(entries, listing)  # after the blob: a crash in between means "rewrite next time"
    return MegaCache(target, len(blob), _counts(info))


def load_megacache(path: Path | str | None = None) -> MegaCache | None:
    """Hot-load a saved blob into torch's caches. None when there is no blob, or it cannot be used:
    a cache is an optimisation, so a bad blob is logged and the service compiles as if cold."""
    target = megacache_path(path)
    if target is None or not target.is_file():
        return None
    blob = target.read_bytes()
    import torch

    try:
        info = torch.compiler.load_cache_artifacts(blob)
    except Exception as exc:  # torch raises whatever its unpickler met
        log.warning("ignoring Mega-Cache blob %s: %s: %s", target, type(exc).__name__, exc)
        return None
    if info is None:  # torch could not deserialize it (and logged why)
        log.warning("ignoring Mega-Cache blob %s: torch could not read it", target)
        return None
    return MegaCache(target, len(blob), _counts(info))


def _counts(info) -> dict[str, int]:
    return {kind: len(keys) for kind, keys in sorted(info.artifacts.items())}


def counters() -> dict[str, int]:
    """Torch's cache counters for this process (key names checked against torch 2.13.0)."""
    from torch._dynamo.utils import counters

    return {
        "fxgraph_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fxgraph_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "aotautograd_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "aotautograd_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }
