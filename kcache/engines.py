"""Versions of the JIT engines whose caches kcache carries, read from their dist-info, never imported.

    engine.vllm  engine.sglang  engine.tensorrt_llm  engine.flashinfer  engine.deep_gemm  engine.cutlass_dsl

A fact appears only when the package is installed, so machines without these engines keep their
keys. The caches of vLLM, FlashInfer and TensorRT-LLM's autotuner do not all refuse entries of
another version (the autotuner's loader overwrites the version it finds), so the version belongs
in the bundle key: an upgraded engine misses instead of loading stale tactics or kernels.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path

# fact suffix -> (import name, distribution names as their dist-info directories spell them)
ENGINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm": ("vllm", ("vllm",)),
    "sglang": ("sglang", ("sglang",)),
    "tensorrt_llm": ("tensorrt_llm", ("tensorrt_llm",)),
    "flashinfer": ("flashinfer", ("flashinfer_python", "flashinfer")),
    "deep_gemm": ("deep_gemm", ("deep_gemm",)),
    "cutlass_dsl": ("cutlass", ("nvidia_cutlass_dsl",)),
}
_VERSION = re.compile(r"-([^-]+)\.dist-info\Z")


def package_dir(name: str) -> Path | None:
    """Where a package would be imported from, without importing it (probes read torch's this way too)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _installed_version(module: str, dists: tuple[str, ...]) -> str | None:
    where = package_dir(module)
    if where is None:
        return None
    site = where.parent
    for dist in dists:
        for info in sorted(site.glob(f"{dist}-*.dist-info"), reverse=True):
            match = _VERSION.search(info.name)
            if match:
                return match.group(1)
    return "unknown"  # importable without metadata (a source checkout): still a different engine


def probe_engines(env: Mapping[str, str]) -> dict[str, str]:
    facts = {}
    for name, (module, dists) in ENGINES.items():
        version = _installed_version(module, dists)
        if version is not None:
            facts[f"engine.{name}"] = version
    return facts
