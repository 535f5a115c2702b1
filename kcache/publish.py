"""Publish: collect the cache layers, upload what the store lacks, commit a bundle.

The commit protocol (a crash at any step leaves only orphans for GC, never a broken bundle):

    1. packs     new blobs packed and written to the store (create-if-absent)
    2. rows      pack and blob rows in the index (insert-or-ignore)
    2b. revive  every pack the bundle names is un-condemned (GC's phase 1 may have condemned it)
    3. manifest  written to the store under its own hash, then its signature (when a key is set)
    4. bundle    the bundle row: the commit point; restore only sees committed bundles
    5. ref       refs/<bundle-key> moved forward (compare-and-swap) for pods without the index

Dedup asks the index which blob ids it already has, so the hundredth identical pod uploads nothing.
Pods of one bundle key that publish at the same moment (a Deployment's replicas after the same
warmup) would all find every blob missing and upload it, each one a copy. So steps 1-5 run under
the bundle key's publish lease in the index: the others wait for it, then find the blobs in the
index and upload only what the first did not. The lease only saves uploads: one that is lost,
expires or is never taken changes no outcome. A carrying publish (watch's) commits only while the
bundle it carried from is still its key's newest, so an overlapping one never drops another's files
(see _commit).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import os
import random
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kcache import boundedread, cpus, gpus, layerkeys, limits, progress, readiness, refs, signing
from kcache import fingerprint as fingerprints
from kcache import manifest as manifests
from kcache.errors import (
    ConfigError,
    IndexConflict,
    IndexDbError,
    IntegrityError,
    KcacheError,
    NewestChanged,
    NotFound,
    ObjectMissing,
    SignatureError,
    SourceDirError,
    UnsafePath,
)
from kcache.fingerprint import NONE, Fingerprint
from kcache.hashcache import HashCache, key_for
from kcache.packs import (
    CHUNK_BYTES,
    LARGE_FILE_BYTES,
    TARGET_PACK_BYTES,
    ContentHash,
    Hashed,
    Pack,
    PackWriter,
    digests_chunks,
)
from kcache.records import BlobLocation, Bundle, Event
from kcache.restore import laid_bundles
from kcache.sources import ExtraSource, FileInfo, Source, is_kept_back_place
from kcache.sources import for_manifest as sources_for_manifest
from kcache.store import Store, manifest_key, pack_key
from kcache.untrusted import one_line
from kcache.workdir import staging, workdir

if TYPE_CHECKING:  # the SQL layer loads only when a caller opens an index
    from kcache.index import Index

T = TypeVar("T")

log = logging.getLogger(__name__)
_HASH_CHUNK = 1024 * 1024
_REVIVE_ROUNDS = 3
# How long a publish waits for another one of its bundle key before uploading anyway, and how long
# a lease lasts unless renewed (its holder renews it every third of that, so one that died frees
# it within LEASE_SECONDS).
PEER_WAIT = 600.0
LEASE_SECONDS = 60.0
_LEASE_POLL = 1.0  # seconds between looks at another publish's lease


@dataclass(frozen=True)
class PublishConfig:
    """How to publish: one value that publish, prebake and watch share, so no path forgets a part.

    The hash cache is a handle, not a value; the dataclass is frozen so that no caller changes
    the configuration under a running publish.
    """

    jobs: int = 8  # parallel hashing and uploads
    signing_key: signing.SigningKey | None = None  # sign every manifest before its commit point
    # stat key -> SHA-256 (and chunk digests): a re-publish re-reads only changed files
    hash_cache: HashCache | None = None
    allow_empty: bool = False  # an empty bundle becomes the newest for its key: only on purpose
    peer_wait: float = PEER_WAIT  # seconds to wait for another publish of the same bundle key
    # A time.monotonic() past which the wait for that lease ends however long peer_wait is, or None
    # (asked again while waiting): kcache watch's, once it is being stopped (kcache.watch.LEASE_SHARE).
    lease_deadline: Callable[[], float | None] | None = None
    lease_seconds: float = LEASE_SECONDS
    # kcache watch: the bundle also carries the files of the key's newest bundle that ROOT lacks, so
    # replicas that each compiled other shapes after ready keep each other's kernels (see _carried)
    carry_newest: bool = False
    # publish --from ROOT may leave out a layer the restore into ROOT laid down (later pods lose it)
    drop_layers: bool = False


def _manifest_path(source: Source, info: FileInfo) -> str:
    """Where a found file lies in the manifest (and under a restore root): its layer's directory first."""
    return f"{source.subdir}/{info.rel}"


@dataclass(frozen=True)
class Collected:
    """A file found in a layer, with its path in the manifest and its content id."""

    path: str
    info: FileInfo
    blob: str
    # SHA-256 of each CHUNK_BYTES of the content, for a file of packs.DIGESTED_BYTES or more: taken
    # here from the bytes that hash to `blob`, never from the index or store.
    chunks: tuple[str, ...] = ()


@dataclass(frozen=True)
class PublishResult:
    bundle_key: str
    bundle_id: str
    created: bool  # False when this exact bundle was already published
    layers: tuple[str, ...]
    files: int
    bytes: int
    new_blobs: int
    new_bytes: int  # uncompressed bytes of the blobs this publish uploaded
    uploaded_bytes: int  # pack bytes sent to the store
    packs: int
    seconds: float
    yanked: bool = False  # this manifest was yanked before: committed yanked, no ref names it
    # Manifest paths the walk found but the bundle left out (removed, unreadable or changed while
    # read: a compile still writing them), for a caller that publishes again, like `kcache watch`.
    skipped: tuple[str, ...] = ()


def collect(sources: Iterable[Source], *, root: Path | None, env: Mapping[str, str]) -> list[tuple[Source, FileInfo]]:
    """Every non-junk file of each layer: from ROOT's layout when `root` is given, else live dirs.

    An extra directory the user named by path is read from that path, ROOT or not, and must exist:
    a typo must not silently publish a bundle without it.
    """
    found: list[tuple[Source, FileInfo]] = []
    for source in sources:
        named = source.live_dirs(env) if isinstance(source, ExtraSource) else []
        for path in named:
            if not path.is_dir():
                flag = f"--extra-dir {source.name.removeprefix('extra:')}"
                raise SourceDirError(flag, str(path), "does not exist" if not path.exists() else "is not a directory")
        dirs = named or source.read_dirs(root, env)
        seen: set[str] = set()
        above: set[str] = set()  # the directories of what is in `seen`
        for top in dirs:
            # a file: a one-file layer (the TRT-LLM autotuner's), whose rank files may be there without it
            if not (top.is_dir() or top.is_file() or (source.one_file and top.parent.is_dir())):
                continue
            home = top if top.is_dir() else top.parent
            real = _resolved(home, None if named else root)
            for info in source.walk(top):
                if info.rel in seen:  # merged directories (triton per device): first wins
                    continue
                parents = _parents(info.rel)
                if info.rel in above or not seen.isdisjoint(parents):
                    # A file in one merged directory where another has a directory of that name: a
                    # manifest cannot hold both, and the first directory's wins, as for one path.
                    log.warning("skipping %r: %s/%s is a file in one merged directory and a directory in another",
                                str(info.path), source.subdir, info.rel)  # fmt: skip
                    continue
                seen.add(info.rel)
                above.update(parents)
                found.append((source, _moved(info, str(home), real)))
    return found


