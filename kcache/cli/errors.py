"""The one table that turns every exception into a message, a hint and an exit code.

Every command runs inside one boundary (`cli.options.KcacheGroup`): an error kcache raised on
purpose is looked up here; anything else is a bug in kcache (exit 70). The messages pass through
`config.redact_text`, so a URL's password never reaches a terminal, a log or a JSON reason.
"""

from __future__ import annotations

import importlib
import sys
from enum import IntEnum

from kcache.config import redact_text


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
    FACTS_DISAGREE = 15  # restore --strict: the facts file (or a --fact) contradicts what the init container sees
    CHANGED = 16  # publish: a cache file changed while it was read; nothing stored is wrong
    BUG = 70
    INTERRUPTED = 130
    BROKEN_PIPE = 141  # stdout closed before the output was written (`kcache ls | head`), as shells report SIGPIPE
    TERMINATED = 143  # SIGTERM during restore, warmup or prebake, after kcache.env and the markers are written


BUG_HINT = "this is a bug in kcache; run with KCACHE_DEBUG=1 for a traceback and report it"

# Most specific first: the first matching type wins. Rows name their class by module, so that the
# table costs no imports: an exception can only be an instance of a class whose module is loaded
# (`kcache restore` does not pay for warmup's or the proxy's modules to describe its errors).
# tests/cli/test_errors.py checks that every exception class kcache defines has a row of its own.
_E = "kcache.errors"
ROWS: tuple[tuple[str, str, ExitCode, str], ...] = (
    (
        "kcache.profiles",
        "ProfileError",
        ExitCode.USAGE,
        "fix the profiles file where shown; `kcache warmup --help` has the format",
    ),
    (_E, "StoreMismatch", ExitCode.USAGE, "give each store its own index (--index), or restore with --index none"),
    (_E, "ConfigError", ExitCode.USAGE, "check the flag or environment variable named above (see `kcache config`)"),
    (
        "kcache.yank",
        "BundleGone",
        ExitCode.NOT_FOUND,
        "gc deleted it: publish the same files again (they come back yanked), then undo; or the index is "
        "behind the publishers' (`kcache reindex`)",
    ),
    (_E, "NotFound", ExitCode.NOT_FOUND, "`kcache ls` lists the bundles the index knows"),
    (_E, "ObjectMissing", ExitCode.STORE, "the store lost an object the index names; re-publish the bundle"),
    (_E, "StoreError", ExitCode.STORE, "check the store URL, that it exists and that you may read and write it"),
    (_E, "NewestChanged", ExitCode.INDEX,
     "other publishes of the key kept committing first for a minute; run it again (none committed)"),  # fmt: skip
    (_E, "IndexConflict", ExitCode.INDEX, "other writers held the same rows; run it again (nothing was committed)"),
    (_E, "IndexDbError", ExitCode.INDEX, "check --index / KCACHE_INDEX; PostgreSQL needs `kcache db upgrade`"),
    (_E, "UnsafePath", ExitCode.CORRUPT, "the bundle is hostile or corrupt; re-publish it from a clean cache"),
    (_E, "ManifestTooLarge", ExitCode.CORRUPT, "a manifest this big needs KCACHE_MAX_MANIFEST_BYTES raised"),
    (
        _E,
        "ObjectTooLarge",
        ExitCode.CORRUPT,
        "no object kcache writes of this kind is that big: replace it (publish again; `kcache refresh` rewrites a ref)",
    ),
    (
        _E,
        "FileChanged",
        ExitCode.CHANGED,
        "a cache file changed while it was published (a compile still running?); publish again",
    ),
    (
        _E,
        "StagingError",
        ExitCode.USAGE,
        "free space there, or set TMPDIR to a writable directory with room for the packs",
    ),
    (_E, "IntegrityError", ExitCode.CORRUPT, "the stored data is corrupt; re-publish the bundle from a good cache"),
    (_E, "SignatureError", ExitCode.SIGNATURE, "sign with `publish --signing-key`; trust the .pub with --trusted-key"),
    (
        _E,
        "SourceDirError",
        ExitCode.ROOT,
        "give --from and each --extra-dir NAME=PATH a directory that exists (--from: a root restore laid out)",
    ),
    (_E, "RootFull", ExitCode.ROOT, "give the volume more room (or raise its quota or ulimit -f); the pod starts cold"),
    (
        _E,
        "NodeCacheFull",
        ExitCode.ROOT,
        "raise --max-bytes (KCACHE_NODE_CACHE_MAX_BYTES) to hold every target's packs, or prefetch fewer targets",
    ),
    (_E, "RootError", ExitCode.ROOT,
     "pass --into, --root or --node-cache a directory kcache may create and own"),  # fmt: skip
    (_E, "RootBusy", ExitCode.TIMEOUT, "run one restore per root at a time; the one that holds it writes kcache.env"),
    (_E, "RestoreTimeout", ExitCode.TIMEOUT, "raise --timeout, or check the store's bandwidth"),
    (_E, "LookupTimeout", ExitCode.TIMEOUT,
     "check that the store and the index answer at their usual speed, or raise --lookup-timeout"),  # fmt: skip
    ("kcache.boundedread", "NotRegularFile", ExitCode.USAGE, "give a regular file (not a FIFO, device or directory)"),
    (
        "kcache.boundedread",
        "FileTooLarge",
        ExitCode.USAGE,
        "the file is larger than kcache reads for this purpose; check it is the right one",
    ),
    (
        "kcache.http_client",
        "RequestFailed",
        ExitCode.WARMUP,
        "the server gave no usable answer; see the message, or raise --request-timeout",
    ),
    (
        "kcache.warmup",
        "ServerUnavailable",
        ExitCode.WARMUP,
        "check that the server at --url starts, or raise --wait-timeout",
    ),
    (
        "kcache.warmup",
        "WarmupRequestError",
        ExitCode.WARMUP,
        "the server answered the warmup request with an error; see its log",
    ),
    (
        "kcache.prebake",
        "WarmupChildFailed",
        ExitCode.WARMUP,
        "fix the --entrypoint error printed above (try `kcache warmup` alone)",
    ),
    (
        "kcache.prebake",
        "WarmupChildTimedOut",
        ExitCode.WARMUP,
        "find where the --entrypoint hangs (try `kcache warmup` alone), or raise --budget",
    ),
    (
        "kcache.relocate",
        "Unmappable",
        ExitCode.CORRUPT,
        "a cache file names paths the bundle does not restore; re-publish it",
    ),
    (
        "kcache.ninjabuild",
        "Unrelocatable",
        ExitCode.CORRUPT,
        "a ninja build folder is not one restore can move; ninja rebuilds it, or serve from the ROOT it was built in",
    ),
    (_E, "BadEntry", ExitCode.CORRUPT, "a cached answer in Redis is damaged; the proxy overwrites it"),
    (_E, "CacheUnavailable", ExitCode.STORE, "check --redis; meanwhile the proxy passes requests to the engine"),
    (_E, "Terminated", ExitCode.TERMINATED, "the pod is being stopped; the next start restores again"),
    (
        "kcache.store.s3",
        "AnswerTooLarge",
        ExitCode.STORE,
        "the endpoint answered with far more than S3 sends; check --s3-endpoint-url",
    ),  # the store makes it a StoreError; a row in case one escapes
    ("kcache.index.repo", "BadRow", ExitCode.INDEX, "repair or delete the row it names (reindex rebuilds rows)"),
    (
        "kcache.fetch",
        "Cancelled",
        ExitCode.BUG,
        BUG_HINT,
    ),  # internal to fetch (a worker stopped early): never meant to escape
    (_E, "KcacheError", ExitCode.ERROR, "run with KCACHE_DEBUG=1 for a traceback"),
)


