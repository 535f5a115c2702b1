"""Store backends by URL scheme. `open_store(url)` is the only way the rest of kcache gets one."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from kcache.errors import ConfigError
from kcache.store.base import Store, manifest_key, pack_key, ref_key

__all__ = ["Store", "open_store", "pack_key", "manifest_key", "ref_key"]


def open_store(url: str, *, endpoint_url: str | None = None, jobs: int = 16, create: bool = True,
               endpoint_configured: bool = False) -> Store:  # fmt: skip
    """Open `file://PATH` or `s3://bucket/prefix`. A bare path means file://.

    `endpoint_configured`: `endpoint_url` came from the environment (AWS_ENDPOINT_URL*), not a flag:
    the AWS config's ignore_configured_endpoint_urls then leaves it unused (kcache.store.s3).

    `create`: a file:// PATH that does not exist is created by the first write (a publisher's
    store). A reader passes create=False: then such a PATH is a StoreError, as a bucket that does
    not exist is (the CLI decides which commands may create one: cli.options.open_configured_store).
    """
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        path = parsed.path if parsed.scheme else url
        if parsed.netloc:
            raise ConfigError("store URL", url, "use file:///absolute/path (three slashes)")
        if not path:
            raise ConfigError("store URL", url, "has no path")
        from kcache.store.local import LocalStore

        return LocalStore(Path(path).expanduser(), create=create)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigError("store URL", url, "has no bucket (expected s3://bucket/prefix)")
        if "@" in parsed.netloc:  # boto3 would quote the "bucket" (the keys) in its error
            raise ConfigError("store URL", url, "keys do not belong in it; use AWS_ACCESS_KEY_ID or a profile")
        from kcache.store.s3 import S3Store

        return S3Store(parsed.netloc, parsed.path.strip("/"), endpoint_url=endpoint_url, jobs=jobs,
                       endpoint_configured=endpoint_configured)  # fmt: skip
    raise ConfigError("store URL", url, f"unknown scheme {parsed.scheme!r}; use file:// or s3://")
