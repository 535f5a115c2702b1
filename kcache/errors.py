"""Exceptions kcache raises. Each carries fields; the CLI turns them into one-line messages.

The library never prints or exits: callers catch these types. `cli/errors.py` holds the one
table that maps each type to a message, a hint and an exit code. Messages never carry a URL's
password: the types that quote a URL or a value redact it (the fields keep the real one).
"""

from __future__ import annotations

from kcache.config import redact_text, redact_url


class KcacheError(Exception):
    """Base of every error kcache raises on purpose."""


class ConfigError(KcacheError):
    """A URL, flag or environment value that kcache cannot use."""

    def __init__(self, what: str, value: str, why: str):
        self.what, self.value, self.why = what, value, why
        super().__init__(f"{what} {redact_text(value)!r}: {redact_text(why)}")


class StoreMismatch(ConfigError):
    """The index describes another store than the one named: its rows would lie about this one."""

    def __init__(self, index_url: str, bound_url: str, store_url: str):
        self.index_url, self.bound_url, self.store_url = index_url, bound_url, store_url
        super().__init__("index", index_url, f"describes the store {bound_url}, not {store_url}")


class StoreError(KcacheError):
    """The store could not be read or written."""

    def __init__(self, url: str, why: str):
        self.url, self.why = url, why
        super().__init__(f"store {redact_url(url)}: {redact_text(why)}")


class ObjectMissing(StoreError):
    """An object the index or a manifest names is not in the store."""

    def __init__(self, url: str, key: str):
        self.key = key
        super().__init__(url, f"object {key} is missing")


class IndexDbError(KcacheError):
    """The SQL index could not be opened, upgraded or queried."""

    def __init__(self, url: str, why: str):
        self.url, self.why = url, why
        super().__init__(f"index {redact_url(url)}: {redact_text(why)}")


class IndexConflict(IndexDbError):
    """Concurrent writers kept aborting each other (deadlock or serialization failure) past the retries."""

    def __init__(self, url: str, why: str, attempts: int):
        self.attempts = attempts
        super().__init__(url, f"{why} (gave up after {attempts} attempts)")


class NewestChanged(IndexConflict):
    """A commit made on condition that its key's newest bundle was still the one it carried from found
    another one there: nothing was committed (kcache.publish carries from that one and tries again)."""

    def __init__(self, url: str, bundle_key: str, expected: str | None, found: str | None, attempts: int = 1):
        self.bundle_key, self.expected, self.found = bundle_key, expected, found
        why = (f"the newest bundle of key {bundle_key} became {(found or 'none')[:12]} while a publish carried "
               f"{(expected or 'none')[:12]}")  # fmt: skip
        super().__init__(url, why, attempts)


class IntegrityError(KcacheError):
    """Bytes read back do not hash to the id they were stored under, or do not parse."""

    def __init__(self, what: str, expected: str, why: str):
        self.what, self.expected, self.why = what, expected, why
        super().__init__(f"{what} {expected}: {why}")


class FileChanged(KcacheError):
    """A cache file changed while publish read it (a compile still writing): nothing stored is
    wrong, and a publish run again takes the file as it is then."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why
        super().__init__(f"file {path}: {why}")


class StagingError(KcacheError):
    """Publish could not stage its packs in the temporary directory: full, read-only or not writable."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why
        super().__init__(f"cannot stage packs in the temporary directory {path} (TMPDIR): {why}")


class UnsafePath(KcacheError):
    """A manifest names a path that would land outside the restore root."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why
        super().__init__(f"unsafe path {path!r}: {why}")


class RootError(KcacheError):
    """The restore root or a source directory cannot be used."""

    def __init__(self, path: str, why: str):
        self.path, self.why = path, why
        super().__init__(f"{path}: {why}")


class RootFull(RootError):
    """The restore root is the right place, but its volume (or quota, or file size limit) ran out."""


class NodeCacheFull(RootError):
    """A prefetch target's packs do not fit under the node cache's cap beside the targets before it."""


class SourceDirError(RootError):
    """A directory publish was told to read (--from ROOT, --extra-dir NAME=PATH) is missing or no directory."""

    def __init__(self, flag: str, path: str, why: str):
        self.flag = flag
        super().__init__(path, f"({flag}) {why}")


class NotFound(KcacheError):
    """A bundle or fact the user named does not exist."""

    def __init__(self, what: str, name: str):
        self.what, self.name = what, name
        super().__init__(f"no {what} {name!r}")


class RestoreTimeout(KcacheError):
    """Restore did not finish within its time budget."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        super().__init__(f"restore did not finish within {seconds:g} s")


class LookupTimeout(KcacheError):
    """Prefetch could not choose a target's bundle (index, ref, manifest) within its time."""

    def __init__(self, target: str, seconds: float, why: str):
        self.target, self.seconds, self.why = target, seconds, why
        super().__init__(f"choosing the bundle of {target} {why}")


class RootBusy(KcacheError):
    """Another restore held the restore root for the whole time budget."""

    def __init__(self, path: str, seconds: float):
        self.path, self.seconds = path, seconds
        super().__init__(f"another restore into {path} held it for the whole {seconds:g} s budget")


class SignatureError(KcacheError):
    """A bundle is unsigned, or signed by no trusted key, where a signature is required."""

    def __init__(self, bundle_id: str, why: str):
        self.bundle_id, self.why = bundle_id, why
        super().__init__(f"bundle {bundle_id[:12]}: {why}")


class ObjectTooLarge(IntegrityError):
    """An object from the store is larger than kcache will read (a hostile or runaway writer)."""

    def __init__(self, what: str, key: str, size: int, limit: int):
        self.key, self.size, self.limit = key, size, limit
        super().__init__(what, key, f"is {size} bytes, over the {limit}-byte limit; refused unread")


class ManifestTooLarge(ObjectTooLarge):
    """A manifest over KCACHE_MAX_MANIFEST_BYTES: the one cap an operator sets (refs and signatures have
    fixed ones, which no object kcache writes comes near)."""


# The result-cache proxy's own failures: both stay inside `kcache proxy`, which answers from the
# engine instead (pass-through); they have rows in the CLI table like every other error.
class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by the restore, warmup or prebake that installed its handler:
    the kubelet stopping an init container must leave kcache.env and a marker like any other failure,
    a stopped warmup a failed marker (not a "running" one nobody rewrites), and a stopped prebake must
    kill its warmup child. As the container's PID 1, kcache gets no SIGTERM at all without a handler."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by signal {signum}")


class BadEntry(ValueError):
    """A Redis value that is not an entry the proxy wrote (damaged or planted): a miss, then overwritten."""


class CacheUnavailable(Exception):
    """Redis did not answer (in time), or refused; `kind` is timeout | error | skipped (after a recent
    failure) | refused (an error reply: a full Redis, a read-only replica; no back-off follows)."""

    def __init__(self, kind: str):
        self.kind = kind
        super().__init__(kind)
