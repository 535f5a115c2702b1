"""A local cache of file hashes, so re-publishing an unchanged cache does not re-read it.

    $KCACHE_HOME/hashcache.db   SQLite (stdlib): stat key -> SHA-256

The stat key is xxh3 over (absolute path, size, mtime_ns, ctime_ns, inode): any write to the file
changes ctime, so an entry can only be reused for the very file it was computed from. New blobs
are hashed again while they are packed, so a stale entry could never put wrong bytes under an id.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path

import xxhash

_CHUNK = 500


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
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, timeout=30, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS hashes (key TEXT PRIMARY KEY, sha256 TEXT NOT NULL)")

    def lookup(self, keys: Iterable[str]) -> dict[str, str]:
        wanted = sorted(set(keys))
        found: dict[str, str] = {}
        for i in range(0, len(wanted), _CHUNK):
            chunk = wanted[i : i + _CHUNK]
            marks = ",".join("?" * len(chunk))
            found.update(self._db.execute(f"SELECT key, sha256 FROM hashes WHERE key IN ({marks})", chunk))
        return found

    def remember(self, pairs: Iterable[tuple[str, str]]) -> None:
        with self._db:
            self._db.executemany("INSERT OR REPLACE INTO hashes (key, sha256) VALUES (?, ?)", list(pairs))

    def close(self) -> None:
        self._db.close()
