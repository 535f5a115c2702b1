"""The cache layers kcache carries. Add a layer here and nowhere else."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path

from kcache.errors import ConfigError
from kcache.sources.base import FileInfo, Source
from kcache.sources.cuda import CudaSource
from kcache.sources.cute_dsl import CuteDslSource
from kcache.sources.deep_gemm import DeepGemmSource, TrtllmDeepGemmSource
from kcache.sources.extra import ExtraSource, is_extra_name, parse_extra_dir
from kcache.sources.flashinfer import FlashInferCubinSource, FlashInferSource
from kcache.sources.inductor import InductorSource, PrecompiledHeaderSource, run_as_user, torch_user_name
from kcache.sources.megacache import MegacacheSource
from kcache.sources.torch_extensions import TorchExtensionsSource
from kcache.sources.triton import TritonSource
from kcache.sources.trtllm import TrtllmAutotunerSource
from kcache.sources.vllm import VllmSource

log = logging.getLogger(__name__)

BUILTIN: tuple[Source, ...] = (
    InductorSource(),
    PrecompiledHeaderSource(),
    TritonSource(),
    CudaSource(),
    VllmSource(),
    MegacacheSource(),
    TorchExtensionsSource(),
    FlashInferSource(),
    FlashInferCubinSource(),
    DeepGemmSource(),
    TrtllmDeepGemmSource(),
    CuteDslSource(),
    TrtllmAutotunerSource(),
)

__all__ = [
    "BUILTIN",
    "FileInfo",
    "Source",
    "ExtraSource",
    "InductorSource",
    "select",
    "parse_extra_dir",
    "for_manifest",
    "builtin",
    "run_as_user",
]


def select(names: Iterable[str] | None = None, extras: Iterable[ExtraSource] = ()) -> list[Source]:
    """The built-in layers named (all when `names` is None), then the user's extra directories.

    A layer named twice is one layer (a manifest holding a path twice is refused as corrupt), and
    so is an extra directory given twice under one name; one name for two directories is an error.
    """
    by_name = {s.name: s for s in BUILTIN}
    if names is None:
        chosen = list(BUILTIN)
    else:
        names = list(dict.fromkeys(names))
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ConfigError("layer", ",".join(unknown), f"known layers: {', '.join(by_name)}")
        chosen = [by_name[n] for n in names]
    return chosen + _distinct(extras)


def _distinct(extras: Iterable[ExtraSource]) -> list[ExtraSource]:
    """One source per name; two names that kcache.env would export as one variable are refused
    (a-b and a_b both become the variable for A_B: the model would read the other directory)."""
    kept: dict[str, ExtraSource] = {}
    exported: dict[str, str] = {}
    for extra in extras:
        seen = kept.setdefault(extra.name, extra)
        name = extra.name.removeprefix("extra:")
        if seen is not extra and _place(seen) != _place(extra):
            raise ConfigError("--extra-dir", name,
                              f"is given twice, for {_place(seen)} and {_place(extra)}; give each directory "
                              "a name of its own")  # fmt: skip
        other = exported.setdefault(extra.env_var, name)
        if other != name:
            raise ConfigError("--extra-dir", name, f"would be exported as {extra.env_var}, as {other} is; "
                              "give it a name that differs in more than case and '-' against '_'")  # fmt: skip
    return list(kept.values())


def _place(extra: ExtraSource) -> str:
    """Where an extra directory is read from, spelled one way (`d`, `./d` and `d/` are one place)."""
    return ", ".join(os.path.abspath(p) for p in extra.live_dirs({})) or extra.subdir


def in_root(root: Path, names: Iterable[str] | None = None, extras: Iterable[ExtraSource] = ()) -> list[Source]:
    """Layers to read from a restore root: the chosen built-ins, the extras named, and every
    extra directory a restore laid down under ROOT/extra/ (publish --from must not drop them)."""
    extras = list(extras)
    named = {e.name for e in extras}
    extra_dir = Path(root) / "extra"
    # Only names restore can have laid down; a link here is refused when the layer is read (Source.read_dirs).
    try:
        found = sorted(p.name for p in extra_dir.iterdir() if p.is_dir() and is_extra_name(p.name))
    except FileNotFoundError:
        found = []
    except OSError as exc:  # not a directory; another user's, unlistable: the extra layers are passed over
        if extra_dir.exists() and extra_dir.is_dir():
            log.warning("cannot list %s (%s); its extra layers are not published", extra_dir, exc.strerror or exc)
        found = []
    chosen = select(names, extras + [ExtraSource(n) for n in found if f"extra:{n}" not in named])
    user = _header_user(Path(root))
    return [PrecompiledHeaderSource(user) if user and isinstance(s, PrecompiledHeaderSource) else s for s in chosen]


def _header_user(root: Path) -> str | None:
    """The user restore laid the precompiled header out for, from its marker, unless KCACHE_RUN_AS
    names one: a ROOT restored for the model's user and published again by a sidecar or an operator
    under another name had its header layer dropped, and every later pod rebuilt the header."""
    from kcache import readiness
    from kcache.sources.inductor import RUN_AS_VAR, torch_user_name

    if os.environ.get(RUN_AS_VAR):
        return None  # the layer's own default reads it
    if _holds_files(PrecompiledHeaderSource().restore_dir(root)):
        return None  # a header the model built as this user (or one restored for it) is the one to publish
    recorded = (readiness.read_marker(root, readiness.RESTORE_MARKER) or {}).get("run_as")
    if not isinstance(recorded, str):
        return None
    try:
        return torch_user_name(recorded)
    except ConfigError:  # another container may write ROOT
        log.warning("ignoring the user %r the restore marker names for the precompiled header", recorded[:80])
        return None


def _holds_files(directory: Path) -> bool:
    try:
        with os.scandir(directory) as entries:
            return any(True for _ in entries)
    except OSError:  # absent, not a directory, unreadable
        return False


def builtin(run_as: str | None = None) -> list[Source]:
    """The built-in layers, with the precompiled header laid out for the user `run_as` (when given)."""
    return [PrecompiledHeaderSource(run_as) if isinstance(s, PrecompiledHeaderSource) and run_as else s
            for s in BUILTIN]  # fmt: skip


_ROOT = Path("/")
# Where under ROOT restore lays each built-in layer but the header, whose place names its user.
_FIXED_PLACES = frozenset(s.restore_dir(_ROOT).relative_to(_ROOT).as_posix() for s in BUILTIN
                          if not isinstance(s, PrecompiledHeaderSource))  # fmt: skip
_HEADER_PLACE = ("tmp/torchinductor_", "/precompiled_headers")


def is_kept_back_place(rel: str) -> bool:
    """Whether a restore marker's `kept_back` may name `rel`: a layer's place, or "extra", which restore
    keeps back whole. Restore writes no other; a container of the pod may (`""` named all of ROOT)."""
    return rel == "extra" or is_place(rel)


def is_place(rel: str) -> bool:
    """Whether the POSIX path `rel` is where restore lays a layer under ROOT: a built-in's place, the
    precompiled header's for a user torch could name, or extra/NAME. What a file in ROOT names as a
    layer's place (the restore marker, which every container of the pod may write) must be one."""
    if rel in _FIXED_PLACES:
        return True
    if rel.startswith("extra/"):
        return is_extra_name(rel.removeprefix("extra/"))
    head, tail = _HEADER_PLACE
    if not (rel.startswith(head) and rel.endswith(tail)):
        return False
    user = rel[len(head) : -len(tail)]
    try:
        return torch_user_name(user) == user
    except ConfigError:
        return False


def for_manifest(layers: Iterable[str], run_as: str | None = None) -> list[Source]:
    """Sources for the layer names a manifest lists (extra:NAME included)."""
    by_name = {s.name: s for s in builtin(run_as)}
    result: list[Source] = []
    for name in layers:
        if name in by_name:
            result.append(by_name[name])
        elif name.startswith("extra:"):
            result.append(ExtraSource(name.removeprefix("extra:")))
    return result


def all_exports(root: Path, layers: Iterable[str] = ()) -> dict[str, str]:
    """Variables for the built-in layers plus any extra layers a bundle holds."""
    exports: dict[str, str] = {}
    for source in list(BUILTIN) + [s for s in for_manifest(layers) if isinstance(s, ExtraSource)]:
        exports.update(source.exports(root))
    return exports
