"""How much of an object from the store kcache will read before it trusts it.

Anyone who can write the bucket can put a gigabyte where a ref, a signature or a manifest should
be. Restore runs in an init container with a memory limit (the examples give it 1 GiB), so every
such object is read with a cap known before the first byte arrives: the store's size is asked
first, an object over its cap is refused unread, and the read itself stops at that size.

    refs/<bundle-key>                  REF_BYTES        (a ref with a long yank list is ~70 bytes an id)
    signatures/<manifest-id>/<key>     SIGNATURE_BYTES  (an Ed25519 signature is 88 base64 characters)
    manifests/<hh>/<manifest-id>       KCACHE_MAX_MANIFEST_BYTES, default 32 MiB (see manifest.py)

Publish refuses a bundle whose manifest would be over the cap: no restore with the same cap would read it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from kcache.errors import ConfigError, IntegrityError, ManifestTooLarge, ObjectMissing, ObjectTooLarge, StoreError
from kcache.store import Store
from kcache.streams import Resumable

log = logging.getLogger(__name__)

REF_BYTES = 1024 * 1024
SIGNATURE_BYTES = 1024
# A restore's memory grows ~5.5x the manifest's size (manifest.py): 32 MiB keeps a restore from S3
# under 256 MiB, with room for ~110k-170k files (the rows' paths decide).
DEFAULT_MANIFEST_BYTES = 32 * 1024 * 1024
MANIFEST_ENV = "KCACHE_MAX_MANIFEST_BYTES"


def max_manifest_bytes(env: Mapping[str, str] | None = None) -> int:
    """The manifest cap: KCACHE_MAX_MANIFEST_BYTES (a byte count), else 32 MiB."""
    text = (os.environ if env is None else env).get(MANIFEST_ENV, "").strip()
    if not text:
        return DEFAULT_MANIFEST_BYTES
    # isascii: "²".isdigit() is true and int() refuses it; 18 digits: int() refuses more than 4300
    if not (text.isascii() and text.isdigit() and len(text) <= 18) or int(text) <= 0:
        raise ConfigError(MANIFEST_ENV, text, "expected a positive number of bytes, e.g. 33554432")
    return int(text)


def read_capped(store: Store, key: str, limit: int, what: str, *,
                refusal: type[ObjectTooLarge] = ObjectTooLarge) -> bytes | None:  # fmt: skip
    """The object under `key`, or None when absent; `refusal` when it is over `limit` bytes."""
    try:
        size = store.size(key)
    except ObjectMissing:
        return None
    if size > limit:
        raise refusal(what, key, size, limit)
    return read_exactly(store, key, size)


def read_manifest(store: Store, key: str) -> bytes | None:
    """The manifest under `key`, or None when absent; ManifestTooLarge over KCACHE_MAX_MANIFEST_BYTES."""
    return read_capped(store, key, max_manifest_bytes(), "manifest", refusal=ManifestTooLarge)


def put_exactly(store: Store, key: str, data: bytes, what: str) -> bool:
    """`data` under `key` (a content-named object: a manifest, a signature); True if this call wrote
    it. Other bytes already there (planted, damaged) are replaced: every restore would fail on them,
    and a re-publish is how an operator repairs that."""
    if store.put_bytes(key, data):
        return True
    try:
        there = read_capped(store, key, len(data), what)
    except ObjectTooLarge:
        there = b""
    if there == data:
        return False
    if there is not None:
        log.warning("replacing %s: the bytes stored there are not this %s", key, what)
        store.delete(key)
    return store.put_bytes(key, data)


def read_exactly(store: Store, key: str, size: int) -> bytes:
    """`size` bytes of `key`, never more (the object may have grown since its size was asked)."""
    chunks, got = [], 0
    try:
        # Resumable: a connection cut mid-body is read on from where it stopped, as pack reads are.
        with Resumable(store.open_range(key, 0, size), lambda at, n: store.open_range(key, at, n), 0, size,
                       name=key) as f:  # fmt: skip
            while got < size and (chunk := f.read(size - got)):  # a stream may return short reads
                chunks.append(chunk)
                got += len(chunk)
    except OSError as exc:  # the network or the mount, not the restore root
        raise StoreError(store.url, f"reading {key} failed: {exc.strerror or exc}") from None
    data = b"".join(chunks)
    if len(data) != size:
        raise IntegrityError("object", key, f"ended after {len(data)} of its {size} bytes")
    return data


def check_manifest_size(size: int, files: int, *, at_least: bool = False) -> None:
    """Publish's side of the cap: a manifest of `size` bytes (`at_least`: no fewer) must fit it."""
    cap = max_manifest_bytes()
    if size > cap:
        would = f"at least {size}" if at_least else str(size)
        raise ConfigError(MANIFEST_ENV, str(cap), f"this bundle's manifest would be {would} bytes for {files} files, "
                          "and restores refuse one over the cap; publish fewer files, or raise the cap for "
                          "publishers and pods alike (a restore needs ~5.5x the cap in memory)")
