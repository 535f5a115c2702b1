"""torch C++/CUDA extensions built with torch.utils.cpp_extension.load() (ninja), per extension name.

    $TORCH_EXTENSIONS_DIR/<name>/                              -> ROOT/torch_extensions/<name>/
    else $XDG_CACHE_HOME|~/.cache/torch_extensions/py<MM><abiflags>_<cpu|cuXYZ|rocmXYZ>/<name>/
        build.ninja .ninja_log .ninja_deps *.o <name>.so          carried (ninja needs its log)
        lock                                                      not carried

Read in torch 2.13's utils/cpp_extension.py (_get_build_directory, get_default_build_root): with
TORCH_EXTENSIONS_DIR set, torch builds straight into <dir>/<name>; without it, into a folder named by
Python and accelerator under the default root. Restore exports TORCH_EXTENSIONS_DIR, so a default
root is read from its build folders for this Python (merged: extension names are the keys).

ninja decides "up to date" from .ninja_log (the command's hash and the output's recorded mtime)
against the inputs' mtimes, so restore keeps every file's published mtime. build.ninja names the
sources and torch's include directories by absolute path but no path inside the build directory:
a build restored under another ROOT is current as long as torch and the sources sit where they did;
if they moved, torch rewrites build.ninja and ninja rebuilds, rightly. torch's path is a toolchain
fact, the sources are in no fact: sources changed but older than the build are not rebuilt
(docs/design.md, Known limits).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, home_dir


def default_root(env: Mapping[str, str]) -> Path:
    """torch._appdirs.user_cache_dir("torch_extensions") on Linux."""
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else home_dir(env) / ".cache") / "torch_extensions"


class TorchExtensionsSource(Source):
    name = "torch_extensions"
    needs_torch = True
    subdir = "torch_extensions"
    env_var = "TORCH_EXTENSIONS_DIR"
    junk = COMMON_JUNK + ("lock",)  # torch's FileBaton while a build runs

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        if env.get("TORCH_EXTENSIONS_DIR"):
            return [Path(env["TORCH_EXTENSIONS_DIR"])]
        root = default_root(env)
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_"
        return sorted(d for d in root.glob(python + "*") if d.is_dir()) if root.is_dir() else []