def _parents(rel: str) -> list[str]:
    """"a/b/c" -> ["a", "a/b"]."""
    parts = rel.split("/")
    return ["/".join(parts[:n]) for n in range(1, len(parts))]


def _resolved(home: Path, root: Path | None) -> str:
    """`home` with the links above it resolved, as the kernel names a file opened under it (see
    _opened_at). Under ROOT only ROOT's own: a link below ROOT is refused (Source.read_dirs) and by
    now may be a swap by whoever writes ROOT."""
    if root is not None and home.is_relative_to(root):
        return str(Path(os.path.realpath(root)) / home.relative_to(root))
    return os.path.realpath(home)


def _moved(info: FileInfo, home: str, real: str) -> FileInfo:
    """`info` with its path under `real` instead of `home`, the same directory named without links."""
    path = str(info.path)
    if real == home or not path.startswith(home):
        return info
    return replace(info, path=Path(real + path[len(home) :]))


def hash_file(path: Path, size_hint: int = _HASH_CHUNK) -> Hashed:
    """What the file at `path` hashes to, and how many bytes it hashed. `size_hint` (its size at
    the walk) sizes the first read, and at packs.DIGESTED_BYTES or more asks for chunk digests too."""
    fd = _open_regular_fd(path)
    try:
        digest = ContentHash(digests_chunks(size_hint))
        want = min(_HASH_CHUNK, max(0, size_hint) + 1)  # a small file in one read, its end seen at once
        while piece := os.read(fd, want):
            digest.update(piece)
            want = _HASH_CHUNK
        return digest.result()
    finally:
        os.close(fd)


def _open_regular_fd(path: Path) -> int:
    """`path` open for reading, never through a link, never a FIFO."""
    # O_NOFOLLOW: a file swapped for a link after the walk is not read through it; O_NONBLOCK and
    # fstat: one swapped for a FIFO (the model container writes ROOT while watch publishes) is not
    # waited on.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise boundedread.NotRegularFile(f"{path} is not a regular file")
    if not _opened_at(fd, path):
        os.close(fd)
        raise OSError(errno.ELOOP, "reached through a symbolic link", str(path))
    return fd


def _opened_at(fd: int, path: Path) -> bool:
    """Whether the kernel names the file open as `fd` by `path` itself. O_NOFOLLOW guards the last
    name only: a directory above it swapped for a link (by whoever writes the cache while publish
    walks it) leads anywhere, and what is hashed here is what the bundle carries. `path` names no
    link above its layer (collect resolves those), so any link on the way makes the names differ.
    Packing needs no such check: it packs only bytes that hash to the id taken here."""
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: the walk's refusal of links is all there is
        return True
    return name in (str(path), f"{path} (deleted)")  # deleted: a compile replaced it since the open


def _hash_or_skip(path: Path, size: int | None = None) -> Hashed | None:
    """What the file hashes to, or None (with a warning) when it went away or cannot be read since
    the walk, or no longer holds the `size` bytes the walk saw: the manifest records the walk's size
    beside the id, and restore lays out exactly that many bytes."""
    hashed = _skipping(path, lambda: hash_file(path, _HASH_CHUNK if size is None else size))
    if hashed is not None and size is not None and hashed.size != size:
        _skip_resized(path)
        return None
    return hashed


def _skip_resized(path: Path) -> None:
    log.warning("skipping %r: changed size since it was listed (a compile still writing it?)", str(path))


# What open() says of a path whose file was replaced since the walk: a socket (ENXIO), a device
# without a driver (ENODEV), a directory (EISDIR), a file where a directory above it was (ENOTDIR).
_NOT_THE_FILE_LISTED = frozenset({errno.ENXIO, errno.ENODEV, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG,
                                  errno.EAGAIN})  # EAGAIN: a file that never reads without blocking (/proc/kmsg)


def _skipping(path: Path, read: Callable[[], T]) -> T | None:
    """`read()` of a file listed by the walk, or None (with a warning) when the file went away,
    became unreadable, a link or no regular file since."""
    try:
        return read()
    except (FileNotFoundError, PermissionError) as exc:  # a compile removed its temp file; another user's file
        log.warning("skipping %r: %s since it was listed", str(path),
                    "removed" if isinstance(exc, FileNotFoundError) else "unreadable")  # fmt: skip
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # it, or a directory above it, replaced by a link since the walk
            log.warning("skipping %r: it or a directory above it became a symbolic link since it was listed",
                        str(path))  # fmt: skip
            return None
        if isinstance(exc, boundedread.NotRegularFile) or exc.errno in _NOT_THE_FILE_LISTED:
            log.warning("skipping %r: no longer a regular file at that path since it was listed (%s)", str(path),
                        exc.strerror or exc)  # fmt: skip
            return None
        raise  # EIO and the like: the disk, not the workload; a bundle must not go out without the file


def _hash_all(found: list[tuple[Source, FileInfo]], jobs: int, cache: HashCache | None,
              report: progress.Report | None = None,
              early: _PackWhileHashing | None = None) -> list[Collected]:  # fmt: skip
    """SHA-256 of every file, from the hash cache where the file is unchanged since last time.

    With `early`, a large file the cache does not know is packed (and uploaded when new) as it
    is hashed. A file that is gone by the time it is hashed is left out of the bundle."""
    keys = [key_for(i.path, i.size, i.mtime_ns, i.ctime_ns, i.ino) for _, i in found] if cache else []
    started = cache.now() if cache else 0  # before any file is read: see HashCache.remember
    hashes: list[Hashed | None] = [None] * len(found)
    if cache:
        known = cache.lookup({key: info.size for key, (_, info) in zip(keys, found)})
        hashes = [known.get(k) for k in keys]
    todo = [i for i, h in enumerate(hashes) if h is None]
    # hashlib releases the GIL on large buffers, so threads overlap reading and hashing. Files go
    # to the threads in batches: a future per 8 KiB file cost more than hashing it (20k files
    # hashed in 1.3-1.9 s one future each, 0.4 s in batches).
    meter = progress.Meter("hashing", files=len(todo), bytes=sum(found[i][1].size for i in todo), report=report)

    def hash_one(i: int) -> Hashed | None:
        source, info = found[i]
        if early is not None and info.size >= LARGE_FILE_BYTES:
            fd = _skipping(info.path, lambda: _open_regular_fd(info.path))  # only opening it may skip it
            return None if fd is None else early.pack(source, info, fd)
        return _hash_or_skip(info.path, info.size)

    def hash_batch(batch: list[int]) -> list[Hashed | None]:
        hashed = [hash_one(i) for i in batch]
        meter.add(files=len(batch), bytes=sum(found[i][1].size for i in batch))
        return hashed

    # Small files on one thread: their cost is Python's, per file, and threads sharing it only
    # hand the GIL back and forth (20k files: 0.45 s on one thread, 0.6-1.0 s on 2-8); big files
    # spend their time in read() and SHA-256 outside the GIL, on every core.
    with meter, ThreadPoolExecutor(max(1, jobs)) as pool, ThreadPoolExecutor(1) as small:
        little = [i for i in todo if found[i][1].size < _HASH_CHUNK]
        work = [(pool, [i]) for i in todo if found[i][1].size >= _HASH_CHUNK]
        work += [(small, batch) for batch in _batches(little, [found[i][1].size for i in little])]
        submitted = [(batch, where.submit(hash_batch, batch)) for where, batch in work]
        try:
            for batch, future in submitted:
                for i, hashed in zip(batch, future.result()):
                    hashes[i] = hashed
        except BaseException:
            # One failure fails the publish: files not started are neither read nor uploaded. An
            # index that failed one pack's rows fails the rest, and a pack uploaded without rows
            # is an orphan the next publish cannot name (it uploads a salted copy).
            for _batch, future in submitted:
                future.cancel()
            raise
    if cache and todo:
        cache.remember(((keys[i], hashes[i], max(found[i][1].mtime_ns, found[i][1].ctime_ns)) for i in todo
                        if hashes[i] is not None), started)  # fmt: skip
    return [
        Collected(_manifest_path(src, info), info, hashed.blob, hashed.chunks)
        for (src, info), hashed in zip(found, hashes)
        if hashed is not None
    ]


