"""A node cache in front of a store: packs read from a directory on the node before the network.

`NodeCacheStore(inner, DIR)` is a Store: pack reads (`open_range` on packs/...) are served from DIR,
which it fills with whole packs as they are first asked for; everything else goes to `inner`.
`kcache restore --node-cache DIR` reads through it, and `kcache prefetch` (a DaemonSet, one per GPU
node) keeps the packs of named models in DIR before any pod asks.

    DIR/
      .evict.lock                   held (exclusive) by whoever is making room
      packs/<hh>/<pack-id>          a whole pack, copied from the store and verified
      packs/<hh>/.lock-<pack-id>    flock: shared while a reader has the pack open, exclusive while
                                    one process fills, replaces or evicts it
      packs/<hh>/.tmp-<pack-id>-*   a fill in progress (kcache.atomic's temp sibling)
      .tmp-junk-<hex>, packs/<hh>/.tmp-junk-<hex>
                                    a directory found at a lock or pack path, set aside to be removed

Rules, because many pods on a node restore at once and DIR outlives every one of them:

- A pack id is the SHA-256 of the whole pack. A fill hashes the bytes as they arrive and renames
  them into place only if they match; a reader hashes a cached pack once per process before it
  serves a byte of it. A file that does not match is corrupt: deleted and fetched again.
- One fetch per pack per node: the first reader takes the pack's lock exclusively and downloads it;
  the others wait on the lock (until `wait` seconds after the wrapper was made, then they read
  the store directly) and read the cached file. No fill starts once that deadline is too close for
  the pack at MIN_FILL_RATE: past it, every range is read from the store once. Whoever gets the
  exclusive lock looks again at what is there, by its hash: a peer's fill may have the damaged
  file's inode and size.
- A fill reads no more than the pack can be: at most `fill_limit(need)` bytes, where `need` is the
  largest offset+length its reader will read from it (restore announces every pack's through
  `expect_reads`, prefetch passes it to `warm`; else the range asked for). A store object larger
  than that is not the pack the (signed) manifest names, only padding that would fail its hash:
  it is refused before anything is evicted or written, and read from the store range by range.
- A fill starts only where DIR's disk has the pack's size free (statvfs): on a full disk each fill
  had downloaded its pack, failed to write it, and the reader read it from the store again.
- Size cap `max_bytes` (KCACHE_NODE_CACHE_MAX_BYTES): before a fill, the least recently used packs
  go first, if .evict.lock is free at once (a fill never waits for it: `trim`, or the next fill,
  evicts what a fill made while someone held it). Use is the file's mtime, set on every read,
  because atime is off on most node disks (noatime). A pack someone holds a lock on (a reader or a
  filler) is never evicted, so the cap can be exceeded while every pack is in use. A reader holds a
  pack only while a range is open: one evicted between two of its ranges is not fetched again by that
  wrapper, its later ranges come from the store (else a pack read in k ranges came k times whole).
- Whoever can write DIR may plant anything in it. The rules for links, directories and other plants
  at its directory, lock and pack paths are kcache.store.nodedir's: every lock, removal and listing
  here goes through it. A pack's path is opened without following links or waiting, and
  hashed only if it is a regular file no larger than the pack can be. Only packs/<hh>/<id> is counted
  against the cap: that is what eviction can remove. A fill trusts the inode it wrote, not what the
  path names after the rename.
- A copy can go bad after it was hashed: a peer rewrites or truncates the file in place, or the disk
  fails to read it. A read error, or an end of file before the size that was hashed, is the node
  cache's: the pack is dropped and the reader's resume gets the bytes left from the store. Bytes
  changed in place only the reader's per-blob check sees: restore then `drop`s the packs whose
  blobs failed and reads what is left from `inner` itself. A dropped pack is read from the store
  for the rest of the wrapper's life, its verified identities are forgotten, and its copy is
  removed if it is still the file that failed, nobody holds it (else the next reader hashes it) and
  it no longer hashes to its id (a good copy's blob fails only by a hostile manifest's rows).
  A copy that cannot be read while it is hashed (EIO) is replaced like one that does not match.
- The node cache can only cost time: when DIR cannot be used, reads go to `inner`. A long-lived
  caller (prefetch) bounds each `warm` and `trim` with its own `wait`: a peer that holds a lock
  forever (frozen, or hostile) must not stop it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import stat
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kcache import atomic, filelock, sizes
from kcache.errors import IntegrityError, KcacheError, RootError, StoreError
from kcache.packs import TARGET_PACK_BYTES
from kcache.store import nodedir
from kcache.store.base import Leftover, ObjectInfo, store_now
from kcache.streams import GuardedReader, Resumable, Window

log = logging.getLogger(__name__)

MAX_BYTES_ENV = "KCACHE_NODE_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 32 * 1024**3
_PACK_KEY = re.compile(r"packs/([0-9a-f]{2})/([0-9a-f]{64})\Z")
_SHARD = re.compile(r"[0-9a-f]{2}\Z")
_TEMP = re.compile(r"\.tmp-([0-9a-f]{64})-")
_CHUNK = 1024 * 1024
# A fill holds its pack's lock: past FILL_GRACE seconds plus one for each MIN_FILL_RATE bytes it is
# stuck (a store trickling bytes, which no per-read socket timeout catches), and the pack is left
# to the store. The download goes on in its thread until the store lets go; its bytes still only
# land once they hash to the pack's id. While it goes on, no second download of that pack starts in this
# process: prefetch's next round had started one beside it, one more thread (and connection) a round.
FILL_GRACE = 60.0
MIN_FILL_RATE = 1024 * 1024
# How far a pack may reach past the last byte its bundle names. A pack shared by small files holds
# at most TARGET_PACK_BYTES of content (a few % more once compressed, with frame headers), and a
# later bundle may name only its first blobs; a large file's pack holds that file alone, but its
# trailer (~100 bytes a blob) and a publisher's salt blob follow it.
_SHARED_PACK_BOUND = TARGET_PACK_BYTES + TARGET_PACK_BYTES // 16
_TAIL_SLACK = 8 * 1024 * 1024
_TOO_LARGE = object()  # what `_open_verified` finds when the file cannot be the pack its reader needs


def fill_limit(need: int) -> int:
    """The largest store object a fill accepts as the pack a reader needs `need` bytes of."""
    return max(need, _SHARED_PACK_BOUND) + _TAIL_SLACK


def max_bytes_from_env(env=None) -> int:
    """The cap: KCACHE_NODE_CACHE_MAX_BYTES (`50Gi`, or bytes), else 32 GiB."""
    text = (os.environ if env is None else env).get(MAX_BYTES_ENV, "").strip()
    return sizes.parse(text, MAX_BYTES_ENV) if text else DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class Usage:
    packs: int
    bytes: int
    max_bytes: int


@dataclass(frozen=True)
class Warmed:
    pack: str
    fetched: bool  # False: it was already cached (and verified)
    bytes: int


class NodeCacheStore:
    """`inner` with pack reads served from (and filling) the node cache directory `directory`."""

    def __init__(self, inner, directory: Path, *, max_bytes: int | None = None, wait: float | None = None):
        self.inner, self.url = inner, inner.url
        self.directory = Path(directory)
        self.max_bytes = max_bytes_from_env() if max_bytes is None else max_bytes
        self._until = None if wait is None else time.monotonic() + wait
        self._verified: set[tuple[int, int, int]] = set()  # (dev, inode, size) hashed by this process
        self._mutexes: defaultdict[str, threading.Lock] = defaultdict(threading.Lock)
        self._guard = threading.Lock()
        self._fetched: set[str] = set()  # packs this wrapper downloaded, so `warm` can tell a fetch from a hit
        self._needs: dict[str, int] = {}  # pack id -> the largest offset+length a reader announced
        self._served: dict[str, set[tuple[int, int, int]]] = {}  # pack id -> the copies it was served from
        self._dropped: set[str] = set()  # packs whose copy went bad: read from `inner` from now on
        self._doomed: dict[str, set[tuple[int, int, int]]] = {}  # dropped copies still to remove
        self._unreadable: set[str] = set()  # dropped because a copy failed to read, not by a blob's check
        self._warned = False
        self._said: set[tuple] = set()  # what was warned about (_warn_first): said once, then at debug level
        self._kept: set[str] | frozenset[str] = frozenset()  # packs eviction by this wrapper leaves alone
        self._no_room: dict[str, int] = {}  # pack id -> the free bytes its disk had, too few to fill it
        self._downloading: dict[str, float] = {}  # pack id -> when its download, given up on, started

    # ---- the Store protocol: packs from the node cache, everything else from the store -----------

    def open_range(self, key: str, offset: int, length: int) -> BinaryIO:
        pack_id = _pack_id(key)
        held = None
        if pack_id is not None and pack_id in self._dropped:
            self._remove_doomed(pack_id)
        elif pack_id is not None:
            with self._guard:
                need = max(self._needs.get(pack_id, 0), offset + length)
                refill = pack_id not in self._served
            try:
                held = self._open_cached(pack_id, key, need, self._deadline(), refill=refill)
            except StoreError:
                pass  # the store's own failure: the read below meets it again and reports it
            except (OSError, KcacheError) as exc:
                self._warn_once(pack_id, exc)
        if held is None:
            return self.inner.open_range(key, offset, length)
        with self._guard:
            self._served.setdefault(pack_id, set()).add(held.identity)
        held.seek(offset)
        return Window(_Served(self, held, pack_id, key, offset), length)

    def now(self):
        """The store's clock: the node cache stamps no object gc ages."""
        return store_now(self.inner)

    def delete(self, key: str) -> None:
        self.inner.delete(key)
        pack_id = _pack_id(key)
        if pack_id is not None:
            try:
                self._remove(pack_id, self._deadline())
            except OSError as exc:
                self._warn_once(pack_id, exc)

    def put_file(self, key: str, path: Path) -> bool:
        return self.inner.put_file(key, path)

    def put_bytes(self, key: str, data: bytes) -> bool:
        return self.inner.put_bytes(key, data)

    def get_bytes(self, key: str) -> bytes:
        return self.inner.get_bytes(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def leftovers(self) -> Iterator[Leftover]:
        return self.inner.leftovers()

    def remove_leftover(self, leftover: Leftover) -> None:
        self.inner.remove_leftover(leftover)

    def get_versioned(self, key: str, limit: int | None = None) -> tuple[bytes, str] | None:
        return self.inner.get_versioned(key, limit)

    def put_if(self, key: str, data: bytes, version: str | None) -> bool:
        return self.inner.put_if(key, data, version)

    # ---- what restore and prefetch use --------------------------------------------------------------

    def drop(self, packs: Iterable[str]) -> list[str]:
        """Stop trusting the copies of `packs` this wrapper served: a reader found their bytes bad (a
        peer changed the file after it was hashed). They are read from `inner` from now on, their
        verified identities are forgotten, and each copy still at its path is removed unless someone
        holds it. Returns those of `packs` it had served from DIR: the others are not its to drop."""
        with self._guard:
            served = [pack_id for pack_id in dict.fromkeys(packs) if pack_id in self._served]
            for pack_id in served:
                self._condemn(pack_id)
        for pack_id in served:
            self._remove_doomed(pack_id)
        return served

    def expect_reads(self, needs: dict[str, int]) -> None:
        """Announce, per pack id, the largest offset+length about to be read (kcache.fetch does, from
        the manifest): a fill then accepts the pack up to `fill_limit` of that, not of one range."""
        with self._guard:
            for pack_id, need in needs.items():
                self._needs[pack_id] = max(need, self._needs.get(pack_id, 0))

    def warm(self, pack_id: str, need: int = 0, *, wait: float | None = None) -> Warmed:
        """Make sure the pack is cached and verified; its use time becomes now. `need`: the largest
        offset+length the bundle names in it (a store object past `fill_limit(need)` is refused);
        `wait`: the most seconds this call waits for locks (besides the wrapper's own deadline).
        Raises StoreError/ObjectMissing/IntegrityError from the store, RootError for DIR."""
        key = f"packs/{pack_id[:2]}/{pack_id}"
        if _pack_id(key) is None:
            raise IntegrityError("pack", pack_id, "is not a SHA-256 hex digest")
        self._fetched.discard(pack_id)
        with self._guard:
            self._no_room.pop(pack_id, None)  # this call's reason, not an earlier round's
        self._forget(pack_id)  # hashed again: a long-lived prefetch must see a copy damaged since its last round
        try:
            held = self._open_cached(pack_id, key, need, self._deadline(wait))
        except OSError as exc:
            raise self._root_error(exc) from None
        if held is None:
            raise RootError(str(self.directory), self._not_cached(pack_id, need))
        with held:
            size = os.fstat(held.fileno()).st_size
        return Warmed(pack_id, pack_id in self._fetched, size)

    def _not_cached(self, pack_id: str, need: int) -> str:
        """Why `warm` left a pack to the store: the file at its path, when it is larger than the pack can
        be (left alone: it may be another bundle's larger pack), else the cap or a lock held too long."""
        path = self._path(pack_id)
        st = nodedir.lstat(path)
        if st is not None and stat.S_ISREG(st.st_mode) and st.st_size > fill_limit(need):
            return (f"{path} ({st.st_size} bytes) is larger than the pack can be; it is left alone, "
                    "as another bundle's larger pack may be")  # fmt: skip
        if (free := self._no_room.get(pack_id)) is not None:
            return f"its disk had {free} bytes free, too few for pack {pack_id[:12]}"
        return f"pack {pack_id[:12]} is larger than the cap or stayed locked"

    @contextlib.contextmanager
    def keeping(self, packs: set[str]) -> Iterator[None]:
        """While inside, eviction by this wrapper skips `packs`, a set the caller may add to between
        warms: prefetch keeps what its round warmed, which its own later fills had evicted."""
        self._kept = packs
        try:
            yield
        finally:
            self._kept = frozenset()

    def holds(self, pack_id: str) -> bool:
        """Whether a pack-like file is at the pack's path now (not hashed: `warm` does that); False where
        its shard cannot be looked into (a peer made it unsearchable)."""
        try:
            st = nodedir.lstat(self._path(pack_id))
        except OSError:
            return False
        return st is not None and stat.S_ISREG(st.st_mode)

    def _forget(self, pack_id: str) -> None:
        """Drop what this process knows of the copy at the pack's path: the next open hashes it."""
        try:
            st = os.stat(self._path(pack_id), follow_symlinks=False)
        except OSError:
            return
        self._verified.discard((st.st_dev, st.st_ino, st.st_size))

    def usage(self) -> Usage:
        try:
            files = self._cached_files()
        except OSError as exc:
            raise self._root_error(exc) from None
        return Usage(len(files), sum(f.size for f in files), self.max_bytes)

    def trim(self, *, wait: float | None = None) -> None:
        """Evict down to the cap and remove what killed fills and removals left behind; eviction is
        skipped when another process is evicting for longer than `wait` seconds."""
        try:
            if not self.directory.is_dir():  # EACCES where a directory above it cannot be searched
                return
            self._remove_junk()
            self._make_room(0, self._deadline(wait))
        except OSError as exc:
            raise self._root_error(exc) from None

    def _remove_junk(self) -> None:
        """Remove the directories a removal killed part-way set aside (nodedir.clear), in DIR and in each
        shard: only here, in prefetch's trim, not in a fill, whose time is a restore's budget. They are
        removed, not counted against the cap: a tree this cannot remove, no eviction could either."""
        places = [self.directory]
        if nodedir.is_directory(self.directory / "packs"):
            places += [Path(shard.path) for shard in nodedir.entries(self.directory / "packs")
                       if _SHARD.match(shard.name) and shard.is_dir(follow_symlinks=False)]  # fmt: skip
        removed = sum(nodedir.remove_junk(place) for place in places)
        if removed:
            log.info("node cache: removed %d directories that removals killed part-way had set aside", removed)

    def _deadline(self, wait: float | None = None) -> float | None:
        """When one call stops waiting for locks: the wrapper's deadline, or `wait` from now if sooner."""
        ends = [end for end in (self._until, None if wait is None else time.monotonic() + wait) if end is not None]
        return min(ends) if ends else None

    def _root_error(self, exc: OSError) -> RootError:
        return RootError(str(self.directory), f"cannot use the node cache: {exc.strerror or exc}")

    # ---- reading and filling ---------------------------------------------------------------------

    def _path(self, pack_id: str) -> Path:
        return self.directory / "packs" / pack_id[:2] / pack_id

    def _lock_path(self, pack_id: str) -> Path:
        return self.directory / "packs" / pack_id[:2] / f".lock-{pack_id}"

    def _failed(self, pack_id: str, why: str) -> StoreError:
        """A copy this wrapper serves cannot be read to its hashed end: drop the pack (it is open, so its
        removal waits for a later read of it) and say so, as a store error the reader's resume answers."""
        with self._guard:
            first = pack_id not in self._dropped
            self._condemn(pack_id)
            self._unreadable.add(pack_id)
        if first:
            log.warning("node cache %s: %s; reading pack %s from the store", self.directory, why, pack_id[:12])
        return StoreError(str(self.directory), why)

    def _condemn(self, pack_id: str) -> None:
        """(With the guard held.) The pack is read from the store from now on; the copies it was served
        from are known good no more, and are to be removed."""
        copies = self._served.get(pack_id, set())
        self._dropped.add(pack_id)
        self._verified.difference_update(copies)
        self._doomed.setdefault(pack_id, set()).update(copies)

    def _remove_doomed(self, pack_id: str) -> None:
        """Remove a dropped pack's copy, if the file at its path is still one that failed: the next pod
        then fetches the pack instead of hashing a bad copy first (or, where the disk fails, instead
        of reading the store for good). Only without waiting, under the pack's exclusive lock: while
        anyone holds the pack (a reader of ours still open, a peer that hashed it itself) it stays
        for a later read to remove, and meanwhile whoever opens it hashes it first."""
        with self._guard:
            doomed = self._doomed.get(pack_id)
            unreadable = pack_id in self._unreadable
        if not doomed:
            return
        path, lock_path = self._path(pack_id), self._lock_path(pack_id)
        try:
            if all(nodedir.is_directory(d) for d in (self.directory / "packs", lock_path.parent)):
                lock = nodedir.lock(lock_path, filelock.EXCLUSIVE, 0.0)
                if lock is None:
                    return  # held: try again at the next read of it
                with lock:
                    st = nodedir.lstat(path)
                    if (st is not None and (st.st_dev, st.st_ino) in {(dev, ino) for dev, ino, _size in doomed}
                            and (unreadable or not self._hashes_right(pack_id, path))):  # fmt: skip
                        nodedir.clear(path)
                        log.info("node cache: removed the bad copy of pack %s", pack_id[:12])
        except OSError as exc:  # not ours to remove (a read-only mount): the next reader hashes it
            log.debug("node cache: cannot remove the bad copy of pack %s: %s", pack_id[:12], exc.strerror or exc)
        with self._guard:
            self._doomed.pop(pack_id, None)

    def _hashes_right(self, pack_id: str, path: Path) -> bool:
        """Whether the regular file at `path` (its lock held) still hashes to the pack's id. A blob that
        failed its check in a good copy is the manifest's fault, not the copy's: a hostile manifest an
        unsigned pod took (a wrong blob id, a wrong size) had its drop remove any pack it named from
        the node, another bundle's too."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return False
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                return False
            os.set_blocking(fd, True)
            try:
                good = nodedir.sha256(f, st.st_size) == pack_id
            except OSError:
                return False
        if good:
            log.info("node cache: pack %s hashes to its id: its blob failed by its manifest, not by its copy; "
                     "kept", pack_id[:12])  # fmt: skip
        return good

    def _open_cached(self, pack_id: str, key: str, need: int, deadline: float | None, *,
                     refill: bool = True) -> _Held | None:  # fmt: skip
        """The cached pack, open and verified, holding its shared lock; None: read the store instead.
        Without `refill`, a pack that is not there is not fetched: it was served before and evicted
        since, between two of its reader's ranges (under cap pressure, by a fill of ours or a peer's);
        fetched again whole for each range, a pack read in k ranges came from the store k times.

        Threads of this process take the pack's mutex before any file lock: a thread must never
        wait for the mutex while it holds a lock another thread of ours is waiting to upgrade past.
        """
        with self._guard:
            mutex = self._mutexes[pack_id]
        timeout = -1 if deadline is None else max(0.0, deadline - time.monotonic())
        if not mutex.acquire(timeout=timeout):
            return None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for directory in (self.directory / "packs", self._lock_path(pack_id).parent):
                nodedir.real_directory(directory)
            lock = nodedir.lock(self._lock_path(pack_id), filelock.SHARED, deadline)
            for _attempt in range(3):  # missing -> filled -> read; or bad -> replaced -> read
                if lock is None:
                    return None
                try:
                    found = self._open_verified(pack_id, need)
                except BaseException:
                    lock.release()
                    raise
                if isinstance(found, _Opened):
                    return _Held(found.file, lock, found.identity)
                lock.release()
                if found is _TOO_LARGE or (found is None and not refill):
                    return None
                lock = self._fill(pack_id, key, need, deadline)
            return None
        finally:
            mutex.release()

    def _open_verified(self, pack_id: str, need: int) -> _Opened | os.stat_result | object | None:
        """The pack, open, if it hashes to its id (call with its lock held); else the lstat of what
        is there (to be replaced: a bad file, or no regular file at all), None (nothing) or _TOO_LARGE.

        Whoever can write DIR can put a FIFO, a device, a link or a sparse 4 GiB file at the path:
        nothing is read before fstat says it is a regular file no larger than `fill_limit(need)`,
        the most a fill of ours accepts, so a reader never blocks or hashes past its wait. A larger
        one may be another reader's bigger pack: not ours to hash or remove, the store serves us."""
        path = self._path(pack_id)
        try:  # O_NONBLOCK: opening a FIFO must not wait for a writer
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            st = nodedir.lstat(path)
            self._warn_bad(pack_id, st, "node cache: %s is a link; fetching the pack again", path)
            return st
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._warn_bad(pack_id, st, "node cache: %s is not a regular file; fetching the pack again", path)
                return st
            if st.st_size > fill_limit(need):
                log.info("node cache: %s is larger than the pack can be; reading the store", path)
                return _TOO_LARGE
            os.set_blocking(fd, True)
            f, fd = os.fdopen(fd, "rb"), -1
        finally:
            if fd >= 0:
                os.close(fd)
        identity = (st.st_dev, st.st_ino, st.st_size)
        if identity not in self._verified:
            try:
                digest = nodedir.sha256(f, st.st_size)
            except OSError as exc:  # EIO from a failing disk: a copy that cannot be read is a bad one
                f.close()
                self._warn_bad(pack_id, st, "node cache: cannot read %s (%s); fetching it again", path,
                               exc.strerror or exc)  # fmt: skip
                return st
            if digest != pack_id:
                f.close()
                self._warn_bad(pack_id, st, "node cache: %s does not hash to its id; fetching it again", path)
                return st
            self._verified.add(identity)
        nodedir.touch(f.fileno(), path)
        return _Opened(f, identity)

    def _fill(self, pack_id: str, key: str, need: int, deadline: float | None) -> filelock.FileLock | None:
        """Fetch the pack into the cache under its exclusive lock; returns that lock, turned shared, for
        the reader to open the pack under. None: leave it to the store. IntegrityError: the store's
        object is larger than the pack can be (see `fill_limit`).

        The lock is turned shared, not let go and taken again: in between, a peer's fill that made room
        evicted the pack just written (the newest, where every older one was in use or the cap holds
        one pack), and the reader fetched it again, twice, then read the store as well.

        Under the exclusive lock, whatever is at the path is judged again by its hash, not by
        comparing it with what the reader found: a peer that replaced a damaged copy while we
        waited may have been given its inode back (ext4 reuses a freed one at once) with its size,
        or repaired it in place, and deleting that would fetch the pack a second time for nothing.
        A damaged file is hashed twice that way; a good one once (it is then known to this process)."""
        if not self._time_to_fill(need):
            return None
        lock = nodedir.lock(self._lock_path(pack_id), filelock.EXCLUSIVE, deadline)
        if lock is None:
            log.info("node cache: waited too long for pack %s; reading it from the store", pack_id[:12])
            return None
        try:
            filled = self._fill_locked(pack_id, key, need)
            if filled and lock.downgrade():
                return lock
        except BaseException:
            lock.release()
            raise
        lock.release()
        return nodedir.lock(self._lock_path(pack_id), filelock.SHARED, deadline) if filled else None

    def _fill_locked(self, pack_id: str, key: str, need: int) -> bool:
        """`_fill`'s work, with the pack's exclusive lock held. False: leave it to the store."""
        path = self._path(pack_id)
        found = self._open_verified(pack_id, need)
        if isinstance(found, _Opened):
            found.file.close()
            return True  # another reader filled or replaced it while we waited
        if found is _TOO_LARGE:
            return False
        self._not_downloading(pack_id)  # before the copy there goes: a slow download is no reason to lose it
        nodedir.clear(path)  # what is at the path (a damaged file, a link, a directory), not what a link names
        size = self.inner.size(key)
        if size > fill_limit(need):  # before any eviction: padding must not cost the node its packs
            raise IntegrityError("pack", pack_id, f"is {size} bytes in {self.inner.url}, more than the "
                                 f"{fill_limit(need)} a pack its readers need {need} bytes of can be")  # fmt: skip
        if size > self.max_bytes:
            log.info("node cache: pack %s (%d bytes) is larger than the cap; not cached", pack_id[:12], size)
            return False
        if not self._time_to_fill(size):
            return False
        # Eviction is best-effort: one try at .evict.lock, never a wait. A frozen pod holding it cost
        # every restore on the node half its --timeout, and prefetch LOCK_WAIT a pack.
        self._make_room(size, 0.0, own=pack_id)
        if not self._room_for(pack_id, size):  # judged once killed fills' temp files and evicted packs are gone
            return False
        written = self._download_in_time(path, key, pack_id, size)
        self._verified.add(written)  # the inode we wrote: the path may name a peer's file by now
        self._fetched.add(pack_id)
        # Room was made before the download, counting the packs in place then: fills that ran at
        # once each found room for themselves. Evict again now that this one is in (it is locked,
        # so it stays; so does any pack a reader holds).
        self._make_room(0, 0.0)
        return True

    def _room_for(self, pack_id: str, size: int) -> bool:
        """Whether DIR's disk has `size` bytes free for the pack, before it is downloaded. On a full disk
        (the volume filled by something else, or a cap above its size) a fill fetched the whole pack,
        failed to write it (ENOSPC), and its reader read the pack from the store again: each pod on
        the node fetched every pack twice. Such a pack is left to the store; the cap evicts nothing more
        for it than it would for a fill."""
        try:
            st = os.statvfs(self._path(pack_id).parent)
        except OSError:
            return True  # the fill's own write says what is wrong
        free = st.f_bavail * st.f_frsize
        if free >= size or st.f_blocks == 0:  # a file system that reports no sizes at all: its write says
            return True
        with self._guard:
            self._no_room[pack_id] = free
        self._warn_first(("no-room",), "node cache: %s has %d bytes free, too few for pack %s (%d bytes); reading "
                         "packs that do not fit from the store", self.directory, free, pack_id[:12], size)  # fmt: skip
        return False

    def _time_to_fill(self, size: int) -> bool:
        """Whether this wrapper's deadline leaves a fill of `size` bytes the time it takes at MIN_FILL_RATE.
        Past the deadline (or close to it) a fill was given up at once, its download left running,
        and the reader read the pack from the store as well: twice, or once a range plus once a fill."""
        wrapper = self._deadline()
        if wrapper is None:
            return True
        left = wrapper - time.monotonic()
        if left > 0 and left >= size / MIN_FILL_RATE:
            return True
        log.debug("node cache: %.1f s left, too little to fill %d bytes; reading the store", left, size)
        return False

    def _not_downloading(self, pack_id: str) -> None:
        """StoreError while a download of the pack that a fill gave up on still runs here: the store is
        still sending it too slowly, and a second download would only be a second thread stuck beside it."""
        with self._guard:
            since = self._downloading.get(pack_id)
        if since is not None:
            raise StoreError(self.inner.url, f"pack {pack_id[:12]} is still downloading, "
                                             f"{time.monotonic() - since:.0f} s after a fill gave up on it; "
                                             "reading it from the store")  # fmt: skip

    def _download_in_time(self, path: Path, key: str, pack_id: str, size: int) -> tuple[int, int, int]:
        """`_download` into `path` (atomically) on a thread of its own, waited for as long as a fill
        may hold the lock (FILL_GRACE, MIN_FILL_RATE), and no longer than this wrapper's deadline.
        A download given up on stays in `_downloading` until it ends."""
        limit = FILL_GRACE + size / MIN_FILL_RATE
        wrapper = self._deadline()
        if wrapper is not None:
            limit = min(limit, max(0.0, wrapper - time.monotonic()))
        box: dict = {}
        done = threading.Event()
        started = time.monotonic()

        def run() -> None:
            try:
                atomic.write(path, lambda dst: box.update(written=self._download(key, pack_id, size, dst)))
            except BaseException as exc:  # handed to the caller below
                box["error"] = exc
            finally:
                with self._guard:
                    done.set()
                    self._downloading.pop(pack_id, None)

        threading.Thread(target=run, name="kcache-node-fill", daemon=True).start()
        if not done.wait(limit):
            with self._guard:
                if not done.is_set():
                    self._downloading[pack_id] = started
        if not done.is_set():
            raise StoreError(self.inner.url, f"pack {pack_id[:12]} ({size} bytes) came too slowly to fill the node "
                                             f"cache within {limit:.0f} s; reading it from the store")  # fmt: skip
        if "error" in box:
            raise box["error"]
        return box["written"]

    def _download(self, key: str, pack_id: str, size: int, dst: BinaryIO) -> tuple[int, int, int]:
        """The whole pack from the store into `dst`, hashed on the way: the rename waits for the match.
        Returns the identity (dev, inode, size) of the file written."""
        digest = hashlib.sha256()

        def open_at(offset: int, length: int):
            return GuardedReader(self.inner.open_range(key, offset, length), self.inner.url, key)

        got = 0
        with Resumable(open_at(0, size), open_at, 0, size, name=key) as src:
            while got < size and (chunk := src.read(min(_CHUNK, size - got))):
                digest.update(chunk)
                dst.write(chunk)
                got += len(chunk)
        if got != size or digest.hexdigest() != pack_id:
            raise IntegrityError("pack", pack_id, f"from {self.inner.url} does not hash to its id")
        st = os.fstat(dst.fileno())
        return st.st_dev, st.st_ino, size

    # ---- the size cap ----------------------------------------------------------------------------

    def _make_room(self, need: int, deadline: float | None, *, own: str | None = None) -> None:
        """Evict least recently used packs until `need` more bytes fit under the cap; skipped when
        another process holds .evict.lock past `deadline` (0.0: one try, as a fill makes it). `own`:
        the pack whose exclusive lock the caller holds (a fill): its stale temp files go too."""
        try:
            evicting = nodedir.lock(self.directory / ".evict.lock", filelock.EXCLUSIVE, deadline)
        except OSError as exc:  # a file we may not even read: it only keeps evictions apart, each victim has its lock
            self._warn_first(("evict-lock",), "node cache: cannot lock %s (%s); evicting without it",
                             self.directory / ".evict.lock", exc.strerror or exc)  # fmt: skip
            evicting = contextlib.nullcontext()
        if evicting is None:
            return  # someone else is evicting; our fill may overshoot the cap by one pack
        with evicting:
            files = self._cached_files(clean=True, own=own)
            total = sum(f.size for f in files)
            for f in sorted(files, key=lambda f: f.used):
                if total + need <= self.max_bytes:
                    break
                if f.pack in self._kept:
                    continue
                try:
                    removed = self._remove(f.pack, 0.0)
                except OSError as exc:  # one pack we cannot remove must not keep every fill off the node
                    self._warn_first(("evict", f.pack), "node cache: cannot evict pack %s: %s", f.pack[:12],
                                     exc.strerror or exc)  # fmt: skip
                    continue
                if removed:
                    log.info("node cache: evicted pack %s (%d bytes, least recently used)", f.pack[:12], f.size)
                    total -= f.size

    def _remove(self, pack_id: str, deadline: float | None) -> bool:
        """Delete a cached pack and its lock file; False when someone holds its lock (in use)."""
        lock_path = self._lock_path(pack_id)
        if not all(nodedir.is_directory(d) for d in (self.directory / "packs", lock_path.parent)):
            return True  # nothing of ours: a link there names someone else's directory
        lock = nodedir.lock(lock_path, filelock.EXCLUSIVE, deadline)
        if lock is None:
            return False
        with lock:
            if (st := nodedir.lstat(self._path(pack_id))) is not None:
                self._verified.discard((st.st_dev, st.st_ino, st.st_size))  # the inode may be reused
            nodedir.clear(self._path(pack_id))
            nodedir.clear(lock_path)  # the lock file last, while we still hold it
        return True

    def _cached_files(self, *, clean: bool = False, own: str | None = None) -> list[_Cached]:
        """Every cached pack: a regular file packs/<hh>/<id>, where eviction looks for it. Nothing
        deeper is counted (no eviction would ever remove it), nothing through a link, and what
        cannot be listed or stat-ed is skipped. With `clean`, temp files of fills no process is
        running are removed; those of `own`, whose lock the caller holds, whatever process left them."""
        found = []
        if not nodedir.is_directory(self.directory / "packs"):
            return found  # absent, or a link to a directory that is not ours to count or empty
        for shard in nodedir.entries(self.directory / "packs"):
            if not _SHARD.match(shard.name) or not shard.is_dir(follow_symlinks=False):
                continue
            for entry in nodedir.entries(Path(shard.path)):
                if clean and (temp := _TEMP.match(entry.name)) and temp.group(1).startswith(shard.name):
                    self._remove_stale_temp(Path(entry.path), temp.group(1), held=temp.group(1) == own)
                if _pack_id(f"packs/{shard.name}/{entry.name}") is None:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone meanwhile, or not ours to look at
                if stat.S_ISREG(st.st_mode):  # anything else a reader replaces; no pack to count or evict
                    found.append(_Cached(entry.name, st.st_size, st.st_mtime_ns))
        return found

    def _remove_stale_temp(self, temp: Path, pack_id: str, *, held: bool = False) -> None:
        """Remove a fill's temp file if no fill of its pack runs. `held`: the caller holds the pack's lock
        (its own fill): a try at the lock would fail, and a pod killed while it filled the one pack had
        left that pack's temp files to fill the disk for every later fill of it."""
        try:
            if held:
                temp.unlink(missing_ok=True)
                return
            lock = nodedir.lock(self._lock_path(pack_id), filelock.EXCLUSIVE, 0.0)
            if lock is None:
                return  # a fill is writing it
            with lock:
                temp.unlink(missing_ok=True)
        except OSError as exc:  # junk we cannot remove costs disk, not the node cache
            log.debug("node cache: cannot remove %s: %s", temp, exc)

    def _warn_bad(self, pack_id: str, st: os.stat_result | None, message: str, *args) -> None:
        """Warn that the copy at a pack's path is bad, once per copy: a reader's look and the fill's
        second look under the exclusive lock (and every later read while the store cannot replace
        it) find the same file. A copy put there since (another inode, size or mtime) is news."""
        copy = (pack_id,) if st is None else (pack_id, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        self._warn_first(("bad", *copy), message, *args)

    def _warn_first(self, what: tuple, message: str, *args) -> None:
        """Warn about `what` the first time; after that at debug level. Every fill makes room twice and
        a restore fills many packs: a lock or a pack eviction cannot use is one thing to tell, not one
        per fill."""
        with self._guard:
            first = what not in self._said
            self._said.add(what)
        log.log(logging.WARNING if first else logging.DEBUG, message, *args)

    def _warn_once(self, pack_id: str, exc: BaseException) -> None:
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        log.log(level, "node cache %s not used for pack %s (%s); reading the store", self.directory, pack_id[:12], exc)


@dataclass(frozen=True)
class _Cached:
    pack: str
    size: int
    used: int  # mtime in ns: the last read


class _Opened:
    """A cached pack open for reading, verified against its id; `identity`: (dev, inode, size) hashed."""

    def __init__(self, f: BinaryIO, identity: tuple[int, int, int]):
        self.file, self.identity = f, identity


class _Held:
    """An open cached pack and its shared lock: closing it lets the pack be evicted or replaced."""

    def __init__(self, f: BinaryIO, lock: filelock.FileLock, identity: tuple[int, int, int]):
        self._f, self._lock, self.identity = f, lock, identity

    def seek(self, offset: int) -> None:
        self._f.seek(offset)

    def read(self, n: int = -1) -> bytes:
        return self._f.read(n)

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()
        self._lock.release()

    def __enter__(self) -> _Held:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Served:
    """A range of a cached pack, as a reader reads it. The file was hashed, but a peer can still
    truncate it, or the disk fail to read it: a read error, or an end before the size that was hashed,
    is the node cache's (`NodeCacheStore._failed`), and the reader resumes from the store. Bytes
    changed in place pass here; the reader's per-blob SHA-256 catches those (kcache.restore)."""

    def __init__(self, cache: NodeCacheStore, held: _Held, pack_id: str, key: str, offset: int):
        self._cache, self._held, self._pack, self._key, self._at = cache, held, pack_id, key, offset

    def read(self, n: int = -1) -> bytes:
        try:
            data = self._held.read(n)
        except OSError as exc:
            raise self._cache._failed(self._pack, f"cannot read {self._key}: {exc.strerror or exc}") from None
        if not data and n != 0 and self._at < self._held.identity[2]:
            raise self._cache._failed(self._pack, f"{self._key} ends at byte {self._at}, short of the "
                                                  f"{self._held.identity[2]} that were hashed")  # fmt: skip
        self._at += len(data)
        return data

    def close(self) -> None:
        self._held.close()

    def __enter__(self) -> _Served:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _pack_id(key: str) -> str | None:
    match = _PACK_KEY.match(key)
    return match.group(2) if match and match.group(2).startswith(match.group(1)) else None
