"""Where kcache keeps things when nobody says otherwise: flag, then environment, then default.

    $KCACHE_HOME (default ~/.cache/kcache)
      store/      file:// store       (KCACHE_STORE, --store)
      index.db    SQLite index        (KCACHE_INDEX, --index)

Restore reads refs from the store instead of an index when the index is `none`, or when none was
named and the default SQLite file does not exist (a fresh pod with read access to the bucket).

Every URL kcache shows a person goes through `redact_url` first: index URLs carry database
passwords and S3 URLs can carry keys, and both end up in pod logs.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

MASK = "***"

# Environment variables per setting, first set wins. boto3 lets the service-specific
# AWS_ENDPOINT_URL_S3 override AWS_ENDPOINT_URL; kcache passes the endpoint to boto3 itself, so it
# must apply the same order or it would override what the user set for S3.
ENV = {
    "home": ("KCACHE_HOME",),
    "store": ("KCACHE_STORE",),
    "index": ("KCACHE_INDEX",),
    "endpoint": ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"),
}
DEFAULT = "default"
# The AWS SDKs' switch that leaves every configured endpoint unused (AWS_ENDPOINT_URL*, the config
# file's endpoint_url) while one named explicitly (--s3-endpoint-url) still counts. botocore applies it
# only to endpoints it reads itself, and kcache reads the variables itself, so kcache applies it too.
IGNORE_ENDPOINTS_ENV = "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS"


@dataclass(frozen=True)
class Settings:
    home: Path
    store_url: str
    index_url: str
    s3_endpoint_url: str | None
    index_explicit: bool = False  # named by flag or environment, not the default
    store_explicit: bool = False  # likewise; the default store under KCACHE_HOME is kcache's own to create
    origins: tuple[tuple[str, str], ...] = ()  # (setting, "flag --store" / "env KCACHE_STORE" / "default")

    @property
    def default_index_path(self) -> Path:
        return self.home / "index.db"

    @property
    def endpoint_configured(self) -> bool:
        """The endpoint came from AWS_ENDPOINT_URL*, not --s3-endpoint-url: the AWS config file's
        ignore_configured_endpoint_urls leaves it unused (kcache.store.s3)."""
        return self.origin("endpoint").startswith("env ")

    def origin(self, name: str) -> str:
        return dict(self.origins).get(name, DEFAULT)

    def named_by(self, name: str, flag: str) -> str:
        """How the user named a setting, for messages: its environment variable, else `flag`."""
        where = self.origin(name)
        return where.removeprefix("env ") if where.startswith("env ") else flag


def resolve(
    store: str | None = None,
    index: str | None = None,
    s3_endpoint_url: str | None = None,
    env: Mapping[str, str] | None = None,
    *,
    origins: Mapping[str, str] | None = None,
) -> Settings:
    """Settings from explicit values (origin "flag" unless `origins` names another), else env, else defaults."""
    env = os.environ if env is None else env
    given = {"store": store, "index": index, "endpoint": s3_endpoint_url}
    values: dict[str, str | None] = {}
    found: dict[str, str] = {}
    for name in ("home", *given):
        values[name], found[name] = _lookup(name, given.get(name), env, origins or {})
    if found["endpoint"].startswith("env ") and ignores_configured_endpoints(env):
        values["endpoint"], found["endpoint"] = None, f"{DEFAULT} ({found['endpoint']} ignored: {IGNORE_ENDPOINTS_ENV})"
    try:
        home = Path(values["home"] or _default_home()).expanduser().absolute()
        if home.exists() and not home.is_dir():
            raise _config_error("KCACHE_HOME", str(home), "is not a directory")
    except RuntimeError:  # ~user of a user this system does not know
        raise _config_error("KCACHE_HOME", str(values["home"]), "names the home of an unknown user") from None
    except OSError as exc:  # ENAMETOOLONG
        raise _config_error("KCACHE_HOME", str(values["home"]), f"cannot be looked at: {exc.strerror or exc}") from None
    return Settings(
        home=home,
        store_url=values["store"] or f"file://{home / 'store'}",
        index_url=values["index"] or f"sqlite:///{home / 'index.db'}",
        s3_endpoint_url=values["endpoint"] or None,
        index_explicit=bool(values["index"]),
        store_explicit=bool(values["store"]),
        origins=tuple(found.items()),
    )


def ignores_configured_endpoints(env: Mapping[str, str]) -> bool:
    """AWS_IGNORE_CONFIGURED_ENDPOINT_URLS as botocore reads it: "true" in any case; anything else is off."""
    return env.get(IGNORE_ENDPOINTS_ENV, "").lower() == "true"


def check_endpoint(settings: Settings) -> None:
    """Refuse an S3 endpoint that is no http(s) URL with a host (and a valid port), for an s3:// store:
    boto3 would take it and fail every request later, as a store error. Another store never uses the
    endpoint, so AWS_ENDPOINT_URL set for some other tool does not stop it."""
    url = settings.s3_endpoint_url
    if url is None or not settings.store_url.startswith("s3://"):
        return
    what = settings.named_by("endpoint", "--s3-endpoint-url")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no port
    except ValueError as exc:
        raise _config_error(what, url, f"is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _config_error(what, url, "expected an http:// or https:// URL with a host, e.g. http://minio:9000")


def _default_home() -> Path:
    """~/.cache/kcache; a user without a home (no HOME and no passwd entry: an arbitrary uid in a
    container) gets kcache-<uid> in the temp dir, so commands given explicit places still run."""
    try:
        return Path.home() / ".cache" / "kcache"
    except (RuntimeError, KeyError):
        return Path(tempfile.gettempdir()) / f"kcache-{os.getuid()}"


def _lookup(name: str, value: str | None, env: Mapping[str, str], origins: Mapping[str, str]):
    if value:
        return value, origins.get(name, "flag")
    for var in ENV[name]:
        if env.get(var):
            return env[var], f"env {var}"
    return None, DEFAULT


def _config_error(what: str, value: str, why: str):
    from kcache.errors import ConfigError  # errors.py imports this module for redaction

    return ConfigError(what, value, why)


_SECRET_PARAM = re.compile(r"pass|secret|token|key|sig|credential|auth", re.IGNORECASE)
_QUERY_ITEM = re.compile(r"([^&=;]+)=([^&;]*)")
# Each scheme is tried only where a run of scheme characters begins (the look-behind): tried at every
# letter of a long run, the search cost the square of its length (an index error quoting a padded
# value took minutes to redact).
_URL = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>()\[\]]+")
# user:password@ after a scheme, up to the last @ before the path: a password may hold any of
# ')', "'", '?' that end a URL in running text, so this pass does not rely on finding the URL's end.
_USERINFO = re.compile(r"((?<![A-Za-z0-9+.\-])[A-Za-z][A-Za-z0-9+.\-]*://[^\s:/@]*):[^\s/]*@")


def redact_url(url: str) -> str:
    """`url` with its password and secret-looking query values replaced by ***; the rest as written."""
    url = _USERINFO.sub(rf"\1:{MASK}@", url)
    try:
        query = urlsplit(url).query
    except ValueError:  # not a URL urllib can read (e.g. a broken IPv6 host): keep only the scheme
        return url.split("://", 1)[0] + "://" + MASK
    hidden = _QUERY_ITEM.sub(lambda m: f"{m[1]}={MASK}" if _SECRET_PARAM.search(m[1]) else m[0], query)
    return url if hidden == query else url[: url.rindex(query)] + hidden + url[url.rindex(query) + len(query) :]


def redact_text(text: str) -> str:
    """`text` with every URL in it redacted (error messages quote the URLs they failed on)."""
    return _URL.sub(lambda m: redact_url(m.group(0)), _USERINFO.sub(rf"\1:{MASK}@", text))


def redact_doc(doc):
    """A JSON-like document with every string in it (keys too) redacted, as `redact_text` does.

    Each string on its own, never the serialised text: a URL's end found inside JSON's escapes
    (a quote the server sent, as \\") took the escaping backslash with a secret and broke the JSON."""
    if isinstance(doc, str):
        return redact_text(doc)
    if isinstance(doc, dict):
        return {redact_doc(k): redact_doc(v) for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [redact_doc(v) for v in doc]
    return doc
