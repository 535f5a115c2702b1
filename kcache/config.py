"""Where kcache keeps things when nobody says otherwise: flag, then environment, then default.

    $KCACHE_HOME (default ~/.cache/kcache)
      store/      file:// store       (KCACHE_STORE, --store)
      index.db    SQLite index        (KCACHE_INDEX, --index)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


@dataclass(frozen=True)
class Settings:
    home: Path
    store_url: str
    index_url: str
    s3_endpoint_url: str | None


def resolve(
    store: str | None = None,
    index: str | None = None,
    s3_endpoint_url: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Settings:
    env = os.environ if env is None else env
    home = Path(env.get("KCACHE_HOME") or Path.home() / ".cache" / "kcache").expanduser().absolute()
    return Settings(
        home=home,
        store_url=store or env.get("KCACHE_STORE") or f"file://{home / 'store'}",
        index_url=index or env.get("KCACHE_INDEX") or f"sqlite:///{home / 'index.db'}",
        s3_endpoint_url=s3_endpoint_url or env.get("AWS_ENDPOINT_URL") or None,
    )