def _batches(items: list[int], sizes: list[int], files: int = 256, size: int = 8 * 1024 * 1024) -> list[list[int]]:
    """`items` in order, cut into runs of at most `files` items or about `size` bytes."""
    batches: list[list[int]] = []
    current: list[int] = []
    held = 0
    for item, n in zip(items, sizes):
        current.append(item)
        held += n
        if len(current) >= files or held >= size:
            batches.append(current)
            current, held = [], 0
    if current:
        batches.append(current)
    return batches


def _plan_packs(new: list[Collected]) -> list[list[Collected]]:
    """Group new blobs into packs of about TARGET_PACK_BYTES; a large file gets a pack of its own."""
    groups: list[list[Collected]] = []
    current: list[Collected] = []
    current_bytes = 0
    for item in sorted(new, key=lambda c: c.path):
        if item.info.size >= LARGE_FILE_BYTES:
            groups.append([item])
            continue
        if current and current_bytes + item.info.size > TARGET_PACK_BYTES:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(item)
        current_bytes += item.info.size
    if current:
        groups.append(current)
    return groups


def _build_pack(group: list[Collected], workdir: Path, chunks: Executor, salt: bytes = b"", threads: int = 1):
    """The pack of `group`; with `salt`, one more tiny blob makes its bytes (and id) new.

    Its small files are compressed in batches on `threads` threads; `chunks` compresses a large
    file's chunks in parallel: either way one pack uses every core.
    """
    with staging(workdir):
        writer = PackWriter(workdir, chunks)
        try:
            writer.add_small([(i.blob, i.info.path, i.info.size) for i in group if i.info.size <= CHUNK_BYTES],
                             threads)  # fmt: skip
            for item in group:
                if item.info.size > CHUNK_BYTES:
                    writer.add(item.blob, item.info.path, item.info.size)
            if salt:
                salted = Path(workdir) / f"salt-{salt.hex()}"
                salted.write_bytes(salt)
                writer.add(hashlib.sha256(salt).hexdigest(), salted, len(salt))
                salted.unlink()
            return writer.finish()
        except BaseException:
            writer.discard()
            raise


def _write_and_upload(group: list[Collected], store: Store, index: Index, workdir: Path, chunks: Executor,
                      meter: progress.Meter, building: threading.Lock) -> tuple[int, int]:  # fmt: skip
    """Steps 1 and 2 for one pack. Returns (pack bytes written to the store, blobs packed).

    A pack of many small files is built under `building`, one at a time, each on every core (see
    PackWriter.add_small), while the packs built before it upload: reading and checking small
    files is Python work, and threads doing it side by side only contend for the GIL.

    A pack is only ever named by the publish that wrote it. When the store already has the
    identical pack, it is an object nobody may be relying on: an orphan of a crashed publish, or a
    condemned pack GC is deleting this very moment (its row went first, so our lookup missed it).
    Adopting it could leave our bundle naming an object GC deletes next, so the blobs go into a
    pack with a random salt blob instead, whose id no one else has.
    """
    many = len(group) > 1
    threads = cpus.usable()
    with building if many else contextlib.nullcontext():
        pack = _build_pack(group, workdir, chunks, threads=threads)

    def salted(salt: bytes) -> Pack:
        with building if many else contextlib.nullcontext():
            return _build_pack(group, workdir, chunks, salt=salt, threads=threads)

    stored = _store_pack(pack, salted, store, index)
    meter.add(files=len(group), bytes=sum(item.info.size for item in group))
    return stored.size, len(stored.blobs)


def _store_pack(pack: Pack, salted: Callable[[bytes], Pack], store: Store, index: Index) -> Pack:
    """Steps 1 and 2 for a pack built in the workdir (removed here): the pack as stored, which is
    `salted(salt)` when the store already had the identical one (see _write_and_upload)."""
    try:
        written = store.put_file(pack_key(pack.id), pack.path)
        if not written:
            log.info("pack %s is already in the store; writing a salted copy of its blobs", pack.id[:12])
            pack.path.unlink(missing_ok=True)
            pack = salted(os.urandom(16))
            written = store.put_file(pack_key(pack.id), pack.path)
        if not written:
            raise IntegrityError("pack", pack.id, "a salted pack id was already taken in the store")
        index.add_pack(
            pack.id, pack.size, [BlobLocation(b.id, pack.id, b.offset, b.length, b.size) for b in pack.blobs]
        )
    finally:
        pack.path.unlink(missing_ok=True)
    return pack


class _PackWhileHashing:
    """Steps 1-2 for large files, while hashing: a file of LARGE_FILE_BYTES or more gets a pack of
    its own anyway, so instead of being read once to hash it and again to pack it, it is packed
    once, its id taken from the very bytes packed, and the pack uploaded at once unless the index
    already holds that blob (then it is dropped). A 1 GiB publish with a cold hash cache read and
    hashed every byte twice. What went up is counted here for the publish's result.
    """

    def __init__(self, store: Store, index: Index, workdir: Path, chunks: Executor):
        self._store, self._index, self._workdir, self._chunks = store, index, workdir, chunks
        self._lock = threading.Lock()
        self._claimed: set[str] = set()  # one upload per blob, when two files hold the same bytes
        self.new: list[Collected] = []
        self.uploaded = self.packs = 0

    def pack(self, source: Source, info: FileInfo, fd: int) -> Hashed | None:
        """What the file `info` describes, open as `fd` (closed here), hashes to; None (with a
        warning) when it no longer holds the bytes the walk saw."""
        with open(fd, "rb") as src, staging(self._workdir):
            writer = PackWriter(self._workdir, self._chunks)
            try:
                hashed = writer.add_unhashed(src, info.size, str(info.path))
                if hashed is None:
                    writer.discard()
                    _skip_resized(info.path)
                    return None
                pack = writer.finish()
            except BaseException:
                writer.discard()
                raise
        item = Collected(_manifest_path(source, info), info, hashed.blob, hashed.chunks)
        with self._lock:
            first = item.blob not in self._claimed
            self._claimed.add(item.blob)
        if not (first and self._index.find_missing([item.blob])):
            pack.path.unlink(missing_ok=True)
            return hashed
        stored = _store_pack(pack, lambda salt: _build_pack([item], self._workdir, self._chunks, salt), self._store,
                             self._index)  # fmt: skip
        with self._lock:
            self.new.append(item)
            self.uploaded += stored.size
            self.packs += 1
        return hashed


