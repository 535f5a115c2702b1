"""Sizes on the command line and in the environment: `1073741824`, `512Mi`, `50Gi`, `50GiB`, `2T`.

Binary units only (K/Ki/KiB = 1024): a disk cap written as Kubernetes writes quantities (`50Gi`)
must mean what the volume's `sizeLimit` means. Decimal suffixes (`50G`) are read as binary too,
a few percent more than a disk maker's gigabyte, which errs on the side of the reader's intent.
"""

from __future__ import annotations

import re

from kcache.errors import ConfigError

_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b?)?")


def parse(text: str, what: str) -> int:
    """A positive number of bytes, or ConfigError naming `what` (the flag or variable)."""
    compact = str(text).strip().lower()
    match = _SIZE.fullmatch(compact)
    if not match or (match.group(2) == "" and not compact.isdigit()):
        raise ConfigError(what, str(text), "expected a size such as 1073741824, 512Mi or 50Gi")
    number, unit = match.group(1), _UNITS[match.group(2)]
    if len(number) > 30:  # past any disk; int() refuses more than 4300 digits, float() turns them to inf
        raise ConfigError(what, f"{compact[:20]}... ({len(compact)} characters)", "the size is too large")
    value = int(number) * unit if number.isdigit() else int(float(number) * unit)  # no float for whole numbers
    if value <= 0:
        raise ConfigError(what, str(text), "the size must be larger than zero")
    return value
