"""Relocation: rewrite the absolute paths a cache embeds so a layer restored elsewhere still hits.

Some engines write, beside their artifacts, index files that name those artifacts by the absolute
path they had on the publishing machine. Restored under ROOT, those paths point at nothing:

    triton    <kernel hash>/__grp__<name>.json     {"child_paths": {"<name>.cubin": "/pub/<hash>/<name>.cubin"}}
              FileCacheManager.get_group keeps only children that exist (read in 3.0, 3.2, 3.4,
              3.6) or gives up when one is missing (3.8, 3.9): either way the kernel compiles again.
              Under a relative TRITON_CACHE_DIR the paths are relative (to the publisher's cwd).
    vllm      .../rank_<i>_<j>/[<prefix>/]vllm_compile_cache.py   a Python literal whose handles
              hold "/pub/.../torch_compile_cache/.../artifact_..." (the standalone adaptor loads it)

A torch extension's ninja build folder (`load_inline()` writes its sources into it) is moved whole,
build.ninja, .ninja_log and .ninja_deps together, by kcache.ninjabuild (NINJA_BUILDS).

Restore calls `relocate` after every blob is verified in staging and before the swap. A path is
rewritten only onto a file or directory the bundle itself restores in the same layer (its
longest suffix that names one), so the rewrite is a function of verified bytes and the restore
path, and it can never point outside the layer. An index file holding a path that maps onto
nothing the bundle carries is dropped with a warning: the engine then misses and rebuilds it,
instead of finding an index that points at the publishing machine. The manifest still proves
what was published; the rewritten bytes are what the engine would have written had it compiled
under ROOT.
"""

from __future__ import annotations

import ast
import bisect
import errno
import io
import json
import logging
import os
import pprint
import re
import tokenize
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kcache import atomic, ninjabuild
from kcache import manifest as manifests
from kcache.untrusted import one_line

log = logging.getLogger(__name__)

# Index files are small; anything larger is not one (and is not read into memory). vLLM's table
# holds one ~200-byte handle per (compile range, piece) pair: a few hundred KiB for a large model
# compiled for many sizes. A Triton group names a kernel's few files: hundreds of bytes.
_MAX_INDEX_BYTES = 4 * 1024 * 1024
_MAX_GROUP_BYTES = 1024 * 1024  # json.loads of 4 MiB of `[],` held ~100 MiB
# ast.literal_eval builds the whole AST first, ~470 bytes a token for the worst text (`0,0,0,...`:
# 4 MiB of it peaked at ~2 GiB). Real tables take ~15 tokens a handle, so this allows ~6,500
# handles and bounds the AST to ~50 MiB; a table past it is dropped before it is parsed.
_MAX_TABLE_TOKENS = 100_000
_LOGGED_CHARS = 300  # of why an index file was dropped: it quotes paths from the store
_SEP = "/"
_COMPONENT = re.compile(r"[^/]+")
_DOT_DOT = re.compile(r"(?:^|/)\.\.(?:/|\Z)")


@dataclass(frozen=True)
class Layer:
    """One layer being restored: its staged copy, its final place, and the paths it carries."""

    staged: Path  # staging/files/<subdir>
    target: Path  # where the swap will move it
    known: Tree  # POSIX paths relative to the layer: every file and every parent directory
    files: frozenset[str] = frozenset()  # the files alone

    def mapped(self, path: str, *, file: bool = False) -> str | None:
        """`path` moved into the restored layer, or None if no suffix of it is something we restore
        (with `file`, a file we restore). A relative path is the publisher's too: Triton names a group's
        children under a relative TRITON_CACHE_DIR by that relative path."""
        if _DOT_DOT.search(path):
            return None
        # No path a manifest carries has more components: a longer suffix can match nothing, and
        # joining every suffix of a planted path of 80k components took 47 s. Only the last ones are
        # kept, as PurePosixPath reads them (no empty or "." component): a list of all of them held a
        # string each, ~99 MiB for a 4 MiB vLLM handle of `/ab` 1.4M times.
        parts = list(deque((m.group() for m in _COMPONENT.finditer(path) if m.group() != "."),
                           maxlen=manifests.MAX_PATH_COMPONENTS))  # fmt: skip
        within = self.files if file else self.known
        for i in range(len(parts)):
            rel = _SEP.join(parts[i:])
            if rel in within:
                return str(self.target / rel)
        return None


