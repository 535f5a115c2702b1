"""The CUTLASS CuTe DSL's file cache of compiled kernels.

    $CUTE_DSL_CACHE_DIR, else ${TMPDIR:-/tmp}/<user>/cutlass_python_cache   -> ROOT/cute_dsl/
        <hash>.mlir ...        carried
        tmp.pid_<pid>_<uuid>/  not carried (an atomic write in flight)

Read in nvidia-cutlass-dsl's cutlass/base_dsl/cache_helpers.py (4.3 to 4.7): with CUTE_DSL_CACHE_DIR
unset, the cache is <TMPDIR or tempfile.gettempdir()>/<USER or USERNAME, else the passwd name>/
cutlass_python_cache, or <TMPDIR ...>/cutlass_python_cache for a uid without a passwd entry (4.2 and
older: /tmp/<user>/cutlass_python_cache, whatever either variable says, which no restore reaches);
entries are named by a hash of the generated IR, the DSL's Python sources, its shared libraries and
every CUTE_DSL_* variable, written through a tmp.pid_* directory and os.replace, and read back with a
CRC check. Restore exports CUTE_DSL_CACHE_DIR, so the model's user
name does not matter there; a live publish reads the directory of KCACHE_RUN_AS, else of USER.
Facts it depends on: nvidia-cutlass-dsl version, CUDA, GPU SM.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, temp_dir
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
        named = (os.environ.get(RUN_AS_VAR), env.get("USER"), env.get("USERNAME"), os.environ.get("USER"))
        user = next((name for name in named if name), None) or _passwd_name()
        # A uid without a passwd entry: CuTe DSL cannot name a user and keeps its cache one level up.
        return [temp_dir(env) / user / "cutlass_python_cache" if user else temp_dir(env) / "cutlass_python_cache"]


def _passwd_name() -> str | None:
    """The passwd name of this process's uid, as CuTe DSL asks for it (not getpass's LOGNAME, nor torch's uid_<n>)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return None