def publish(
    store: Store,
    index: Index,
    fingerprint: Fingerprint,
    sources: Iterable[Source],
    *,
    root: Path | None = None,
    env: Mapping[str, str] | None = None,
    config: PublishConfig = PublishConfig(),
    progress: Callable[[str], None] | None = None,
    compile_seconds: float | None = None,
    report: progress.Report | None = None,
) -> PublishResult:
    """Publish this machine's caches (or ROOT's) as a bundle for `fingerprint`.

    `compile_seconds` is the cold warmup the caller measured: what a hit on this bundle saves.
    Raises SourceDirError (a RootError) for a ROOT that is not a directory, ConfigError for an empty bundle
    unless `config.allow_empty`.
    `report` receives the hashing and upload progress (kcache.progress).
    """
    if fingerprint.mismatches:  # kernels built here, filed under another machine's keys: a wrong hit for its pods
        names = ", ".join(m.fact for m in fingerprint.mismatches)
        if fingerprint.contradicted == fingerprints.FACTS_FILE:
            flag, where = "--facts-file", "where the facts were taken"
        else:
            flag, where = fingerprints.FACT_FLAG, "on the machine it describes"
        raise ConfigError(flag, names, f"{fingerprint.mismatch_reason()}; publish {where}")
    refs.default_ttl()  # a bad KCACHE_REF_TTL must fail now: the ref is written after the commit point
    started = time.perf_counter()
    env = os.environ if env is None else env
    sources = list(sources)
    if root is not None:
        _check_from(Path(root))
    note = progress or (lambda _msg: None)

    if root is not None:
        sources = _made_here(Path(root), fingerprint, sources, env)
    sources = [source.for_facts(fingerprint.facts) for source in sources]  # the keyed torch's build folder
    if config.signing_key is not None:  # before any upload: nothing read is signed unless all of it may be
        for laid_into in _restore_roots(sources, root, env):
            check_signed_by(store, laid_into, fingerprint, config.signing_key)
    found = collect(sources, root=root, env=env)
    if not found and not config.allow_empty:
        where = str(root) if root is not None else "the live cache directories"
        raise ConfigError("publish", where, "holds no cache files; pass --allow-empty to publish an empty bundle")
    layers = sorted({src.name for src, _ in found})
    _check_vouched(fingerprint.facts, [src for src in sources if src.name in layers])
    if root is not None and not (config.drop_layers or config.carry_newest):  # carrying puts them back
        _check_keeps_restored(Path(root), fingerprint.bundle_key, layers)
    info = layerkeys.annotate({src.name: src.layer_info() for src in sources if src.name in layers}, layers,
                              fingerprint.facts)  # fmt: skip
    # Before any upload: a row the database would refuse, or a manifest too big for any restore to
    # read, must fail now, not after the packs went up.
    head = _manifest(fingerprint, layers, [], info)
    index.check_bundle(_bundle_row(head))
    limits.check_manifest_size(manifests.least_size(head, [_manifest_path(src, i) for src, i in found]), len(found),
                               at_least=True)  # fmt: skip
    with _Lease(index, fingerprint.bundle_key, config, note) as lease:
        return _publish_leased(store, index, fingerprint, found, layers, info, config, note, compile_seconds, report,
                               started, lease)  # fmt: skip


def _restore_roots(sources: list[Source], root: Path | None, env: Mapping[str, str]) -> list[Path]:
    """ROOT, and every directory holding a restore marker that a directory publish reads lies in: the live
    cache directories of a pod that sourced ROOT/kcache.env are ROOT's layers, and so may be an --extra-dir.
    Every one, not the nearest: a bundle may have laid a marker of its own inside a layer."""
    found = {Path(root).absolute()} if root is not None else set()
    for source in sources:
        named = source.live_dirs(env) if isinstance(source, ExtraSource) else []
        for top in named or source.read_dirs(root, env):
            real = Path(os.path.realpath(top))  # exists() is False where it cannot look, as read_marker reads nothing
            found.update(d for d in (real, *real.parents) if os.path.exists(d / readiness.RESTORE_MARKER))
    return sorted(found)


def check_signed_by(store: Store, root: Path, fingerprint: Fingerprint, key: signing.SigningKey) -> None:
    """SignatureError unless `key` signed every bundle whose files ROOT's layers hold (the restore marker's
    record). A restore into ROOT without --require-signature (with --url, or in a kept ROOT) checked no
    signature; publishing ROOT signs all of it, and must not sign what a store writer planted: every pod
    requiring `key`'s signature would take it (a carrying publish carries no bundle `key` did not sign
    either, see _newest_to_carry)."""
    trusted = (signing.public_of(key),)
    for bundle, owner in sorted(laid_bundles(root).items()):
        try:
            signed = signing.verify(store, trusted, owner or fingerprint.bundle_key, bundle,
                                    store.size(manifest_key(bundle)))  # fmt: skip
        except ObjectMissing:
            signed = None
        if signed is None:
            why = (f"the restore into {root} laid its files down and {key.name!r} did not sign it: publishing ROOT "
                   f"would sign them; publish from a ROOT restored with --trusted-key for {key.name!r} and "
                   "--require-signature (a refused restore keeps the layers it found: start from an empty ROOT)")
            raise SignatureError(bundle, why)


def _check_vouched(facts: Mapping[str, str], sources: list[Source]) -> None:
    """Refuse facts a probe could not read, and torch-built kernels under facts that name no torch:
    every machine whose kcache cannot see the same thing probes the same facts, so such a bundle
    would hit on any GPU or torch build."""
    unread = sorted(name for name, value in facts.items() if name.startswith("gpu.") and value == gpus.UNKNOWN)
    if unread:
        why = ("the GPU facts are unknown (GPU devices nobody could read); publish with --facts-file from "
               "`kcache fingerprint --json` where NVML or nvidia-smi works")
        raise ConfigError("publish", ", ".join(unread), why)
    built = [src.name for src in sources if src.needs_torch]
    if built and facts.get("torch.version", NONE) == NONE:
        why = (f"the facts name no torch, but {', '.join(built)} kernels are built against it; publish where "
               "the model's torch is importable, or with --facts-file from the model container")
        raise ConfigError("publish", f"torch.version={facts.get('torch.version', NONE)}", why)


