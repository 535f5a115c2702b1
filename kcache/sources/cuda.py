"""The CUDA driver's JIT cache (PTX compiled to SASS), valid until the driver changes.

    $CUDA_CACHE_PATH (default ~/.nv/ComputeCache)  -> ROOT/cuda

The driver version is a toolchain fact, so a restored ComputeCache always matches its driver.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import Source, home_dir

# The driver evicts entries beyond CUDA_CACHE_MAXSIZE (256 MiB by default on recent drivers);
# a restored cache larger than that would be trimmed on first use.
CUDA_CACHE_MAXSIZE = str(4 * 1024**3)


class CudaSource(Source):
    name = "cuda"
    subdir = "cuda"
    env_var = "CUDA_CACHE_PATH"

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        configured = env.get("CUDA_CACHE_PATH")
        return [Path(configured) if configured else home_dir(env) / ".nv" / "ComputeCache"]

    def exports(self, root: Path) -> dict[str, str]:
        return {"CUDA_CACHE_PATH": str(self.restore_dir(root)), "CUDA_CACHE_MAXSIZE": CUDA_CACHE_MAXSIZE}
