"""torch's Mega-Cache blob (torch.compiler.save_cache_artifacts), saved by kcache.torch.

    $KCACHE_MEGACACHE/artifacts.bin  -> ROOT/megacache/artifacts.bin

There is no default live location: torch keeps the blob in memory until someone saves it, so the
layer is read from ROOT/megacache (publish --from ROOT) or from where KCACHE_MEGACACHE points.
A service calls kcache.torch.load_megacache() at start-up to hot-load it. On CPU it carries graph
entries only (C++ kernels are rebuilt), so it complements the inductor layers, never replaces them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import Source


class MegacacheSource(Source):
    name = "megacache"
    needs_torch = True
    subdir = "megacache"
    env_var = "KCACHE_MEGACACHE"

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        return [Path(env["KCACHE_MEGACACHE"])] if env.get("KCACHE_MEGACACHE") else []