def _made_here(root: Path, fingerprint: Fingerprint, sources: list[Source],
               env: Mapping[str, str]) -> list[Source]:  # fmt: skip
    """`sources` without the layers the restore marker says are another key's, left in place by a
    restore that could not set them aside; ConfigError when it says all of ROOT's layers were made on
    another toolchain (a kept ROOT whose last restore failed before comparing them, or ran elsewhere).
    Filed under this key, another machine's kernels (-march=native, another GPU) would reach every
    pod of it. Only the toolchain is compared: workload flags may rightly override the record's."""
    state = readiness.read_marker(root, readiness.RESTORE_MARKER) or {}
    made_under, toolchain = state.get("layers_key"), state.get("toolchain_key")
    if isinstance(made_under, str) and (made_under != state.get("bundle_key") or (
            isinstance(toolchain, str) and toolchain != fingerprint.toolchain_key)):  # fmt: skip
        why = (f"its layers were made under bundle key {one_line(made_under, 80)} on another toolchain than this "
               "publish's (the restore marker says so): kernels for another machine or image; restore into ROOT "
               "on this machine first, or publish from where they were compiled")
        raise ConfigError("--from", str(root), why)
    kept_back = state.get("kept_back")
    if not isinstance(kept_back, dict) or not kept_back:
        return sources
    places = [root / place for place in kept_back if isinstance(place, str) and is_kept_back_place(place)]
    made_here = []
    for source in sources:
        place = source.restore_dir(root)
        named = isinstance(source, ExtraSource) and source.live_dirs(env)  # read from that path, not ROOT
        if not named and any(place == other or other in place.parents for other in places):
            log.warning("leaving out layer %s: the restore into %s could not set aside the files another bundle "
                        "key made there", source.name, root)  # fmt: skip
            continue
        made_here.append(source)
    return made_here


def _check_keeps_restored(root: Path, bundle_key: str, layers: list[str]) -> None:
    """Refuse a bundle without a layer the restore into ROOT laid down from this key's bundle: it
    becomes the key's newest, restore takes the newest, and every later pod would lose that layer."""
    state = readiness.read_marker(root, readiness.RESTORE_MARKER) or {}
    restored = state.get("layers")
    if state.get("status") != "hit" or state.get("bundle_key") != bundle_key or not isinstance(restored, list):
        return
    dropped = sorted({name for name in restored if isinstance(name, str)} - set(layers))
    if dropped:
        why = (f"the restore into it laid down layer {', '.join(dropped)}, which this publish leaves out (not "
               "chosen, or its directory is empty now): restore takes the newest bundle, so every later pod would "
               "lose it; publish every layer, or pass --drop-layers if that is meant")
        raise ConfigError("--from", str(root), why)


def _publish_leased(store: Store, index: Index, fingerprint: Fingerprint, found, layers: list[str], info,
                    config: PublishConfig, note: Callable[[str], None], compile_seconds: float | None,
                    report: progress.Report | None, started: float, lease: _Lease) -> PublishResult:  # fmt: skip
    """Steps 1-5 of `publish`, under the bundle key's lease: taken at once, large files are packed
    while they are hashed; held by another publish, every file is hashed (no upload) while it
    works, and the lease is waited for after that."""
    first = lease.take()
    note(f"hashing {len(found)} files")
    with workdir() as tmp, ThreadPoolExecutor(max(1, config.jobs), thread_name_prefix="kcache-compress") as chunks:
        early = _PackWhileHashing(store, index, tmp, chunks)
        collected = _hash_all(found, config.jobs, config.hash_cache, report, early if first else None)
    # The walk found files; hashing may have skipped them all (removed, unreadable, changed since):
    # an empty bundle would become the key's newest and every later pod would restore nothing.
    kept = {c.path for c in collected}
    if not kept and found and not config.allow_empty:
        raise ConfigError("publish", f"{len(found)} files", "were all removed or changed while publish read "
                          "them; nothing was published (pass --allow-empty to publish an empty bundle)")  # fmt: skip
    layers = sorted({src.name for src, i in found if _manifest_path(src, i) in kept}) if found else layers
    info = {name: value for name, value in info.items() if name in layers}
    if not first:
        lease.wait()
    donor = _donor(store, index, fingerprint, config) if config.carry_newest else None
    new, uploaded, pack_count, locations = _upload_until_revived(collected, store, index, config.jobs, note, report)
    collected = _sized_as_stored(collected, locations)
    new, uploaded, pack_count = early.new + new, early.uploaded + uploaded, early.packs + pack_count
    # From `collected` as kept: a file skipped above takes its digests with it.
    entries = [_entry(c, locations[c.blob]) for c in collected]
    own = _Contents(entries, {c.blob: c.chunks for c in collected if c.chunks}, layers, info)
    manifest, data, wrote, row, created, replaced = _commit(store, index, fingerprint, config, own, donor,
                                                            compile_seconds)  # fmt: skip
    yanked = row.status == "yanked"
    if not wrote and not _manifest_stored(store, manifest.id, config.signing_key):
        # The copy we found was an orphan of a crashed publish, and GC swept it before our commit.
        log.warning("manifest %s vanished while publishing; writing it again", manifest.id[:12])
        _write_manifest(store, manifest, data, config.signing_key)
    # After the commit point: pods without index access find the bundle through its ref, signed
    # when we sign (an unchanged re-publish only re-signs a ref close to expiring), and ordered by
    # the time the index stamped (its clock, not ours).
    ref = refs.for_bundle(index, row.id)
    refs.advance(store, ref, signer=config.signing_key, index=index)
    layerkeys.advance(store, manifest, ref.created_at, index.now)  # forward only: a re-publish moves nothing
    if created and not yanked and replaced is not None:  # created: a new row, so not `replaced`
        # A layer the new bundle lacks: its ref still names the one replaced, and restore takes
        # the layer from that key's newest (this one). It goes to the next donor, or away; failing
        # that, verify reports the ref and the next yank or gc moves it: the bundle is committed.
        try:
            layerkeys.move_off(store, index, replaced, signer=config.signing_key)
        except KcacheError as exc:
            log.warning("published, but cannot move the layer refs of bundle %s: %s", replaced.id[:12], exc)
    seconds = time.perf_counter() - started
    result = PublishResult(
        fingerprint.bundle_key, manifest.id, created, manifest.layers, len(manifest.entries), manifest.total_size,
        len(new), sum(c.info.size for c in new), uploaded, pack_count, seconds, yanked,
        tuple(sorted({_manifest_path(src, i) for src, i in found} - {e.path for e in manifest.entries})),
    )  # fmt: skip
    event = Event("publish", "published" if created else "unchanged", fingerprint.bundle_key, manifest.id,
                  len(manifest.entries), uploaded, seconds)  # fmt: skip
    try:
        index.record_event(event)
    except IndexDbError as exc:  # stats only: the bundle is committed, its ref moved; the exit code must say so
        log.warning("published, but cannot record the publish event: %s", exc)
    return result


# How long a carrying publish goes on committing while other commits of its key overtake it, and the
# first of its jittered, doubling pauses between tries (a second at most): replicas stopped together
# publish at once without the lease, and without a pause the same few lost every round (8 rounds
# left 4 of 12 pods' kernels in no bundle).
_CARRY_SECONDS = 60.0
_CARRY_PAUSE = 0.05


@dataclass(frozen=True)
class _Donor:
    """The key's newest bundle when last looked at, and its manifest when its files may be carried."""

    newest: Bundle | None
    manifest: manifests.Manifest | None