class Unmappable(ValueError):
    """An embedded path that maps onto nothing the bundle restores."""


def _triton_group(text: str, layer: Layer) -> str | None:
    doc = json.loads(text)
    children = doc.get("child_paths") if isinstance(doc, dict) else None
    if not isinstance(children, dict) or not all(isinstance(v, str) for v in children.values()):
        raise Unmappable("child_paths is not a mapping of names to paths")
    moved = {}
    for name, path in children.items():
        new = layer.mapped(path, file=True)
        # Triton puts every child beside its group file, under the child's own name.
        if new is None or os.path.basename(new) != name:
            raise Unmappable(f"child {name!r} at {path!r} is not a file of this bundle")
        moved[name] = new
    if moved == children:
        return None
    return json.dumps({**doc, "child_paths": moved})  # Triton's own writer: json.dumps, default separators


def _count_tokens(text: str, cap: int) -> None:
    """Unmappable past `cap` Python tokens in `text`; tokenize streams, so this holds one at a time."""
    try:
        for count, _ in enumerate(tokenize.generate_tokens(io.StringIO(text).readline), 1):
            if count > cap:
                raise Unmappable(f"has over {cap} tokens, too many for a handle table")
    except tokenize.TokenError as exc:
        raise Unmappable(f"is not a Python literal: {exc.args[0]}") from None


def _vllm_handles(text: str, layer: Layer) -> str | None:
    _count_tokens(text, _MAX_TABLE_TOKENS)
    try:
        table = ast.literal_eval(text)  # what vLLM itself uses to read it: literals only, never code
    except TypeError as exc:  # a literal Python cannot build: an unhashable dict key or set member
        raise Unmappable(f"is not a literal Python can build: {exc}") from None
    if not isinstance(table, dict):
        raise Unmappable("is not a dict literal")
    changed = False

    def move(value):
        nonlocal changed
        if isinstance(value, str) and value.startswith("/"):
            new = layer.mapped(value)
            if new is None:
                raise Unmappable(f"handle path {value!r} is not a file of this bundle")
            changed |= new != value
            return new
        if isinstance(value, (tuple, list)):
            return type(value)(move(v) for v in value)
        return value

    moved = {key: move(value) for key, value in table.items()}
    if not changed:
        return None
    text = pprint.pformat(moved)
    # vLLM reads it back with literal_eval; repr does not always write a literal (a float past the range,
    # 1e999, is written `inf`), and a table vLLM cannot read fails every start instead of compiling.
    try:
        readable = ast.literal_eval(text) == moved
    except (ValueError, SyntaxError, TypeError):
        readable = False
    if not readable:
        raise Unmappable("holds a value that does not read back as a Python literal once written")
    return text


@dataclass(frozen=True)
class Rewriter:
    name: str
    matches: Callable[[str], bool]  # on the file's base name
    rewrite: Callable[[str, Layer], str | None]  # new text, None when already right; raises on refusal
    max_bytes: int = _MAX_INDEX_BYTES  # a larger file is dropped unread


REWRITERS: dict[str, Rewriter] = {
    "triton-groups": Rewriter(
        "triton-groups", lambda n: n.startswith("__grp__") and n.endswith(".json"), _triton_group,
        max_bytes=_MAX_GROUP_BYTES,
    ),
    "vllm-handles": Rewriter("vllm-handles", lambda n: n == "vllm_compile_cache.py", _vllm_handles),
}
# A whole folder rather than one file: build.ninja, .ninja_log and .ninja_deps together (kcache.ninjabuild).
NINJA_BUILDS = "ninja-builds"


