"""vLLM's cache root; its torch_compile_cache/<hash>/rank_<i>_<j>/ is all-or-nothing under vLLM's hash.

$VLLM_CACHE_ROOT (default $XDG_CACHE_HOME/vllm, else ~/.cache/vllm)  -> ROOT/vllm
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import Source, home_dir


class VllmSource(Source):
    name = "vllm"
    subdir = "vllm"
    env_var = "VLLM_CACHE_ROOT"

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        if env.get("VLLM_CACHE_ROOT"):
            return [Path(env["VLLM_CACHE_ROOT"])]
        xdg = env.get("XDG_CACHE_HOME")
        return [(Path(xdg) if xdg else home_dir(env) / ".cache") / "vllm"]