@dataclass(frozen=True)
class _Contents:
    """What a bundle will hold: entries, chunk digests, layers and their layer info."""

    entries: list[manifests.Entry]
    chunks: dict[str, Sequence[str]]
    layers: list[str]
    info: dict

    def carrying(self, index: Index, donor: manifests.Manifest) -> _Contents:
        """These contents and the donor's files they lack (see _carried)."""
        carried = _carried(index, donor, {e.path for e in self.entries})
        chunks = {**self.chunks, **{e.blob: donor.chunks[e.blob] for _, e in carried if e.blob in donor.chunks}}
        layers = sorted(set(self.layers) | {name for name, _ in carried})
        info = {**{k: v for k, v in donor.layer_info.items() if k in layers}, **self.info}
        return _Contents(self.entries + [e for _, e in carried], chunks, layers, info)


def _commit(store: Store, index: Index, fingerprint: Fingerprint, config: PublishConfig, own: _Contents,
            donor: _Donor | None, compile_seconds: float | None):  # fmt: skip
    """Steps 3-4: the manifest, then the bundle row. Returns (manifest, its bytes, whether this
    call wrote them, row, created, the key's newest bundle before the commit).

    A carrying publish commits only while the bundle it carried from is still its key's newest
    (Index.add_bundle's `if_newest`). Another commit of the key may have come since it chose the
    donor: a publish whose lease it never waited for (--peer-wait ran out, the index refused leases,
    the lease lapsed) or a yank. Then it carries from the newest bundle again and writes a new
    manifest: a bundle that dropped the other's files would become the newest."""
    changed: KcacheError | None = None
    deadline = time.monotonic() + _CARRY_SECONDS
    for tries in itertools.count(1):
        if tries > 1 and time.monotonic() >= deadline:
            break
        if donor is not None:
            donor = _donor(store, index, fingerprint, config, donor)  # looked at again right before the commit
        contents = own.carrying(index, donor.manifest) if donor is not None and donor.manifest is not None else own
        manifest = _manifest(fingerprint, contents.layers, contents.entries, contents.info, contents.chunks)
        data = manifest.to_bytes()
        limits.check_manifest_size(len(data), len(manifest.entries))  # exact now: the first check was a lower bound
        _check_readable(manifest, data)
        wrote = _write_manifest(store, manifest, data, config.signing_key)  # before the commit point
        yanked = _yanked_before(store, manifest) or index.was_yanked(manifest.id)
        if yanked:
            log.warning("bundle %s was yanked before; it is committed yanked (`kcache yank --undo %s` restores it)",
                        manifest.id[:12], manifest.id)  # fmt: skip
        row = _bundle_row(manifest, compile_seconds, "yanked" if yanked else "active")
        if donor is None or yanked:  # nothing carried, or never the newest: any commit of the key may come between
            replaced = index.newest_bundle(manifest.bundle_key)
            return manifest, data, wrote, row, index.add_bundle(row), replaced
        try:
            created = index.add_bundle(row, if_newest=donor.newest.id if donor.newest is not None else None)
        except NewestChanged as exc:
            log.info("bundle %s was committed for key %s while this publish carried %s; carrying from it instead",
                     (exc.found or "none")[:12], exc.bundle_key, (exc.expected or "none")[:12])  # fmt: skip
            changed = NewestChanged(exc.url, exc.bundle_key, exc.expected, exc.found, tries)
            time.sleep(random.uniform(0, min(1.0, _CARRY_PAUSE * 2 ** min(tries, 5))))  # let the others commit
            continue
        if len(contents.entries) > len(own.entries) and _donor_yanked(store, index, donor):
            _yank_carrier(store, index, row, donor, config)
            continue  # and publish again, carrying from the newest bundle left
        return manifest, data, wrote, row, created, donor.newest
    if changed is None:
        raise IndexConflict(index.url, f"the newest bundle of key {fingerprint.bundle_key} was yanked after "
                            "each commit of this publish", tries)  # fmt: skip
    raise changed


def _donor_yanked(store: Store, index: Index, donor: _Donor) -> bool:
    """Whether the bundle just carried from is yanked now: a yank that landed right after the commit
    (Index.add_bundle orders the two), before this publish could know."""
    assert donor.newest is not None and donor.manifest is not None
    try:
        gone = index.get_bundle(donor.newest.id).status != "active"
    except NotFound:  # gc deleted it since: only a yanked row leaves its id behind
        gone = index.was_yanked(donor.newest.id)
    return gone or _yanked_before(store, donor.manifest)


def _yank_carrier(store: Store, index: Index, row: Bundle, donor: _Donor, config: PublishConfig) -> None:
    """Yank the bundle just committed, which carries the files of `donor`, yanked since: a yanked
    bundle's files must never come back. Yanked at once rather than replaced by the next commit:
    pods may restore it meanwhile, and a publish cut short here (SIGTERM) would leave it the newest."""
    from kcache.yank import yank

    assert donor.newest is not None
    log.warning("bundle %s, yanked as this publish committed, had its files carried into bundle %s: yanking that "
                "too and publishing again without them", donor.newest.id[:12], row.id[:12])  # fmt: skip
    yank(store, index, row.id, f"carried the files of bundle {donor.newest.id}, yanked as it was committed",
         signer=config.signing_key)  # fmt: skip


class _Lease:
    """The publish lease of `bundle_key` (see the module's docstring): `take()` tries once, `wait()`
    tries until it holds it or `config.peer_wait` has passed since the first try; once held, a thread
    renews it until the block ends, which releases it. An index that cannot keep leases costs the
    duplicate uploads they save, never the publish."""

    def __init__(self, index: Index, bundle_key: str, config: PublishConfig, note: Callable[[str], None]):
        self._index, self._key, self._seconds, self._note = index, bundle_key, config.lease_seconds, note
        self._holder = f"{socket.gethostname()}:{os.getpid()}:{os.urandom(4).hex()}"[-128:]
        self._deadline = time.monotonic() + config.peer_wait
        self._cut_short = config.lease_deadline
        self._stop = threading.Event()
        self._renewing: threading.Thread | None = None
        self._until: datetime | None = None  # the other holder's lease, after a try that failed
        self._broken = False

    def __enter__(self) -> _Lease:
        return self

    def take(self) -> bool:
        try:
            self._until = self._index.take_lease(self._key, self._holder, self._seconds)
        except KcacheError as exc:
            log.warning("cannot take the publish lease of %s (%s); publishing without it", self._key, exc)
            self._broken = True  # no waiting for a lease this index cannot keep
            return False
        if self._until is None:
            self._renewing = threading.Thread(target=self._renew, name="kcache-lease", daemon=True)
            self._renewing.start()
        return self._until is None

    def wait(self) -> None:
        if self._broken:
            return
        if (left := self._left()) > 0 and self._until is not None:
            log.info("waiting up to %.0f s for another publish of bundle key %s", left, self._key)
            self._note(f"waiting for another publish of bundle key {self._key[:12]} "
                       f"(its lease runs to {self._until:%H:%M:%S})")  # fmt: skip
        while not self.take():
            if self._broken or (left := self._left()) <= 0:
                if self._until is not None:
                    log.warning("another publish of bundle key %s still holds its lease (until %s); publishing "
                                "anyway", self._key, f"{self._until:%H:%M:%S}")  # fmt: skip
                return
            time.sleep(min(_LEASE_POLL, left))

    def _left(self) -> float:
        """Seconds the wait may still take: until peer_wait has passed, or the caller's deadline."""
        cut = self._cut_short() if self._cut_short is not None else None
        return min(self._deadline, self._deadline if cut is None else cut) - time.monotonic()

    def _renew(self) -> None:
        while not self._stop.wait(self._seconds / 3):
            try:
                lost = self._index.take_lease(self._key, self._holder, self._seconds) is not None
            except KcacheError as exc:
                log.warning("cannot renew the publish lease of %s: %s", self._key, exc)
                continue
            if lost:  # it lapsed and another publish took it: that one no longer waits for this one
                log.warning("the publish lease of %s passed to another publish", self._key)
                return

    def __exit__(self, *exc) -> None:
        if self._renewing is None:
            return
        self._stop.set()
        self._renewing.join()
        try:
            self._index.release_lease(self._key, self._holder)
        except KcacheError as exc:  # it lapses by itself
            log.warning("cannot release the publish lease of %s: %s", self._key, exc)