class Tree:
    """Paths and every directory above them, for `in`: the standalone adaptor's artifact may be a dir.

    Holds the paths alone, sorted; a directory is known when a path starts with it and "/". A set of
    every parent directory held each one's full path, quadratic in a path's depth (~320 KB for one
    path of 200 levels, ~3 GB for a manifest at the cap of such paths, all from the store)."""

    def __init__(self, rels: Iterable[str]):
        self._paths = sorted(set(rels))

    def __contains__(self, path: object) -> bool:
        if not isinstance(path, str):
            return False
        at = bisect.bisect_left(self._paths, path)
        if at < len(self._paths) and self._paths[at] == path:
            return True
        under = path + _SEP  # the paths below `path` sort together, where `path/` would
        at = bisect.bisect_left(self._paths, under, at)
        return at < len(self._paths) and self._paths[at].startswith(under)


def known_paths(rels: Iterable[str]) -> Tree:
    """Every path and every parent directory of `rels`."""
    return Tree(rels)


def relocate_staged(files: Path, root: Path, paths: Iterable[str], sources: Iterable) -> list[str]:
    """Restore's hook: for each layer (a kcache.sources.Source), rewrite its staged index files.

    `files` is staging/files, `paths` the manifest paths staged there. Returns the paths dropped.
    """
    paths = list(paths)
    dropped: list[str] = []
    for source in sources:
        chosen = [REWRITERS[name] for name in source.rewriters if name in REWRITERS]
        ninja = NINJA_BUILDS in source.rewriters
        prefix = source.subdir + "/"
        rels = [p.removeprefix(prefix) for p in paths if p.startswith(prefix)]
        builds = ninja and any(rel.rsplit("/", 1)[-1] == "build.ninja" for rel in rels)
        if not builds and not any(r.matches(rel.rsplit("/", 1)[-1]) for rel in rels for r in chosen):
            continue  # the common case: nothing to rewrite, so no path set to build
        layer = Layer(files / source.subdir, source.restore_dir(root), known_paths(rels), frozenset(rels))
        dropped += [prefix + rel for rel in relocate(layer, rels, source.rewriters)]
        if builds:
            ninjabuild.relocate_folders(layer.staged, layer.target, rels)
    return dropped


def relocate(layer: Layer, rels: Iterable[str], rewriters: Iterable[str]) -> list[str]:
    """Rewrite the index files among `rels` (paths relative to the layer); returns those dropped."""
    chosen = [REWRITERS[name] for name in rewriters if name in REWRITERS]
    dropped: list[str] = []
    for rel in rels:
        base = rel.rsplit("/", 1)[-1]
        for rewriter in chosen:
            if rewriter.matches(base) and not _apply(rewriter, layer, rel):
                dropped.append(rel)
    return dropped


def _apply(rewriter: Rewriter, layer: Layer, rel: str) -> bool:
    """Rewrite one staged file in place, keeping its mode and mtime. False: it was dropped."""
    path = layer.staged / rel
    st = path.stat()
    try:
        if st.st_size > rewriter.max_bytes:
            raise Unmappable(f"is {st.st_size} bytes, too large for an index file")
        text = path.read_text(encoding="utf-8")
        new = rewriter.rewrite(text, layer)
        if new is not None:
            _write_back(path, new, st)
    except (Unmappable, ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        log.warning("not restoring %s (%s): %s; the engine will rebuild it", rel, rewriter.name,
                    one_line(str(exc), _LOGGED_CHARS))  # a path from the store, clipped
        path.unlink()
        return False
    return True


def _write_back(path: Path, text: str, st: os.stat_result) -> None:
    """`text` over the staged file at `path`, with its mode and mtime. A name with no room left for
    the temp sibling (`.tmp-<name>-XXXXXXXX` past NAME_MAX) is Unmappable: that index is dropped, as
    one it cannot rewrite is, where ENAMETOOLONG had failed the whole restore."""
    try:
        atomic.write_text(path, text, mode=st.st_mode & 0o777)
    except OSError as exc:
        if exc.errno != errno.ENAMETOOLONG:
            raise  # the disk's (ENOSPC, EACCES): the restore reports it
        raise Unmappable(f"has a name too long for the temp file a rewrite needs: {exc.strerror}") from None
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # the published mtime, as for every file
