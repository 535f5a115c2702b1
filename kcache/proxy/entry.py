"""A cached answer as it lies in Redis, and the rules for what may become one.

    b"kcp3\\n" + canonical JSON {"expires", "headers": [[name, value], ...], "status", "stream"} + b"\\n" + body + tag

    tag = HMAC-SHA256(tenant key, len(name) + b":" + name + the value up to the tag)   (32 raw bytes)
    tenant key = HMAC-SHA256(secret, the credential headers the request carried, raw)  (tenant_key)
    name = the Redis key the value lies under (--key-prefix + request key)

Redis is shared infrastructure, and whoever can write to it must not be able to choose what a client
is answered. So every entry is authenticated under a secret that never goes to Redis (--entry-key-file,
else a random one of this process's own), and the tag is checked before anything else of the value is
read. The tag covers the key name, so a value copied from another key (another tenant's, another
fingerprint's) is not this request's answer; the tenant key mixes in the tenant's raw credential, so
even a holder of the secret who can write Redis cannot forge the answers of a tenant whose credential
it does not have (the anonymous tenant, with no credential, has only the secret to protect it). The
credential itself is never stored: the request key holds only its hash (kcache.proxy.key). `expires`
(Unix ms, written + --ttl) is tagged too: a value saved and SET again later, with a fresh Redis
expiry, is served no longer than its first life.

Only complete, successful answers are stored: status 200, headers that decode reads back as they are
(at most MAX_HEADERS, tokens for names, values without controls that have a UTF-8 form), and for
JSON a body that parses to an object with `choices` and no `error`; for server-sent events a stream
that ends with `data: [DONE]` and carries no error event (vLLM reports a failure mid-stream as an
event, after a 200) and holds at most MAX_EVENTS events; and in neither a choice whose finish_reason
says the engine stopped it short (sse.CUT_SHORT: SGLang's aborted answers are 200s). A value is
hostile until it decodes: it must be no larger than the proxy would have written
(--max-entry-bytes), carry the tag of its name under this tenant's key, and its header line must
parse (a RecursionError counts as not parsing) to headers that are plain tokens and values that
encode as UTF-8, or the value counts as absent. (kcp1 and kcp2 entries carried no tag; they read as
bad entries and are overwritten.)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kcache import boundedread, canonical, untrusted
from kcache.errors import BadEntry, ConfigError
from kcache.proxy import sse

MAGIC = b"kcp3\n"
TAG_BYTES = 32  # HMAC-SHA256
MIN_SECRET_BYTES = 32  # what `openssl rand -hex 32` writes is 64
MAX_SECRET_FILE_BYTES = 4096
# Events in a stream entry: one a token is ~130k for a long answer; each costs a regex match when it
# is replayed (batched into writes, kcache.proxy.sse.batches), so a value of 2-byte events is bounded.
MAX_EVENTS = 1 << 17
MAX_HEADERS = 64
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")  # no CR, LF or other controls: no header injection
# Headers of one hop only, or framing that the proxy redoes itself: never copied from upstream; nor is a
# header the answer's own Connection header names.
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
     "transfer-encoding", "upgrade", "content-length", "content-encoding"}
)  # fmt: skip
# Not stored either: the date must be fresh on every answer, and a cookie belongs to one client.
NOT_STORED_HEADERS = HOP_BY_HOP | {"date", "set-cookie"}


def connection_names(headers) -> frozenset[str]:
    """The names the `Connection` headers list (any case, any repeat): this hop's too (RFC 9110 7.6.1)."""
    listed = (name.strip().lower() for value in headers.getall("Connection", ()) for name in value.split(","))
    return frozenset(listed) - {""}


@dataclass(frozen=True)
class Entry:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes
    stream: bool


def answer_headers(headers) -> tuple[tuple[str, str], ...]:
    """The upstream headers of a cacheable answer, as a client gets them from the engine or the cache alike."""
    dropped = NOT_STORED_HEADERS | connection_names(headers)
    return tuple((k, v) for k, v in headers.items() if k.lower() not in dropped)


def passed_headers(headers) -> tuple[tuple[str, str], ...]:
    """The upstream headers of an answer the cache does not handle: all but this hop's."""
    dropped = HOP_BY_HOP | connection_names(headers)
    return tuple((k, v) for k, v in headers.items() if k.lower() not in dropped)


def is_event_stream(headers: tuple[tuple[str, str], ...]) -> bool:
    return any(k.lower() == "content-type" and v.lower().startswith("text/event-stream") for k, v in headers)


def storable(status: int, headers: tuple[tuple[str, str], ...], body: bytes) -> str:
    """Why this answer must not be cached ("" when it may be). What decode would refuse is never
    stored: it would be written, then refused on every read."""
    if status != 200:
        return "upstream_error"
    try:
        _headers([list(pair) for pair in headers])
    except BadEntry:  # over MAX_HEADERS, a name that is no token, a value with controls or no UTF-8 form
        return "headers"
    if is_event_stream(headers):
        if sse.count(body, MAX_EVENTS) > MAX_EVENTS:
            return "too_large"
        return "" if sse.complete(body) else "upstream_error"
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: an answer nested past the parser's limit
        return "upstream_error"
    if not isinstance(doc, dict) or "error" in doc or "choices" not in doc or sse.cut_short(doc):
        return "upstream_error"
    return ""