def _loaded(module: str, name: str) -> type[Exception] | None:
    loaded = sys.modules.get(module)
    return getattr(loaded, name) if loaded is not None else None


def __getattr__(name: str):
    """TABLE: every row with its class imported (for tests and tools that want the classes)."""
    if name == "TABLE":
        return tuple((getattr(importlib.import_module(m), n), code, hint) for m, n, code, hint in ROWS)
    raise AttributeError(name)


def row(exc: BaseException) -> tuple[type[Exception], ExitCode, str] | None:
    """The table's row for `exc`, or None when kcache did not expect it."""
    for module, name, code, hint in ROWS:
        kind = _loaded(module, name)
        if kind is not None and isinstance(exc, kind):
            return kind, code, hint
    return None


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
    ExitCode.FACTS_DISAGREE: "restore --strict: the facts file (or a --fact) contradicts what this machine shows",
    ExitCode.CHANGED: "publish: a cache file changed while it was read (publish again)",
    ExitCode.BUG: "an unexpected error: a bug in kcache, please report it",
    ExitCode.INTERRUPTED: "interrupted (Ctrl-C), as shells report SIGINT",
    ExitCode.BROKEN_PIPE: "the reader of the output closed it first (as head does), as shells report SIGPIPE",
    ExitCode.TERMINATED: "restore, warmup or prebake stopped by SIGTERM (kcache.env and the markers are written, "
                         "the warmup process killed, first)",
}
