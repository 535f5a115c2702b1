"""Formatting for people: sizes, durations, tables. Only the CLI formats; the library keeps raw units."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from datetime import datetime
from typing import Any

from kcache.untrusted import one_line

# Characters a table cell or a value line may show: a manifest path can be long, a screen is wider.
CELL_LIMIT = 1000


def size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def seconds(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.2f} s"


def when(ts: datetime) -> str:
    return ts.strftime("%Y-%m-%d %H:%M:%S")


def text(value: Any, limit: int = CELL_LIMIT) -> str:
    """A value from the index, the store or another container, safe on a terminal: one line, no
    escape sequences (kcache.untrusted). Every human-readable line that shows such a value uses this."""
    return one_line(value, limit)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Columns of `rows`; every cell passes through `text`, so a hostile value cannot break the table."""
    cells = [list(map(str, headers))] + [[text(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells)


def bundle_json(b, *, fields: Iterable[str] | None = None) -> dict:
    """A bundle as every command's --json names it: `bundle_id` (never `id`), times in ISO 8601.
    `fields`: only these (besides bundle_id)."""
    doc = {**asdict(b), "created_at": b.created_at.isoformat(), "layers": list(b.layers)}
    doc["bundle_id"] = doc.pop("id")
    return doc if fields is None else {"bundle_id": doc["bundle_id"], **{f: doc[f] for f in fields}}


def to_json(value: Any) -> str:
    """Strict JSON: a float that is no number (inf, nan: a row stored before flags were checked) is
    null, never `Infinity` or `NaN`, which JSON parsers other than Python's refuse."""
    return json.dumps(_finite(value), sort_keys=True, default=str, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
