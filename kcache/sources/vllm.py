"""vLLM's cache root; its torch_compile_cache/<hash>/rank_<i>_<j>/ is all-or-nothing under vLLM's hash.

$VLLM_CACHE_ROOT (default $XDG_CACHE_HOME/vllm, else ~/.cache/vllm)  -> ROOT/vllm
    torch_compile_cache/<hash>/rank_<i>_<j>/[<prefix>/]vllm_compile_cache.py   handles with absolute paths
    torch_compile_cache/<hash>/rank_<i>_<j>/{inductor_cache,triton_cache}/     vLLM points torch and Triton here
    torch_aot_compile/<hash>/rank_<i>_<j>/model                                AOT artifact (opaque bytes)

Read in vLLM's compilation/backends.py and compiler_interface.py (0.8 and a 2025 main): the handle
of the standalone adaptor is (key, os.path.join(cache_dir, key)) and `load` opens that path as is,
so restore rewrites both index kinds (kcache.relocate).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, home_dir
from kcache.sources.triton import TRITON_TEMPORARIES


class VllmSource(Source):
    name = "vllm"
    needs_torch = True
    subdir = "vllm"
    env_var = "VLLM_CACHE_ROOT"
    rewriters = ("triton-groups", "vllm-handles")
    junk = COMMON_JUNK + TRITON_TEMPORARIES  # vLLM points Triton at <rank dir>/triton_cache

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        # vLLM's envs.py: os.path.expanduser(VLLM_CACHE_ROOT, else <XDG_CACHE_HOME or ~/.cache>/vllm)
        if env.get("VLLM_CACHE_ROOT"):
            return [_expanded(env["VLLM_CACHE_ROOT"], env)]
        xdg = env.get("XDG_CACHE_HOME")
        return [_expanded(str(Path(xdg) / "vllm"), env) if xdg else home_dir(env) / ".cache" / "vllm"]


def _expanded(path: str, env: Mapping[str, str]) -> Path:
    """`path` as os.path.expanduser gives it in a process started with `env`: a leading `~` is its HOME."""
    if path == "~" or path.startswith("~/"):
        return home_dir(env) / path[1:].lstrip("/")
    return Path(os.path.expanduser(path))  # ~user: the passwd entry's home; anything else as it is
