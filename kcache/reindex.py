"""Rebuild the SQL index from the store alone: pack trailers give blobs, manifests give bundles.

The index is a cache of the store. After losing it (or to move from SQLite to PostgreSQL),
`kcache reindex` reads every pack's trailer with one ranged read and every manifest, and
inserts what is missing. Bundle times come from their refs where a ref names them, else from
the manifest object's modification time.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kcache import manifest as manifests
from kcache import packs, refs
from kcache.errors import IntegrityError, KcacheError
from kcache.records import BlobLocation, Bundle
from kcache.store import Store

if TYPE_CHECKING:  # the SQL layer loads only when a caller opens an index
    from kcache.index import Index
from kcache.store.base import ObjectInfo

_TAIL = 256 * 1024  # most trailers fit; longer ones get a second read


@dataclass(frozen=True)
class ReindexResult:
    packs: int
    blobs: int
    bundles: int
    new_bundles: int
    skipped: tuple[str, ...]  # objects that failed verification, with the reason


def _pack_blobs(store: Store, info: ObjectInfo) -> tuple[packs.PackedBlob, ...]:
    pack_id = info.key.rsplit("/", 1)[-1]
    start = max(0, info.size - _TAIL)
    with store.open_range(info.key, start, info.size - start) as f:
        tail = f.read()
    try:
        return packs.parse_trailer(pack_id, tail, info.size)
    except IntegrityError:
        if start == 0:
            raise
        with store.open_range(info.key, 0, info.size) as f:  # a trailer longer than _TAIL
            return packs.parse_trailer(pack_id, f.read(), info.size)


def reindex(store: Store, index: Index, *, jobs: int = 16) -> ReindexResult:
    skipped: list[str] = []
    pack_infos = list(store.list("packs/"))
    blob_count = 0

    def one_pack(info: ObjectInfo) -> int:
        pack_id = info.key.rsplit("/", 1)[-1]
        try:
            blobs = _pack_blobs(store, info)
        except KcacheError as exc:  # reported per object; the rest is still indexed
            skipped.append(f"{info.key}: {exc}")
            return 0
        index.add_pack(pack_id, info.size, [BlobLocation(b.id, pack_id, b.offset, b.length, b.size) for b in blobs])
        return len(blobs)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        blob_count = sum(pool.map(one_pack, pack_infos))

    bundles = new = 0
    for info in store.list("manifests/"):
        manifest_id = info.key.rsplit("/", 1)[-1]
        try:
            manifest = manifests.parse(store.get_bytes(info.key), manifest_id)
            ref = refs.read(store, manifest.bundle_key)
        except KcacheError as exc:
            skipped.append(f"{info.key}: {exc}")
            continue
        created = ref.created_at if ref and ref.manifest == manifest_id else info.modified
        bundles += 1
        new += index.add_bundle(Bundle(
            manifest_id, manifest.bundle_key, manifest.toolchain_key, manifest.workload_key,
            manifest.facts.get("model.id"), dict(manifest.facts), manifest.layers, len(manifest.entries),
            manifest.total_size, created, f"reindex@{socket.gethostname()}", "active",
        ), keep_time=True)  # fmt: skip
    return ReindexResult(len(pack_infos), blob_count, bundles, new, tuple(skipped))
