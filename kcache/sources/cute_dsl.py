"""The CUTLASS CuTe DSL's file cache of compiled kernels.

    $CUTE_DSL_CACHE_DIR, else ${TMPDIR:-/tmp}/<user>/cutlass_python_cache   -> ROOT/cute_dsl/
        <hash>.mlir ...        carried
        tmp.pid_<pid>_<uuid>/  not carried (an atomic write in flight)

Read in nvidia-cutlass-dsl's cutlass/base_dsl/cache_helpers.py (4.x): with CUTE_DSL_CACHE_DIR unset,
the cache is <TMPDIR or tempfile.gettempdir()>/<USER or USERNAME, else the passwd name>/
cutlass_python_cache; entries are named by a hash of the generated IR, the DSL's Python sources,
its shared libraries and every CUTE_DSL_* variable, written through a tmp.pid_* directory and
os.replace, and read back with a CRC check. Restore exports CUTE_DSL_CACHE_DIR, so the model's user
name does not matter there; a live publish reads the directory of KCACHE_RUN_AS, else of USER.
Facts it depends on: nvidia-cutlass-dsl version, CUDA, GPU SM.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, temp_dir, torch_user
from kcache.sources.inductor import RUN_AS_VAR


class CuteDslSource(Source):
    name = "cute_dsl"
    subdir = "cute_dsl"
    env_var = "CUTE_DSL_CACHE_DIR"
    junk = COMMON_JUNK + ("tmp.pid_*",)

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        if env.get("CUTE_DSL_CACHE_DIR"):
            return [Path(env["CUTE_DSL_CACHE_DIR"])]
        # The model's user, as for the Inductor layers: a publisher running as another reads the model's.
        user = os.environ.get(RUN_AS_VAR) or env.get("USER") or env.get("USERNAME") or os.environ.get("USER") \
            or torch_user()
        return [temp_dir(env) / user / "cutlass_python_cache"]