def _donor(store: Store, index: Index, fingerprint: Fingerprint, config: PublishConfig,
           known: _Donor | None = None) -> _Donor:  # fmt: skip
    """The key's newest bundle, and its manifest when this publish may carry its files where ROOT
    lacks them; `known`'s manifest again when the newest is still that bundle. Not a bundle the
    store marks yanked (the index's status is checked at the commit: Index.add_bundle)."""
    newest = index.newest_bundle(fingerprint.bundle_key)
    if newest is None:
        return _Donor(None, None)
    if known is not None and known.newest is not None and known.newest.id == newest.id:
        manifest = known.manifest
    else:
        manifest = _newest_to_carry(store, fingerprint, config, newest)
    if manifest is not None and _yanked_before(store, manifest):
        log.warning("not carrying the files of bundle %s: it was yanked", manifest.id[:12])
        manifest = None
    return _Donor(newest, manifest)


def _newest_to_carry(store: Store, fingerprint: Fingerprint, config: PublishConfig,
                     newest: Bundle) -> manifests.Manifest | None:  # fmt: skip
    """The manifest of `newest`, the key's newest bundle; None when it may not be carried. With a
    signing key, only a bundle that key signed: this publish signs what it carries, and must not
    sign what a store or index writer planted.

    Only a donor that fails its checks (damaged, missing, oversized, unsigned) is not carried. A
    store that could not answer fails the publish: carrying nothing, it would commit a newest
    bundle without the other replicas' kernels (watch publishes again when next due)."""
    try:
        manifest = manifests.fetch(store, newest.id)
        if manifest.bundle_key != fingerprint.bundle_key:
            raise IntegrityError("manifest", newest.id, f"is for bundle key {manifest.bundle_key}")
        if config.signing_key is not None:
            size = store.size(manifest_key(newest.id))
            trusted = (signing.public_of(config.signing_key),)
            if signing.verify(store, trusted, fingerprint.bundle_key, newest.id, size) is None:
                raise IntegrityError("manifest", newest.id, f"is not signed by {config.signing_key.name!r}")
    except (IntegrityError, ObjectMissing, SignatureError) as exc:  # ObjectTooLarge is an IntegrityError
        log.warning("not carrying the files of bundle %s: %s", newest.id[:12], exc)
        return None
    return manifest


def _carried(index: Index, donor: manifests.Manifest, local: set[str]) -> list[tuple[str, manifests.Entry]]:
    """(layer, entry) of `donor`'s entries for paths ROOT lacks: neither one of its files, nor a
    directory above one, nor under one, in a built-in layer this kcache knows (not extra layers:
    each pod names its own, and two names with one export clash), under a name publish would take
    from ROOT (no junk). Their packs are revived as this publish's own are (a pack gc has taken
    meanwhile takes its files with it)."""
    from kcache.index import lifecycle

    above = {path.rsplit("/", i)[0] for path in local for i in range(1, path.count("/") + 1)}
    sources = [s for s in sources_for_manifest(donor.layers) if not isinstance(s, ExtraSource)]

    def layer_of(path: str) -> str | None:
        source = next((s for s in sources if path.startswith(s.subdir + "/")), None)
        if source is None or not source.takes(path[len(source.subdir) + 1 :]):
            return None
        parents = (path.rsplit("/", i)[0] for i in range(1, path.count("/") + 1))
        clashes = path in local or path in above or any(p in local for p in parents)
        return None if clashes else source.name

    wanted = [(name, e) for e in donor.entries if (name := layer_of(e.path)) is not None]
    gone = lifecycle.revive(index, {e.pack for _, e in wanted})
    return [(name, e) for name, e in wanted if e.pack not in gone]


def _yanked_before(store: Store, manifest: manifests.Manifest) -> bool:
    """Whether the store says this bundle was yanked: its `yanks/<id>` marker, or its key's ref
    listing it (the evidence reindex takes too).

    A yank outlives the bundle's row (gc keeps the marker, and the index its id): the same bytes
    published again, by a warmup that compiled the same broken kernels, must not become the newest
    bundle again. Any store writer can delete the marker, but not edit a signed ref's yank list.
    Neither is checked for a signature: a false yank only costs a cold start (see kcache.refs).
    """
    if store.exists(refs.yank_key(manifest.id)):
        return True
    try:
        ref = refs.read(store, manifest.bundle_key)
    except IntegrityError as exc:  # damaged or oversized: no evidence, and advance replaces it
        log.warning("cannot read the ref of %s for its yank list: %s", manifest.bundle_key, exc)
        return False
    return ref is not None and manifest.id in ref.yanked


def _check_readable(manifest: manifests.Manifest, data: bytes) -> None:
    """Every check a restore makes of a manifest's bytes (manifest.parse: more layers than it takes, more
    JSON values than its bytes may make, a name no file system holds), made before the manifest is
    written (packs already up are orphans to gc): one every pod refuses would make each restore of the
    key a miss after this publish."""
    try:
        manifests.parse(data, manifest.id)
    except (IntegrityError, UnsafePath) as exc:
        raise IntegrityError("manifest", manifest.id, f"every restore would refuse it, so it is not published: "
                             f"{exc}") from None  # fmt: skip


