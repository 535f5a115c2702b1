"""Canonical JSON: the one serialization of anything kcache hashes.

Sorted keys, compact separators, UTF-8, no NaN. Two equal values always give the same bytes,
so their hashes (fingerprint keys, manifest ids) agree across machines and Python versions.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import xxhash


def dumps(value: Any) -> bytes:
    """Serialize `value` canonically (sorted keys, compact, UTF-8, no NaN/Infinity)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def xxh3(value: Any) -> str:
    """Fingerprint hash: xxh3_128 over the canonical bytes, as 32 hex digits.

    Fast and stable, for keys that name a machine or workload. Never a content address:
    a writer can collide xxhash on purpose (see `sha256`).
    """
    return xxhash.xxh3_128_hexdigest(dumps(value))


def sha256(data: bytes) -> str:
    """Content address: SHA-256 hex of raw bytes."""
    return hashlib.sha256(data).hexdigest()
