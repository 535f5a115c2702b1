"""The one table that turns kcache's exceptions into a message, a hint and an exit code."""

from __future__ import annotations

from kcache import errors
from kcache.profiles import ProfileError

# Most specific first: the first matching type wins.
TABLE: tuple[tuple[type[Exception], int, str], ...] = (
    (ProfileError, 2, "fix the profiles file where the message points; `kcache warmup --help` shows the format"),
    (errors.ConfigError, 2, "check the flag or environment variable named above (see --help)"),
    (errors.NotFound, 3, "`kcache ls` lists the bundles the index knows"),
    (errors.ObjectMissing, 4, "the store lost an object the index names; re-publish the bundle"),
    (errors.StoreError, 4, "check the store URL, that it exists and that you may read and write it"),
    (errors.IndexDbError, 5, "check --index / KCACHE_INDEX; a new PostgreSQL index needs `kcache db upgrade`"),
    (errors.UnsafePath, 6, "the bundle is hostile or corrupt; do not restore it (re-publish from a clean cache)"),
    (errors.IntegrityError, 6, "the stored data is corrupt; re-publish the bundle from a good cache"),
    (errors.SignatureError, 9, "sign with `kcache publish --signing-key`; trust the .pub with --trusted-key"),
    (errors.RootError, 7, "pass --into a directory kcache may create and own"),
    (errors.RootBusy, 8, "run one restore per root at a time; the one that holds it writes kcache.env"),
    (errors.RestoreTimeout, 8, "raise --timeout, or check the store's bandwidth"),
    (errors.KcacheError, 1, "run with KCACHE_DEBUG=1 for a traceback"),
)


def describe(exc: Exception) -> tuple[str, str, int]:
    """(message, hint, exit code) for an exception kcache raised."""
    for kind, code, hint in TABLE:
        if isinstance(exc, kind):
            return str(exc), hint, code
    return f"{type(exc).__name__}: {exc}", "this is a bug in kcache; run with KCACHE_DEBUG=1 and report it", 70
