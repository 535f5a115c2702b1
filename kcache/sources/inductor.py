"""Inductor's cache and its precompiled header: two layers, because torch keeps them apart.

    $TORCHINDUCTOR_CACHE_DIR (default $TMPDIR/torchinductor_$USER)  -> ROOT/inductor
        fxgraph/ aotautograd/ <hh>/*.so|*.cpp|*.py  dynamo/           carried
        locks/ triton/ precompiled_headers/                          not carried here
    $TMPDIR/torchinductor_$USER/precompiled_headers
        -> ROOT/tmp/torchinductor_$USER/precompiled_headers          (manifest paths: inductor-pch/...)

Torch looks for the precompiled header under the temp dir whatever TORCHINDUCTOR_CACHE_DIR says,
so the env file points TMPDIR into ROOT (an init container's /tmp is not the model container's).

The header's directory is named for the user who runs torch (torch 2.13's
runtime/cache_dir_utils.py: getpass.getuser(), else uid_<uid>, then [\\/:*?"<>|] -> _). The init
container often runs as another user than the model (uid 65532 without a passwd entry vs root), so
the header is laid out for the model's user: `restore --run-as` / KCACHE_RUN_AS, else the user
publish recorded in the manifest (layer_info["inductor-pch"]["user"]), else the restoring user.
A live publish reads both default directories for one user: KCACHE_RUN_AS, else the current one.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path

from kcache.errors import ConfigError
from kcache.sources.base import COMMON_JUNK, Source, temp_dir, torch_user

log = logging.getLogger(__name__)
RUN_AS_VAR = "KCACHE_RUN_AS"


def inductor_dir(env: Mapping[str, str]) -> Path:
    """Where Inductor keeps its cache for the model's user (as the precompiled header's layer reads
    it: KCACHE_RUN_AS, else ours) in a process started with `env`."""
    configured = env.get("TORCHINDUCTOR_CACHE_DIR")
    return Path(configured) if configured else temp_dir(env) / f"torchinductor_{run_as_user(None, {})}"


class InductorSource(Source):
    name = "inductor"
    needs_torch = True
    subdir = "inductor"
    env_var = "TORCHINDUCTOR_CACHE_DIR"
    junk = COMMON_JUNK
    foreign = ("locks", "triton", "precompiled_headers")

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        return [inductor_dir(env)]


def torch_user_name(user: str) -> str:
    """`user` as torch puts it into directory names; refuses what could not be a user's name."""
    if not user or len(user) > 256 or any(ord(c) < 32 or c == "\x7f" for c in user):
        raise ConfigError("--run-as", user, "expected a user name as getpass.getuser() returns it, e.g. root")
    return re.sub(r'[\\/:*?"<>|]', "_", user)


def run_as_user(explicit: str | None, layer_info: Mapping[str, Mapping[str, str]]) -> str:
    """The user the model will run as: the flag, else KCACHE_RUN_AS, else what publish recorded, else us."""
    chosen = explicit or os.environ.get(RUN_AS_VAR)
    if chosen:
        return torch_user_name(chosen)
    recorded = layer_info.get(PrecompiledHeaderSource.name, {}).get("user")
    if recorded:
        try:
            return torch_user_name(recorded)
        except ConfigError:  # from the store: hostile until proven otherwise
            log.warning("ignoring the recorded user %r of the precompiled header", recorded[:80])
    return torch_user()


class PrecompiledHeaderSource(Source):
    """The header under the temp dir, for `user` (default: KCACHE_RUN_AS, else the current user)."""

    name = "inductor-pch"
    needs_torch = True
    subdir = "inductor-pch"
    env_var = "TMPDIR"

    def __init__(self, user: str | None = None):
        self.user = user

    def _user(self) -> str:
        return self.user or run_as_user(None, {})

    def restore_dir(self, root: Path) -> Path:
        # Torch derives this path from the user who runs it, so it is the model's user, not ours.
        return root / "tmp" / f"torchinductor_{self._user()}" / "precompiled_headers"

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        return [temp_dir(env) / f"torchinductor_{self._user()}" / "precompiled_headers"]

    def layer_info(self) -> dict[str, str]:
        return {"user": self._user()}

    def exports(self, root: Path) -> dict[str, str]:
        return {"TMPDIR": str(root / "tmp")}
