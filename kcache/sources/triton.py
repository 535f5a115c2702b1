"""Triton's kernel cache: one directory per kernel (cubin, PTX, IRs, JSON metadata).

    $TRITON_CACHE_DIR                      -> ROOT/triton
    else <inductor cache>/triton/<device>  (where torch points Triton when the variable is unset)
    else $TRITON_HOME|~/.triton/cache      (Triton's own default, knobs.cache in 3.9)

Kernel directories are named by Triton's own hash, so the per-device copies torch keeps are the
same kernels; they are merged into one directory and TRITON_CACHE_DIR points every device at it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, home_dir
from kcache.sources.inductor import inductor_dir

log = logging.getLogger(__name__)


# Triton (runtime/cache.py, FileCacheManager.put, read in 3.9) writes each file into
# <kernel dir>/tmp.pid_<pid>_<uuid>/ and then renames it into place: what is left in such a
# directory is half written, or orphaned by a killed compile.
# torch's TritonBundler (_inductor/triton_bundler.py) writes a kernel from a Mega-Cache or FX
# graph bundle into <cache dir>/tmp.<uuid4>/ and renames it; one that lost the race stays.
# Junk wherever a Triton cache sits (vLLM keeps one in its own tree).
TRITON_TEMPORARIES = ("tmp.pid_*", "tmp.????????-????-????-????-????????????")


class TritonSource(Source):
    name = "triton"
    subdir = "triton"
    env_var = "TRITON_CACHE_DIR"
    junk = COMMON_JUNK + TRITON_TEMPORARIES

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        if env.get("TRITON_CACHE_DIR"):
            return [Path(env["TRITON_CACHE_DIR"])]
        under_inductor = inductor_dir(env) / "triton"
        try:
            devices = sorted(under_inductor.iterdir()) if under_inductor.is_dir() else []
        except OSError as exc:  # another user's, unlistable: its kernels are passed over, not the publish
            log.warning("cannot list %s (%s); its Triton kernels are not published", under_inductor,
                        exc.strerror or exc)  # fmt: skip
            devices = []
        # torch makes these per-device directories itself; one that is a link is not torch's.
        home = Path(env["TRITON_HOME"]) if env.get("TRITON_HOME") else home_dir(env)
        return [d for d in devices if d.is_dir() and not d.is_symlink()] + [home / ".triton" / "cache"]
