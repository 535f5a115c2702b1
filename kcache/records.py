"""Plain records shared by the index, publish and restore; importing them loads no SQL library."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class Bundle:
    id: str
    bundle_key: str
    toolchain_key: str
    workload_key: str
    model: str | None
    facts: dict
    layers: tuple[str, ...]
    files: int
    bytes: int
    created_at: datetime
    created_by: str
    status: str
    compile_seconds: float | None = None  # the cold compile a hit saves, as measured at publish


@dataclass(frozen=True)
class BlobLocation:
    id: str
    pack_id: str
    offset: int
    length: int
    size: int


@dataclass(frozen=True)
class Event:
    kind: str
    status: str
    bundle_key: str | None = None
    bundle_id: str | None = None
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    reason: str | None = None
