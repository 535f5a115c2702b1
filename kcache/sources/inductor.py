"""Inductor's cache and its precompiled header: two layers, because torch keeps them apart.

    $TORCHINDUCTOR_CACHE_DIR (default $TMPDIR/torchinductor_$USER)  -> ROOT/inductor
        fxgraph/ aotautograd/ <hh>/*.so|*.cpp|*.py  dynamo/           carried
        locks/ triton/ precompiled_headers/                          not carried here
    $TMPDIR/torchinductor_$USER/precompiled_headers
        -> ROOT/tmp/torchinductor_$USER/precompiled_headers          (manifest paths: inductor-pch/...)

Torch looks for the precompiled header under the temp dir whatever TORCHINDUCTOR_CACHE_DIR says,
so the env file points TMPDIR into ROOT (an init container's /tmp is not the model container's).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, temp_dir, torch_user


def inductor_dir(env: Mapping[str, str]) -> Path:
    """Where Inductor keeps its cache for a process started with `env`."""
    configured = env.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(configured) if configured else temp_dir(env) / f"torchinductor_{torch_user()}"


class InductorSource(Source):
    name = "inductor"
    subdir = "inductor"
    env_var = "TORCHINDUCTOR_CACHE_DIR"
    junk = COMMON_JUNK
    foreign = ("locks", "triton", "precompiled_headers")

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        return [inductor_dir(env)]


class PrecompiledHeaderSource(Source):
    name = "inductor-pch"
    subdir = "inductor-pch"
    env_var = "TMPDIR"

    def restore_dir(self, root: Path) -> Path:
        # The user is the restoring one: torch derives this path from the user who runs it.
        return root / "tmp" / f"torchinductor_{torch_user()}" / "precompiled_headers"

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        return [temp_dir(env) / f"torchinductor_{torch_user()}" / "precompiled_headers"]

    def exports(self, root: Path) -> dict[str, str]:
        return {"TMPDIR": str(root / "tmp")}
