"""Durations on the command line: `250ms`, `90s`, `30m`, `12h`, `7d`, `2w`, or combinations like `1d12h`."""

from __future__ import annotations

import math
import re
from datetime import timedelta

from kcache.errors import ConfigError

_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|[smhdw])")  # ms before m: `5ms` is not 5 minutes and an `s`
_BARE = re.compile(r"(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?")  # what float() reads: `.25`, `2.`, `1e-1` (lowercased)
# The longest duration kcache takes. Every use adds one to or subtracts one from now (a --since window, a
# ref's expiry, gc's cutoff) or sleeps on it: a century keeps all of them inside datetime's years 1..9999
# and under threading's TIMEOUT_MAX, and is longer than anyone means (a longer one is a typo).
MAX_YEARS = 100
MAX_SECONDS = MAX_YEARS * 365.25 * 86400


def parse(text: str, flag: str, *, bare_seconds: bool = False, positive: bool = False) -> timedelta:
    """A duration; with `bare_seconds` a plain number means seconds; with `positive` zero is refused."""
    compact = str(text).strip().lower()
    if bare_seconds and _BARE.fullmatch(compact):
        seconds = float(compact)
    else:
        parts = _PART.findall(compact)
        if not parts or "".join(n + u for n, u in parts) != compact:
            raise ConfigError(flag, str(text), "expected a duration such as 30s, 10m, 12h, 7d or 1d12h")
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not math.isfinite(seconds) or seconds > MAX_SECONDS:
        raise ConfigError(flag, str(text), f"is longer than {MAX_YEARS} years")
    if positive and seconds <= 0:
        raise ConfigError(flag, str(text), "the duration must be longer than zero")
    return timedelta(seconds=seconds)
