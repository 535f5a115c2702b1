"""The one table that turns every exception into a message, a hint and an exit code.

Every command runs inside one boundary (`cli.options.KcacheGroup`): an error kcache raised on
purpose is looked up here; anything else is a bug in kcache (exit 70). The messages pass through
`config.redact_text`, so a URL's password never reaches a terminal, a log or a JSON reason.
"""

from __future__ import annotations

from enum import IntEnum

from kcache import errors
from kcache.boundedread import FileTooLarge, NotRegularFile
from kcache.config import redact_text
from kcache.fetch import Cancelled
from kcache.http_client import RequestFailed
from kcache.prebake import WarmupChildFailed
from kcache.profiles import ProfileError
from kcache.relocate import Unmappable
from kcache.warmup import ServerUnavailable, WarmupRequestError


class ExitCode(IntEnum):
    """What `kcache` exits with; EXIT_MEANINGS says what each means (README.md and `kcache --help` show it)."""

    OK = 0
    ERROR = 1
    USAGE = 2
    NOT_FOUND = 3
    STORE = 4
    INDEX = 5
    CORRUPT = 6
    ROOT = 7
    TIMEOUT = 8
    SIGNATURE = 9
    MISS = 10
    NOT_READY = 11
    PROBLEMS = 12
    WARMUP = 13
    PUBLISH = 14
    FACTS_DISAGREE = 15  # restore --strict: the facts file contradicts what the init container sees
    BUG = 70
    INTERRUPTED = 130


BUG_HINT = "this is a bug in kcache; run with KCACHE_DEBUG=1 for a traceback and report it"

# Most specific first: the first matching type wins. tests/cli/test_errors.py checks that every
# exception class kcache defines has a row of its own.
TABLE: tuple[tuple[type[Exception], ExitCode, str], ...] = (
    (ProfileError, ExitCode.USAGE, "fix the profiles file where shown; `kcache warmup --help` has the format"),
    (errors.StoreMismatch, ExitCode.USAGE, "give each store its own index (--index), or restore with --index none"),
    (errors.ConfigError, ExitCode.USAGE, "check the flag or environment variable named above (see `kcache config`)"),
    (errors.NotFound, ExitCode.NOT_FOUND, "`kcache ls` lists the bundles the index knows"),
    (errors.ObjectMissing, ExitCode.STORE, "the store lost an object the index names; re-publish the bundle"),
    (errors.StoreError, ExitCode.STORE, "check the store URL, that it exists and that you may read and write it"),
    (errors.IndexConflict, ExitCode.INDEX, "other writers held the same rows; run it again (nothing was committed)"),
    (errors.IndexDbError, ExitCode.INDEX, "check --index / KCACHE_INDEX; PostgreSQL needs `kcache db upgrade`"),
    (errors.UnsafePath, ExitCode.CORRUPT, "the bundle is hostile or corrupt; re-publish it from a clean cache"),
    (errors.ObjectTooLarge, ExitCode.CORRUPT, "a manifest this big needs KCACHE_MAX_MANIFEST_BYTES raised"),
    (errors.IntegrityError, ExitCode.CORRUPT, "the stored data is corrupt; re-publish the bundle from a good cache"),
    (errors.SignatureError, ExitCode.SIGNATURE, "sign with `publish --signing-key`; trust the .pub with --trusted-key"),
    (errors.RootError, ExitCode.ROOT, "pass --into a directory kcache may create and own"),
    (errors.RootBusy, ExitCode.TIMEOUT, "run one restore per root at a time; the one that holds it writes kcache.env"),
    (errors.RestoreTimeout, ExitCode.TIMEOUT, "raise --timeout, or check the store's bandwidth"),
    (NotRegularFile, ExitCode.USAGE, "give a regular file (not a FIFO, device or directory)"),
    (FileTooLarge, ExitCode.USAGE, "the file is larger than kcache reads for this purpose; check it is the right one"),
    (RequestFailed, ExitCode.WARMUP, "the server gave no usable answer; see the message, or raise --request-timeout"),
    (ServerUnavailable, ExitCode.WARMUP, "check that the server at --url starts, or raise --wait-timeout"),
    (WarmupRequestError, ExitCode.WARMUP, "the server answered the warmup request with an error; see its log"),
    (WarmupChildFailed, ExitCode.WARMUP, "fix the --entrypoint error printed above (try `kcache warmup` alone)"),
    (Unmappable, ExitCode.CORRUPT, "a cache file names paths the bundle does not restore; re-publish it"),
    (errors.BadEntry, ExitCode.CORRUPT, "a cached answer in Redis is damaged; the proxy overwrites it"),
    (errors.CacheUnavailable, ExitCode.STORE, "check --redis; meanwhile the proxy passes requests to the engine"),
    (Cancelled, ExitCode.BUG, BUG_HINT),  # internal to fetch (a worker stopped early): never meant to escape
    (errors.KcacheError, ExitCode.ERROR, "run with KCACHE_DEBUG=1 for a traceback"),
)


def row(exc: BaseException) -> tuple[type[Exception], ExitCode, str] | None:
    """The table's row for `exc`, or None when kcache did not expect it."""
    return next((r for r in TABLE if isinstance(exc, r[0])), None)


def describe(exc: BaseException) -> tuple[str, str, int]:
    """(message, hint, exit code) for any exception; secrets in the message are redacted."""
    found = row(exc)
    if found is None:
        return redact_text(f"{type(exc).__name__}: {exc}"), BUG_HINT, ExitCode.BUG
    return redact_text(str(exc)), found[2], found[1]


def epilog() -> str:
    """The exit-code table for `kcache --help`."""
    lines = ["\b", "Exit codes:"]
    lines += [f"  {code.value:>3}  {EXIT_MEANINGS[code]}" for code in ExitCode]
    return "\n".join(lines)


EXIT_MEANINGS = {
    ExitCode.OK: "done (a restore that starts cold is done too, unless --strict)",
    ExitCode.ERROR: "a kcache error without a code of its own",
    ExitCode.USAGE: "a flag, environment value or file kcache cannot use",
    ExitCode.NOT_FOUND: "the bundle or fact named does not exist",
    ExitCode.STORE: "the store cannot be read or written, or lost an object",
    ExitCode.INDEX: "the SQL index cannot be opened, upgraded or queried",
    ExitCode.CORRUPT: "stored data does not verify or names unsafe paths",
    ExitCode.ROOT: "the restore root or a cache directory cannot be used",
    ExitCode.TIMEOUT: "restore ran past --timeout (with --strict)",
    ExitCode.SIGNATURE: "unsigned, or signed by no trusted key",
    ExitCode.MISS: "restore --strict found no bundle for this fingerprint",
    ExitCode.NOT_READY: "kcache ready: the pod may not take traffic yet",
    ExitCode.PROBLEMS: "verify or reindex found problems",
    ExitCode.WARMUP: "warmup failed (prebake then publishes nothing)",
    ExitCode.PUBLISH: "watch could not publish the new cache files",
    ExitCode.FACTS_DISAGREE: "restore --strict: the facts file contradicts what this machine shows",
    ExitCode.BUG: "an unexpected error: a bug in kcache, please report it",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C), as shells report SIGINT",
}
