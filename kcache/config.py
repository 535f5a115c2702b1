"""Where kcache keeps things when nobody says otherwise: flag, then environment, then default.

    $KCACHE_HOME (default ~/.cache/kcache)
      store/      file:// store       (KCACHE_STORE, --store)
      index.db    SQLite index        (KCACHE_INDEX, --index)

Restore reads refs from the store instead of an index when the index is `none`, or when none was
named and the default SQLite file does not exist (a fresh pod with read access to the bucket).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    home: Path
    store_url: str
    index_url: str
    s3_endpoint_url: str | None
    index_explicit: bool = False  # named by flag or environment, not the default

    @property
    def default_index_path(self) -> Path:
        return self.home / "index.db"


def resolve(
    store: str | None = None,
    index: str | None = None,
    s3_endpoint_url: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    env = os.environ if env is None else env
    home = Path(env.get("KCACHE_HOME") or Path.home() / ".cache" / "kcache").expanduser().absolute()
    named_index = index or env.get("KCACHE_INDEX")
    return Settings(
        home=home,
        store_url=store or env.get("KCACHE_STORE") or f"file://{home / 'store'}",
        index_url=named_index or f"sqlite:///{home / 'index.db'}",
        s3_endpoint_url=s3_endpoint_url or env.get("AWS_ENDPOINT_URL") or None,
        index_explicit=bool(named_index),
    )
