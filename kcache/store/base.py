"""The store contract: a flat namespace of write-once objects, addressed by key.

The store moves bytes and knows nothing of bundles or SQL. Keys are POSIX-like strings:

    packs/<hh>/<pack-id>            packs (see kcache.packs)
    manifests/<hh>/<manifest-id>    manifests (see kcache.manifest)
    refs/<bundle-key>               pointer to the newest manifest of a bundle key

Everything under packs/ and manifests/ is content-addressed: writing a key that already exists
is a no-op that reports False, never an overwrite. Readers re-hash what they read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO, Protocol

from kcache.errors import ObjectMissing

_KEY = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*\Z")


def pack_key(pack_id: str) -> str:
    return f"packs/{pack_id[:2]}/{pack_id}"


def manifest_key(manifest_id: str) -> str:
    return f"manifests/{manifest_id[:2]}/{manifest_id}"


def ref_key(bundle_key: str) -> str:
    return f"refs/{bundle_key}"


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: datetime  # UTC


@dataclass(frozen=True)
class Leftover:
    """What a write killed part-way left behind: a file:// temp file, an S3 multipart upload never
    completed. No reader sees it; it takes space (and on S3, billing) until gc removes it."""

    key: str  # the object it was to become (a temp file: its own path in the store)
    size: int  # bytes it holds; 0 where the store does not say (S3 uploads)
    modified: datetime  # UTC: when the write began
    upload_id: str | None = None  # S3's multipart upload


def is_valid_key(key: str) -> bool:
    return bool(_KEY.match(key)) and ".." not in key.split("/")


class Store(Protocol):
    """What every backend provides. Methods raise kcache.errors.StoreError (or ObjectMissing)."""

    url: str

    def put_file(self, key: str, path: Path) -> bool:
        """Store the file's bytes under `key` unless it exists. True if this call wrote it."""

    def put_bytes(self, key: str, data: bytes) -> bool:
        """Like put_file, for bytes in memory."""

    def get_bytes(self, key: str) -> bytes:
        """The whole object. Raises ObjectMissing if absent."""

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        """A stream of exactly `length` bytes starting at `offset`; the caller closes it."""

    def size(self, key: str) -> int:
        """Object size in bytes. Raises ObjectMissing if absent."""

    def exists(self, key: str) -> bool: ...

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Objects under `prefix`, in no particular order."""

    def leftovers(self) -> Iterator[Leftover]:
        """Writes that never finished, anywhere in the store (for gc)."""

    def remove_leftover(self, leftover: Leftover) -> None:
        """Delete a temp file or abort an upload; one already gone is no error."""

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        """(content, version) of a mutable object such as a ref, or None if absent; ObjectTooLarge,
        its body unread, when the object is over `limit` bytes (as the read itself finds it: a size
        asked for before can be answered small and the read large)."""

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        """Compare-and-swap: write only if the object is still at `version` (None: still absent).

        False when another writer got there first; the caller re-reads and decides again.
        """

    def delete(self, key: str) -> None:
        """Remove `key`; absent keys are fine (deletes are idempotent)."""

    def now(self) -> datetime:
        """The store's clock (UTC): the one that stamps `ObjectInfo.modified` and `Leftover.modified`,
        so the one gc ages objects by. This default, this host's clock, is right only where this
        host stamps them; a backend whose server stamps them asks the server."""
        return datetime.now(timezone.utc)


def listed_size(store: Store, listed: dict[str, int | None], key: str) -> int | None:
    """The size of `key` in `listed` (sizes by key from one listing), else the store's answer now,
    remembered there; None when there is no such object (StoreError when the store cannot say).
    A listing is a moment: a publish may write a pack or manifest after it, and commit a bundle or
    move a ref naming that object before a reader of the listing gets to it."""
    if key not in listed:
        try:
            listed[key] = store.size(key)
        except ObjectMissing:
            listed[key] = None
    return listed[key]


def store_now(store: Store) -> datetime:
    """`store.now()`; Store's default for a wrapper written before stores had a clock."""
    now = getattr(store, "now", None)
    return now() if callable(now) else Store.now(store)
