"""A local cache of file hashes, so re-publishing an unchanged cache does not re-read it.

    $KCACHE_HOME/hashcache.db   SQLite (stdlib): stat key -> SHA-256

The stat key is xxh3 over (absolute path, size, mtime_ns, ctime_ns, inode): any write to the file
changes ctime, so an entry can only be reused for the very file it was computed from. New blobs
are hashed again while they are packed, so a stale entry could never put wrong bytes under an id.

"Any write changes ctime" holds only across timestamp ticks: where they tick once a second (ext2,
FAT, NFS servers, kernels before 6.13 for ctime), a same-size rewrite in the tick the file was
hashed leaves its key as it was, and the entry would serve the old digest (git's "racy clean").
So, as git does, no entry is kept for a file changed less than RACY_NS before hashing started
(or dated after it): a rewrite after that moment lands in a later tick. Such a file is simply
hashed again next time.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

_CHUNK = 500
# How much older than the moment hashing started a file's mtime and ctime must be for its entry to
# be kept: timestamps truncated to ticks of up to 2 s (FAT's mtime) still land a later write in a
# later tick, with room for the kernel's coarse clock lagging time.time_ns().
RACY_NS = 2 * 10**9


def stat_key(path: Path) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return key_for(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def key_for(path: Path, size: int, mtime_ns: int, ctime_ns: int, ino: int) -> str:
    text = f"{os.path.abspath(path)}\0{size}\0{mtime_ns}\0{ctime_ns}\0{ino}"
    return xxhash.xxh3_128_hexdigest(text.encode("utf-8", "surrogateescape"))


class HashCache:
    """Best effort: a cache that cannot be opened or read costs a re-hash, never a publish.

    `clock` (epoch nanoseconds) says when hashing starts (`now`); tests move it.
    """

    def __init__(self, path: Path, *, clock: Callable[[], int] = time.time_ns):
        self._path = path
        self._clock = clock
        self._db: sqlite3.Connection | None = None
        try:
            self._db = _open(path)
        except sqlite3.DatabaseError as exc:  # not a database (cut short, overwritten): it is only a cache
            log.warning("hash cache %s is unreadable (%s); starting a new one", path, exc)
            self._db = self._guard(lambda: _open(path, fresh=True), None)
        except (sqlite3.Error, OSError) as exc:
            self._disable(exc)

    def lookup(self, keys: Iterable[str]) -> dict[str, str]:
        wanted = sorted(set(keys))

        def read() -> dict[str, str]:
            found: dict[str, str] = {}
            for i in range(0, len(wanted), _CHUNK):
                chunk = wanted[i : i + _CHUNK]
                marks = ",".join("?" * len(chunk))
                found.update(self._db.execute(f"SELECT key, sha256 FROM hashes WHERE key IN ({marks})", chunk))
            return found

        return self._guard(read, {}) if self._db is not None else {}

    def now(self) -> int:
        """Epoch nanoseconds by this cache's clock: read it before hashing, pass it to `remember`."""
        return self._clock()

    def remember(self, entries: Iterable[tuple[str, str, int]], hashing_started: int) -> None:
        """Keep (key, sha256, changed_ns) for files hashed after `hashing_started` (from `now`);
        changed_ns is the later of the file's mtime and ctime in its stat key. A file changed too
        close to that moment, or after it, is not kept (the module docstring says why)."""
        rows = [(key, digest) for key, digest, changed in entries if changed < hashing_started - RACY_NS]
        if not rows:
            return

        def write() -> None:
            with self._db:
                self._db.executemany("INSERT OR REPLACE INTO hashes (key, sha256) VALUES (?, ?)", rows)

        if self._db is not None:
            self._guard(write, None)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()

    def _guard(self, work, fallback):
        try:
            return work()
        except (sqlite3.Error, OSError) as exc:  # locked for too long, disk full, read-only
            self._disable(exc)
            return fallback

    def _disable(self, exc: Exception) -> None:
        log.warning("publishing without a hash cache (%s: %s): every file is read again", self._path, exc)
        if self._db is not None:
            self._db.close()
        self._db = None


def _open(path: Path, fresh: bool = False) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    if fresh:
        for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
            stale.unlink(missing_ok=True)
    db = sqlite3.connect(path, timeout=30, check_same_thread=False)
    try:
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE IF NOT EXISTS hashes (key TEXT PRIMARY KEY, sha256 TEXT NOT NULL)")
    except BaseException:
        db.close()
        raise
    return db