def encode(entry: Entry, *, name: str, mac_key: bytes, expires_ms: int) -> bytes:
    """The bytes to store under the Redis key `name`, tagged under `mac_key` (tenant_key), to be served
    until `expires_ms` (Unix time in ms)."""
    meta = {"status": entry.status, "headers": [list(h) for h in entry.headers], "stream": entry.stream,
            "expires": expires_ms}  # fmt: skip
    signed = MAGIC + canonical.dumps(meta) + b"\n" + entry.body
    return signed + _tag(mac_key, name, signed)


def decode(raw: bytes, *, max_bytes: int, name: str, mac_key: bytes, now_ms: int) -> Entry:
    """The entry in `raw`, read under the Redis key `name` at `now_ms` (Unix time in ms); raises BadEntry
    for anything this proxy did not write whole for that key and tenant, for an entry past its expiry,
    and for anything over `max_bytes`, which it would not have written (the cache reads one byte past
    it). Nothing but the tag is read before the tag is checked."""
    if not isinstance(raw, bytes) or not raw.startswith(MAGIC):
        raise BadEntry("no kcp3 magic")
    if len(raw) > max_bytes:
        raise BadEntry(f"larger than --max-entry-bytes ({max_bytes})")
    signed, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
    if len(signed) < len(MAGIC) or not hmac.compare_digest(tag, _tag(mac_key, name, signed)):
        raise BadEntry("not written by a proxy with this entry key, for this key and tenant")
    head, sep, body = signed[len(MAGIC) :].partition(b"\n")
    if not sep:
        raise BadEntry("no header line")
    try:
        meta = json.loads(head)
    except (ValueError, RecursionError) as exc:  # RecursionError: a header nested past the parser's limit
        raise BadEntry(f"header is not JSON: {str(exc)[:80]}") from None
    if not isinstance(meta, dict) or meta.get("status") != 200 or not isinstance(meta.get("stream"), bool):
        raise BadEntry("bad status or stream flag")
    expires = meta.get("expires")
    if not isinstance(expires, int) or isinstance(expires, bool) or expires <= now_ms:
        raise BadEntry("expired, or no expiry")
    if meta["stream"] and sse.count(body, MAX_EVENTS) > MAX_EVENTS:
        raise BadEntry(f"more than {MAX_EVENTS} events")
    return Entry(200, _headers(meta.get("headers")), body, meta["stream"])


def tenant_key(secret: bytes, credentials: Sequence[tuple[str, str]]) -> bytes:
    """The key that tags one tenant's entries: HMAC-SHA256 under `secret` of its credential headers
    ((name, value) pairs, as kcache.proxy.key.decide found them), each name lower-case, sorted, every
    part framed by its length. A value is its bytes (aiohttp decodes header bytes that are not UTF-8
    with surrogateescape)."""
    framed = b"kcache-proxy-tenant-key-1"
    for lower, value in sorted((n.lower().encode(), v.encode("utf-8", "surrogateescape")) for n, v in credentials):
        framed += b"%d:%s%d:%s" % (len(lower), lower, len(value), value)
    return hmac.digest(secret, framed, hashlib.sha256)


def _tag(mac_key: bytes, name: str, signed: bytes) -> bytes:
    encoded = name.encode("utf-8", "surrogateescape")
    mac = hmac.new(mac_key, b"%d:%s" % (len(encoded), encoded), hashlib.sha256)
    mac.update(signed)  # not concatenated: a copy of up to --max-entry-bytes
    return mac.digest()


def read_secret(path: Path) -> bytes:
    """The entry secret in the file `path` (--entry-key-file; a Kubernetes Secret mounted as a file),
    without the whitespace around it. ConfigError when it cannot be read or is shorter than
    MIN_SECRET_BYTES: a guessable secret would let a Redis writer forge every answer."""
    secret = boundedread.read_named(Path(path), MAX_SECRET_FILE_BYTES, "--entry-key-file").strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError("--entry-key-file", str(path), f"holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} "
                          "are needed, e.g. from `openssl rand -hex 32`")  # fmt: skip
    return secret


def _headers(value) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list) or len(value) > MAX_HEADERS:
        raise BadEntry("headers are not a short list")
    pairs = []
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise BadEntry("a header is not a [name, value] pair")
        name, text = pair
        if not _TOKEN.fullmatch(name) or not _VALUE.fullmatch(text) or name.lower() in NOT_STORED_HEADERS:
            raise BadEntry(f"header {name[:40]!r} is not allowed")
        if not untrusted.is_utf8(text):  # a lone surrogate (an escape, or raw bytes json reads with surrogatepass)
            raise BadEntry(f"header {name[:40]!r} has no UTF-8 form")
        pairs.append((name, text))
    return tuple(pairs)

