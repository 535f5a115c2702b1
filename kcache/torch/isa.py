"""Inductor's vector-ISA probes, answered in this process for caches that `kcache restore` laid down.

Before its first C++ kernel, every torch process asks which vector ISA it may compile for
(torch 2.13's `_inductor/cpu_vec_isa.py`): for each candidate the CPU supports (avx512 with
VNNI, avx512, avx2, and the bf16/VNNI/AMX extras) it builds a tiny probe library into the cache
dir, once, and then starts a fresh interpreter that only `dlopen`s it. The build is cached; the
interpreters are not: six of them per start here, ~1.2 s of a ~4.7 s warm start (the ones that
link libtorch_cpu cost ~0.3-0.45 s each).

Torch's own switch for this, TORCHINDUCTOR_VEC_ISA_OK=1, is in the FX graph key (every Inductor
config entry is), so setting it on restore misses every graph published without it; and it would
stop cold pods from checking their compiler at all. This module leaves torch's config and keys
alone and changes only where the load is tried, and only for probe libraries that a restore hit
laid down:

    ROOT/.kcache-state.json   status "hit", "inductor" among its layers (written after the files)
    ROOT/inductor/<hh>/*.so   a probe whose mtime is not newer than that marker: restored bytes,
                              verified by SHA-256 against a manifest published under the same
                              fingerprint (compiler text, torch version and path, cpu.features)

Such a library is loaded here with ctypes: the same yes/no (its symbols resolve against the very
libtorch this process runs), without a new interpreter. Torch keeps the child for isolation, in
case a library crashes its loader; the fingerprint rules out the toolchain differences that could
make a verified probe behave so. Torch's CPU-support check (cpuinfo) still runs first, so an ISA
the CPU lacks is never loaded. Probes built in this process, and every probe outside a restored
root, go through torch's child as before.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path

from kcache.readiness import RESTORE_MARKER, read_marker

log = logging.getLogger(__name__)

_PATCHED = "_kcache_restored_probes"  # attribute on the patched function: which root it trusts


def vouches(marker: dict | None, layer: str) -> bool:
    """Whether a restore marker says the restore laid `layer` down: a hit, or a partial restore
    (--fallback toolchain or layers) listing it, whose layers come from bundles of this toolchain
    key (inductor and inductor-pch are keyed on the whole toolchain: layerkeys.FACTS)."""
    layers = marker.get("layers") if marker is not None else None
    # A marker anyone in the pod may write: only a list vouches (`"inductor" in 5` raised in torch's process).
    return marker is not None and marker.get("status") in ("hit", "partial") and isinstance(layers, list) \
        and layer in layers


def restored_inductor_dir(env: Mapping[str, str] | None = None) -> Path | None:
    """The Inductor cache dir when a restore laid it down (ROOT/inductor of a hit, or of a partial
    restore with the inductor layer: see `vouches`), else None."""
    env = os.environ if env is None else env
    configured = env.get("TORCHINDUCTOR_CACHE_DIR")
    if not configured:
        return None
    cache_dir = Path(configured).absolute()
    marker = read_marker(cache_dir.parent, RESTORE_MARKER)
    if not vouches(marker, "inductor"):
        return None
    return cache_dir


def is_restored(path: str, cache_dir: Path, root: Path | None = None) -> bool:
    """True when `path` is a file under `cache_dir` that the restore into `root` (default: the
    directory above `cache_dir`) wrote: not newer than its marker."""
    candidate = Path(os.path.abspath(path))  # normalised, so "../" cannot step out of the dir
    real_dir, real = cache_dir.resolve(), candidate.resolve()
    if not candidate.is_relative_to(cache_dir) or not real.is_relative_to(real_dir):
        return False
    if real.relative_to(real_dir) != candidate.relative_to(cache_dir):
        return False  # a link inside the restored dir (the dir itself may sit behind one)
    try:
        marker_mtime = ((cache_dir.parent if root is None else root) / RESTORE_MARKER).stat().st_mtime_ns
        return candidate.is_file() and candidate.stat().st_mtime_ns <= marker_mtime
    except OSError:
        return False


def trust_restored_probes(env: Mapping[str, str] | None = None) -> bool:
    """Answer Inductor's ISA probes in this process for restored probe libraries; True when enabled.

    Call it once at start-up, before the first compile (like `load_megacache()`). A no-op returning
    False when the cache was not restored by a hit, or when this torch has no `VecISA._probe_load`
    (the seam this relies on, present in torch 2.13).
    """
    cache_dir = restored_inductor_dir(env)
    if cache_dir is None:
        return False
    from torch._inductor import cpu_vec_isa

    original = getattr(cpu_vec_isa.VecISA, "_probe_load", None)
    if original is None:
        log.info("this torch has no VecISA._probe_load; ISA probes run as torch does them")
        return False
    original = getattr(original, "__wrapped__", original)  # calling twice must not stack wrappers
    cpu_vec_isa.VecISA._probe_load = _in_process(original, cache_dir)
    return True


def _in_process(original: Callable, cache_dir: Path) -> Callable:
    def probe_load(self, output_path: str) -> bool:
        if not is_restored(output_path, cache_dir):
            return original(self, output_path)
        try:
            ctypes.CDLL(output_path)
        except OSError as exc:  # the same answer torch's child gives for a library that does not load
            log.info("restored ISA probe %s does not load: %s", output_path, exc)
            return False
        return True

    probe_load.__wrapped__ = original
    setattr(probe_load, _PATCHED, str(cache_dir))
    return probe_load
