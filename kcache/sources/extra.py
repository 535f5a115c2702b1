"""User-named directories (TensorRT timing caches, FlashInfer or DeepGEMM JIT dirs, ...).

--extra-dir NAME=PATH  -> ROOT/extra/NAME, exported as KCACHE_EXTRA_<NAME>
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from kcache.errors import ConfigError
from kcache.sources.base import Source

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")


def is_extra_name(name: str) -> bool:
    return bool(_NAME.match(name))


class ExtraSource(Source):
    def __init__(self, name: str, path: Path | None = None):
        if not is_extra_name(name):
            raise ConfigError("extra directory name", name, "use letters, digits, '-' and '_'")
        self.name = f"extra:{name}"
        self.subdir = f"extra/{name}"
        self.env_var = "KCACHE_EXTRA_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()
        self._path = path

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        return [self._path] if self._path else []


def parse_extra_dir(spec: str) -> ExtraSource:
    """`NAME=PATH` from the command line."""
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise ConfigError("--extra-dir", spec, "expected NAME=PATH")
    return ExtraSource(name, Path(path).expanduser())
