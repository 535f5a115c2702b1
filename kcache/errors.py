"""Exceptions kcache raises. Each carries fields; the CLI turns them into one-line messages.

The library never prints or exits: callers catch these types. `cli/errors.py` holds the one
table that maps each type to a message, a hint and an exit code.
"""

from __future__ import annotations


class KcacheError(Exception):
    """Base of every error kcache raises on purpose."""


class ConfigError(KcacheError):
    """A URL, flag or environment value that kcache cannot use."""

    def __init__(self, what: str, value: str, why: str):
        self.what, self.value, self.why = what, value, why
        super().__init__(f"{what} {value!r}: {why}")


class StoreError(KcacheError):
    """The store could not be read or written."""

    def __init__(self, url: str, why: str):
        self.url, self.why = url, why
        super().__init__(f"store {url}: {why}")


class ObjectMissing(StoreError):
    """An object the index or a manifest names is not in the store."""

    def __init__(self, url: str, key: str):
        self.key = key
        super().__init__(url, f"object {key} is missing")


class IndexDbError(KcacheError):
    """The SQL index could not be opened, upgraded or queried."""

    def __init__(self, url: str, why: str):
        self.url, self.why = url, why
        super().__init__(f"index {url}: {why}")


class IntegrityError(KcacheError):
    """Bytes read back do not hash to the id they were stored under, or do not parse."""

    def __init__(self, what: str, expected: str, why: str):
        self.what, self.expected, self.why = what, expected, why
        super().__init__(f"{what} {expected}: {why}")


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
