"""Stats: did the caches kcache moved get used, and what did they save?

A restore that transferred 30 MiB and saved nothing looks like success from the outside; the
events table knows better. This module turns a window ("the last 7 days") into the query the
index runs (kcache/index/stats.py) and returns its frozen EventStats.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the SQL layer loads only when a caller opens an index
    from kcache.index import Index
    from kcache.index.stats import EventStats

def summarize(
    index: Index, *, window: timedelta | None = None, model: str | None = None, now: datetime | None = None
) -> EventStats:
    """Aggregate the events of the last `window` (all events when None), optionally for one model."""
    from kcache.index.stats import event_stats

    since = None if window is None else (now or datetime.now(timezone.utc)) - window
    return event_stats(index, since=since, model=model)
