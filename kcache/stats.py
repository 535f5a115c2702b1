"""Stats: did the caches kcache moved get used, and what did they save?

A restore that transferred 30 MiB and saved nothing looks like success from the outside; the
events table knows better. This module turns a window ("the last 7 days") into the query the
index runs (kcache/index/stats.py) and returns its frozen EventStats.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

from kcache.errors import ConfigError

if TYPE_CHECKING:  # the SQL layer loads only when a caller opens an index
    from kcache.index import Index
    from kcache.index.stats import EventStats

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")


def parse_duration(text: str, flag: str = "--since") -> timedelta:
    """`90s`, `30m`, `12h`, `7d`, `2w`, or combinations such as `1d12h`."""
    compact = text.strip().lower()
    parts = _PART.findall(compact)
    if not parts or "".join(n + u for n, u in parts) != compact:
        raise ConfigError(flag, text, "expected a duration such as 30m, 12h, 7d or 1d12h")
    return timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in parts))


def summarize(
    index: Index, *, window: timedelta | None = None, model: str | None = None, now: datetime | None = None
) -> EventStats:
    """Aggregate the events of the last `window` (all events when None), optionally for one model."""
    from kcache.index.stats import event_stats

    since = None if window is None else (now or datetime.now(timezone.utc)) - window
    return event_stats(index, since=since, model=model)
