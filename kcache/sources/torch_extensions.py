"""torch C++/CUDA extensions built with torch.utils.cpp_extension.load() (ninja), per extension name.

    $TORCH_EXTENSIONS_DIR/<name>/                              -> ROOT/torch_extensions/<name>/
    else $XDG_CACHE_HOME|~/.cache/torch_extensions/py<MM><abiflags>_<cpu|cuXYZ|rocmXYZ>/<name>/
        build.ninja .ninja_log .ninja_deps *.o <name>.so          carried (ninja needs its log)
        lock                                                      not carried

Read in torch 2.13's utils/cpp_extension.py (_get_build_directory, get_default_build_root): with
TORCH_EXTENSIONS_DIR set, torch builds straight into <dir>/<name>; without it, into a folder named by
Python and accelerator under the default root. Restore exports TORCH_EXTENSIONS_DIR, so a default
root is read from the one folder the bundle's torch builds in (its facts: python, torch.cuda,
torch.hip). The others are other builds of the same names (a kept HOME, an image that changed its
CUDA or Python): merged first-wins, a stale one won and every restored pod rebuilt the extension.

ninja decides "up to date" from .ninja_log (the command's hash and the output's recorded mtime)
against the inputs' mtimes, so restore keeps every file's published mtime. build.ninja names the
sources and torch's include directories by absolute path: for load() (sources in the image) no path
inside the build directory, so a build restored under another ROOT is current as long as torch and
the sources sit where they did; if they moved, torch rewrites build.ninja and ninja rebuilds,
rightly. load_inline() (and hipify) writes its sources into the build directory itself, so its
commands (hashed in .ninja_log) and .ninja_deps name the build directory: restored under another
directory than it was built in, it is rebuilt (docs/design.md, Known limits). torch's path is a toolchain
fact, the sources are in no fact: sources changed but older than the build are not rebuilt
(docs/design.md, Known limits).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, home_dir

_NONE = "none"  # kcache.fingerprint.NONE: a fact nothing could read


def default_root(env: Mapping[str, str]) -> Path:
    """torch._appdirs.user_cache_dir("torch_extensions") on Linux."""
    xdg = env.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else home_dir(env) / ".cache") / "torch_extensions"


def build_folder(facts: Mapping[str, str]) -> str:
    """The folder under the default root that the torch `facts` describe builds in, named as torch
    names it: py<major><minor><abiflags>_<rocm<hip>|cu<cuda>|cpu>, dots dropped. The python fact holds
    no abiflags (3.13t); this interpreter's are taken when it is that Python, else none."""
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    python = facts.get("python", _NONE)
    python = here if python == _NONE else python
    abiflags = getattr(sys, "abiflags", "") if python == here else ""
    hip, cuda = facts.get("torch.hip", _NONE), facts.get("torch.cuda", _NONE)
    if hip != _NONE:
        accelerator = "rocm" + hip.replace(".", "")
    elif cuda != _NONE:
        accelerator = "cu" + cuda.replace(".", "")
    else:
        accelerator = "cpu"
    return f"py{python.replace('.', '')}{abiflags}_{accelerator}"


class TorchExtensionsSource(Source):
    """`facts`: the torch whose default build folder a live publish reads (None: the torch this
    interpreter would import, probed)."""

    name = "torch_extensions"
    needs_torch = True
    subdir = "torch_extensions"
    env_var = "TORCH_EXTENSIONS_DIR"
    junk = COMMON_JUNK + ("lock",)  # torch's FileBaton while a build runs
    # load_inline's folders name themselves in build.ninja, .ninja_log's hashes and .ninja_deps.
    rewriters = ("triton-groups", "ninja-builds")

    def __init__(self, facts: Mapping[str, str] | None = None):
        self.facts = facts

    def for_facts(self, facts: Mapping[str, str]) -> TorchExtensionsSource:
        return type(self)(facts)

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        if env.get("TORCH_EXTENSIONS_DIR"):
            return [Path(env["TORCH_EXTENSIONS_DIR"])]
        if self.facts is None:
            from kcache import probes  # reads torch/version.py as text, never imports torch

            facts = {**probes.probe_platform(env), **probes.probe_torch(env)}
        else:
            facts = self.facts
        return [default_root(env) / build_folder(facts)]