def _upload_until_revived(collected: list[Collected], store: Store, index: Index, jobs: int, note,
                          report: progress.Report | None = None):  # fmt: skip
    """Steps 1-2 for whatever the index lacks, then revive every pack the bundle will name.

    GC may sweep a condemned pack between our lookup and the revive (the lookup comes before the
    uploads, which may take minutes); its blob rows go with it, so another round uploads those
    blobs afresh. A pack the index names but the store lacks is
    forgotten and its blobs uploaded too. Returns (new, bytes uploaded, packs, locations).
    """
    from kcache.index import lifecycle

    new_all: list[Collected] = []
    uploaded = packs = 0
    for _ in range(_REVIVE_ROUNDS):
        missing = index.find_missing(c.blob for c in collected)
        new = list({c.blob: c for c in collected if c.blob in missing}.values())
        note(f"{len(new)} new blobs of {len(collected)} files")
        groups = _plan_packs(new)
        with (
            workdir() as tmp,
            ThreadPoolExecutor(max(1, jobs)) as pool,
            ThreadPoolExecutor(max(1, jobs), thread_name_prefix="kcache-compress") as chunks,
            progress.Meter("uploading", files=len(new), bytes=sum(c.info.size for c in new), report=report) as meter,
        ):
            work = partial(_write_and_upload, store=store, index=index, workdir=tmp, chunks=chunks, meter=meter,
                           building=threading.Lock())  # fmt: skip
            uploaded += sum(sent for sent, _ in pool.map(work, groups))
        new_all += new
        packs += len(groups)
        locations = index.locate(c.blob for c in collected)
        vanished = [c.path for c in collected if c.blob not in locations]
        if vanished:  # GC swept a pack holding blobs find_missing had found, while the rest uploaded
            log.warning("%d blobs left the index while this publish uploaded (a GC sweep?), e.g. %s; uploading "
                        "them again", len(vanished), vanished[0])  # fmt: skip
            continue
        named = {where.pack_id for where in locations.values()}
        if lifecycle.revive(index, named):
            continue  # GC swept some of them: their blobs are missing now, upload them again
        # Revived packs are safe from GC; one the store lost anyway (or swept before a row named it
        # again) is forgotten, so the next round uploads its blobs instead of naming it.
        with ThreadPoolExecutor(max(1, jobs)) as pool:
            there = dict(zip(named, pool.map(lambda p: store.exists(pack_key(p)), named)))
        lost_packs = {p for p, present in there.items() if not present}
        if lost_packs:
            log.warning("%d packs the index names are missing from the store; uploading their blobs again",
                        len(lost_packs))  # fmt: skip
            lifecycle.forget(index, lost_packs)
            continue
        return new_all, uploaded, packs, locations
    raise IntegrityError("bundle", "", f"packs kept disappearing under a running GC ({_REVIVE_ROUNDS} rounds)")


def _sized_as_stored(collected: list[Collected], locations: Mapping[str, BlobLocation]) -> list[Collected]:
    """`collected` less any file whose size is not that of the blob its id names, with a warning.

    A file hashed at another size than the walk saw is skipped while hashing; this catches what
    no hashing saw (an entry of a damaged hash cache): restore lays out exactly the size a
    manifest records beside a blob, and a bundle that lies about one cannot be restored.
    """
    kept = []
    for c in collected:
        if locations[c.blob].size == c.info.size:
            kept.append(c)
        else:
            log.warning("skipping %r: %d bytes when listed, but its content id names %d bytes (changed while it "
                        "was published, or a stale hash cache)", str(c.info.path), c.info.size,
                        locations[c.blob].size)  # fmt: skip
    return kept


def _write_manifest(store: Store, manifest: manifests.Manifest, data: bytes, key: signing.SigningKey | None) -> bool:
    """The manifest, then its signature (a committed bundle is already signed), each replacing other
    bytes stored under its name. False if either was already there: gc may sweep an orphan it
    found before our commit point, so the caller looks again after it."""
    wrote = limits.put_exactly(store, manifest_key(manifest.id), data, "manifest")
    if key is not None:
        wrote = signing.sign(store, key, manifest.bundle_key, manifest.id, len(data)) and wrote
    return wrote


def _manifest_stored(store: Store, manifest_id: str, key: signing.SigningKey | None) -> bool:
    signed = key is None or store.exists(signing.signature_key(manifest_id, key.name))
    return signed and store.exists(manifest_key(manifest_id))


def _manifest(fp: Fingerprint, layers: list[str], entries: list[manifests.Entry], info,
              chunks: Mapping[str, Sequence[str]] | None = None) -> manifests.Manifest:  # fmt: skip
    return manifests.build(fp.bundle_key, fp.toolchain_key, fp.workload_key, fp.facts, layers, entries, info,
                           chunks=chunks)  # fmt: skip


def _entry(c: Collected, where: BlobLocation) -> manifests.Entry:
    return manifests.Entry(c.path, c.info.mode, c.info.size, c.blob, where.pack_id, where.offset, where.length,
                           c.info.mtime_ns)  # fmt: skip


def _bundle_row(manifest: manifests.Manifest, compile_seconds: float | None = None, status: str = "active") -> Bundle:
    return Bundle(
        id=manifest.id,
        bundle_key=manifest.bundle_key,
        toolchain_key=manifest.toolchain_key,
        workload_key=manifest.workload_key,
        model=manifest.facts.get("model.id"),
        facts=dict(manifest.facts),
        layers=manifest.layers,
        files=len(manifest.entries),
        bytes=manifest.total_size,
        created_at=datetime.now(timezone.utc),
        created_by=socket.gethostname(),
        status=status,
        compile_seconds=compile_seconds,
    )


def restore_inputs(root: Path) -> dict[str, str] | None:
    """The workload facts (model.*, workload.*, extra.*) the last restore into ROOT computed, or None.

    What a pod restored is what it publishes: `publish --from ROOT` and `watch --root ROOT`
    without a model take these, so their bundles reach the pods that restore the same way.
    """
    state = readiness.read_marker(Path(root), readiness.RESTORE_MARKER) or {}
    inputs = state.get("inputs")
    if not isinstance(inputs, dict) or not inputs:
        return None
    if not all(isinstance(v, str) and fingerprints.is_workload_fact(str(k)) for k, v in inputs.items()):
        return None  # not what restore writes: trust none of it
    return {str(k): v for k, v in inputs.items()}


def _check_from(root: Path) -> None:
    """SourceDirError for a --from ROOT that is not a directory."""
    if not root.is_dir():
        raise SourceDirError("--from", str(root), "does not exist" if not root.exists() else "is not a directory")


def names_a_model(fp: Fingerprint) -> bool:
    return fp.facts.get("model.id", fingerprints.NONE) != fingerprints.NONE or "model.config" in fp.facts


def workload_of(fp: Fingerprint, root: Path | None, given: Mapping[str, str] | None = None) -> Fingerprint:
    """`fp` when it names a model; else `fp` with the workload ROOT's restore recorded, `given` over it.

    `given` holds the workload facts the command line itself named (--extra, --fact model.*).
    Raises ConfigError when neither names a model: a bundle under model "none" reaches no pod that
    restores with its model.
    """
    if names_a_model(fp):
        return fp
    if root is not None:  # the record would be read there: a ROOT that is not there is the error to name
        _check_from(Path(root))
    recorded = restore_inputs(root) if root is not None else None
    if recorded is None:
        where = f"and {root} records no restore with one" if root is not None else "(or --from a restored ROOT)"
        raise ConfigError("--model", fingerprints.NONE, f"publishing needs the model identity {where}; pass --model ID")
    toolchain = {k: v for k, v in fp.facts.items() if not fingerprints.is_workload_fact(k)}
    # The command line wins over the record fact by fact rather than being refused: that is the
    # precedence everywhere else (a later, more explicit source wins, none drops a fact), --model
    # already overrides the whole record, and a user who types --extra tp=2 means tp=2; a refusal
    # would only make them retype the record's model. "none" is collect's placeholder, not a model.
    flags = {k: v for k, v in (given or {}).items() if (k, v) != ("model.id", fingerprints.NONE)}
    rebuilt = fingerprints.compute({**toolchain, **recorded, **flags})
    # The record holds workload facts only, and the facts file was checked against this machine's
    # own facts: its disagreements still stand, and publish must still refuse them.
    return replace(rebuilt, mismatches=fp.mismatches)
