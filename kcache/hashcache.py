"""A local cache of file hashes, so re-publishing an unchanged cache does not re-read it.

    $KCACHE_HOME/hashcache.db   SQLite (stdlib)
        hashes (key, sha256)    stat key -> SHA-256 of the file's content (its blob id)
        chunks (key, digests)   stat key -> SHA-256 of each CHUNK_BYTES of it, space-separated:
                                only files of packs.DIGESTED_BYTES or more, whose manifest
                                entries carry them (a cache from before them lacks the table)

The stat key is xxh3 over (absolute path, size, mtime_ns, ctime_ns, inode): any write to the file
changes ctime, so an entry can only be reused for the very file it was computed from. New blobs
are hashed again while they are packed, so a stale entry could never put wrong bytes under an id.
A large file's id is used only together with its chunk digests, taken in the same read: one
without them (written by a kcache before them) is hashed again.

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
import re
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import xxhash

from kcache.packs import Hashed

log = logging.getLogger(__name__)

_CHUNK = 500
# How much older than the moment hashing started a file's mtime and ctime must be for its entry to
# be kept: timestamps truncated to ticks of up to 2 s (FAT's mtime) still land a later write in a
# later tick, with room for the kernel's coarse clock lagging time.time_ns().
RACY_NS = 2 * 10**9
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


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

    def lookup(self, files: Mapping[str, int]) -> dict[str, Hashed]:
        """What each file (stat key -> its size) hashed to, for those with an entry that is complete:
        one for a file of DIGESTED_BYTES or more without its chunk digests is left out, and the
        file is hashed again."""
        wanted = sorted(files)

        def read() -> dict[str, Hashed]:
            found: dict[str, Hashed] = {}
            for i in range(0, len(wanted), _CHUNK):
                for key, sha256, digests in self._rows(wanted[i : i + _CHUNK]):
                    hashed = Hashed(sha256, files[key], _digests(digests))
                    if hashed.complete:
                        found[key] = hashed
            return found

        return self._guard(read, {}) if self._db is not None else {}

    def _rows(self, keys: list[str]) -> list[tuple[str, str, str | None]]:
        marks = ",".join("?" * len(keys))
        return self._db.execute(
            "SELECT hashes.key, hashes.sha256, chunks.digests FROM hashes LEFT JOIN chunks ON chunks.key = hashes.key"
            f" WHERE hashes.key IN ({marks})", keys
        ).fetchall()  # fmt: skip

    def now(self) -> int:
        """Epoch nanoseconds by this cache's clock: read it before hashing, pass it to `remember`."""
        return self._clock()

    def remember(self, entries: Iterable[tuple[str, Hashed, int]], hashing_started: int) -> None:
        """Keep (key, hashed, changed_ns) for files hashed after `hashing_started` (from `now`);
        changed_ns is the later of the file's mtime and ctime in its stat key. A file changed too
        close to that moment, or after it, is not kept (the module docstring says why)."""
        rows = [(key, hashed) for key, hashed, changed in entries if changed < hashing_started - RACY_NS]
        if not rows:
            return

        def write() -> None:
            with self._db:
                self._db.executemany("INSERT OR REPLACE INTO hashes (key, sha256) VALUES (?, ?)",
                                     [(key, h.blob) for key, h in rows])  # fmt: skip
                # Digests kept under another kcache's DIGESTED_BYTES would leave the entry incomplete for good.
                self._db.executemany("DELETE FROM chunks WHERE key = ?", [(key,) for key, h in rows if not h.chunks])
                self._db.executemany("INSERT OR REPLACE INTO chunks (key, digests) VALUES (?, ?)",
                                     [(key, " ".join(h.chunks)) for key, h in rows if h.chunks])  # fmt: skip

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
        db.execute("CREATE TABLE IF NOT EXISTS chunks (key TEXT PRIMARY KEY, digests TEXT NOT NULL)")
    except BaseException:
        db.close()
        raise
    return db


def _digests(text: str | None) -> tuple[str, ...]:
    """A row's chunk digests; none when any is not a SHA-256 (a damaged row): its file is hashed again,
    where a digest that cannot parse would make the whole manifest unreadable."""
    digests = tuple((text or "").split())
    return digests if all(_HEX64.match(d) for d in digests) else ()
