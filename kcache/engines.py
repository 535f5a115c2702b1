"""Versions of the JIT engines whose caches kcache carries, read from their files, never imported.

    engine.vllm  engine.sglang  engine.tensorrt_llm  engine.flashinfer  engine.deep_gemm  engine.cutlass_dsl

A fact appears only when the package is importable, so machines without these engines keep their
keys. The caches of vLLM, FlashInfer and TensorRT-LLM's autotuner do not all refuse entries of
another version (the autotuner's loader overwrites the version it finds), so the version belongs
in the bundle key: an upgraded engine misses instead of loading stale tactics or kernels.

Where the package would be imported from (importlib.util.find_spec, which imports nothing) decides
which metadata counts. The distributions are the ones importlib.metadata finds on sys.path, in its
order. A distribution vouches for the code when its RECORD hashes the package's top-level .py
files (its version.py among them) and they match what is on disk: a pip-installed wheel. The fact
is then that version, as it always was ("0.10.1"). Otherwise (an editable install, a source
checkout, a RECORD that lists other code or hashes that no longer match, two dist-infos that both
claim the package) metadata alone could give two versions one value, so the fact is the version
importlib.metadata would report, or "unknown", plus a digest of those top-level files:
"0.10.0 source:1f0c2b9d8e7a6543". Two replicas of one image agree; two versions do not.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import importlib.metadata

# importlib.metadata and packaging are imported only once an engine is found: a pod without one
# (kcache's own init-container image) does not pay ~15 ms of every restore's start for them.

# fact suffix -> (import name, distribution names that may install it, as their dist-info directories spell them)
ENGINES: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm": ("vllm", ("vllm",)),
    "sglang": ("sglang", ("sglang",)),
    "tensorrt_llm": ("tensorrt_llm", ("tensorrt_llm",)),
    "flashinfer": ("flashinfer", ("flashinfer_python", "flashinfer")),
    "deep_gemm": ("deep_gemm", ("deep_gemm",)),
    # nvidia-cutlass-dsl puts `cutlass` under nvidia_cutlass_dsl/python_packages (a .pth adds it to
    # sys.path); from 4.4 it is a metadata-only wheel and nvidia-cutlass-dsl-libs-* carry the code
    # under nvidia_cutlass_dsl/dsl_packages (4.6 split the Python core, libs-core, from libs-base).
    "cutlass_dsl": ("cutlass", ("nvidia_cutlass_dsl_libs_core", "nvidia_cutlass_dsl_libs_base",
                                "nvidia_cutlass_dsl_libs_cu12", "nvidia_cutlass_dsl_libs_cu13",
                                "nvidia_cutlass_dsl")),
}  # fmt: skip
UNKNOWN = "unknown"  # no metadata at all: the source digest that follows still tells versions apart


def package_dir(name: str) -> Path | None:
    """Where a package would be imported from, without importing it (probes read torch's this way too)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def newest(versions: Iterable[str]) -> str:
    """The highest of `versions` as versions compare (0.10.1 > 0.9.2), not as strings do."""
    versions = sorted(versions)  # ties (1.0 and 1.0.0) go the same way whatever order they came in
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # not a dependency of kcache: versions then compare as tuples of numbers
        pass
    else:
        try:
            return max(versions, key=Version)
        except InvalidVersion:
            pass
    return max(versions, key=lambda v: tuple(int(n) for n in re.findall(r"\d+", v)))


def _installed_version(module: str, dists: tuple[str, ...]) -> str | None:
    where = package_dir(module)
    if where is None:
        return None
    where = Path(os.path.realpath(where))
    found = [(entry, name, version, _claim(dist, where)) for entry, name, dist, version in _distributions(dists)]
    vouched: dict[str, set[str]] = {}
    listed: dict[str, set[str]] = {}
    for _, name, version, claim in found:
        if claim in ("vouches", "lists"):
            (vouched if claim == "vouches" else listed).setdefault(name, set()).add(version)
    if vouched and all(len(v) == 1 for v in vouched.values()):
        # Wheels that only add files below the package (libs-base's generated _mlir): their versions too.
        parts = {name: next(iter(v)) for name, v in vouched.items()}
        parts.update({name: newest(v) for name, v in listed.items() if name not in parts})
        if len(set(parts.values())) == 1:
            return next(iter(parts.values()))
        return " ".join(f"{name}={version}" for name, version in sorted(parts.items()))
    # Nothing vouches for this code (or two versions both do): name what importlib.metadata would
    # report, the first sys.path entry's (the newest there: a directory lists in no fixed order).
    plausible = [(entry, version) for entry, _, version, claim in found if claim != "contradicts"]
    label = UNKNOWN
    if plausible:
        first = min(entry for entry, _ in plausible)
        label = newest(version for entry, version in plausible if entry == first)
    return f"{label} source:{_source_digest(where)}"


def _distributions(dists: tuple[str, ...]) -> list[tuple[int, str, importlib.metadata.Distribution, str]]:
    """(sys.path index, name, distribution, version) of each installed copy of `dists` that has a version,
    in sys.path order, as importlib.metadata finds them."""
    import importlib.metadata

    found = []
    for index, entry in enumerate(sys.path):
        for name in dists:
            try:
                for dist in importlib.metadata.distributions(name=name, path=[entry]):
                    version = dist.metadata.get("Version")
                    if version:
                        found.append((index, name, dist, str(version)))
            except Exception:  # an unreadable entry or METADATA: that copy does not count
                continue
    return found


def _claim(dist: importlib.metadata.Distribution, where: Path) -> str | None:
    """What `dist`'s RECORD says of the package at `where` (a real path):

    vouches      it hashes top-level .py files there, and every one it hashes matches
    contradicts  a top-level .py file there is missing or not the one it hashes (another version's record)
    lists        it lists files below the package but hashes none of its top-level .py files
    None         it lists nothing there (no RECORD, an editable install's, or a copy elsewhere)
    """
    try:
        files = dist.files
        root = os.path.realpath(dist.locate_file(""))
    except Exception:  # an unreadable or malformed RECORD vouches for nothing
        return None
    top, below, matched = str(where), str(where) + os.sep, 0
    listed = False
    for file in files or ():
        full = os.path.normpath(os.path.join(root, str(file)))
        if not full.startswith(below):
            continue
        listed = True
        if os.path.dirname(full) != top or not full.endswith(".py") or file.hash is None:
            continue
        if not _matches(Path(full), file.hash.mode, file.hash.value):
            return "contradicts"
        matched += 1
    return "vouches" if matched else "lists" if listed else None


def _matches(path: Path, mode: str, value: str) -> bool:
    try:
        digest = hashlib.new(mode, path.read_bytes()).digest()
    except (OSError, ValueError):
        return False
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == value


def _source_digest(where: Path) -> str:
    """The package's top-level .py files (its __init__.py, version.py, _version.py...), by name and content."""
    h = hashlib.sha256()
    for path in sorted(where.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            data = b"\0unreadable"
        h.update(f"{path.name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]


def probe_engines(env: Mapping[str, str]) -> dict[str, str]:
    facts = {}
    for name, (module, dists) in ENGINES.items():
        version = _installed_version(module, dists)
        if version is not None:
            facts[f"engine.{name}"] = version
    return facts
