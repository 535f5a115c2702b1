"""A cached answer as it lies in Redis, and the rules for what may become one.

    b"kcp2\\n" + canonical JSON {"headers": [[name, value], ...], "key", "sha256", "status", "stream"} + b"\\n" + body

Only complete, successful answers are stored: status 200, headers that decode reads back as they
are (at most MAX_HEADERS, tokens for names, values without controls that have a UTF-8 form), and
for JSON a body that parses to an object with `choices` and no `error`; for server-sent events a
stream that ends with `data: [DONE]` and carries no error event (vLLM reports a failure mid-stream
as an event, after a 200). Redis is
shared infrastructure, so a value is hostile until it decodes: it must be no larger than the proxy
would have written (--max-entry-bytes), the header line must parse (a RecursionError counts as not
parsing), it must name the request key it lies under (a value copied from another key, so from
another tenant or fingerprint, is not this request's answer), the body must hash to its sha256, and
headers must be plain tokens and values that encode as UTF-8, or the value counts as absent. (kcp1
entries had no key; they read as bad entries and are overwritten.)
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass

from kcache import canonical, untrusted
from kcache.errors import BadEntry
from kcache.proxy import sse

MAGIC = b"kcp2\n"
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
        return "" if sse.complete(body) else "upstream_error"
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: an answer nested past the parser's limit
        return "upstream_error"
    if not isinstance(doc, dict) or "error" in doc or "choices" not in doc:
        return "upstream_error"
    return ""


def encode(entry: Entry, *, key: str) -> bytes:
    """The bytes to store under request key `key` (without the Redis prefix)."""
    meta = {
        "status": entry.status,
        "headers": [list(h) for h in entry.headers],
        "key": key,
        "sha256": hashlib.sha256(entry.body).hexdigest(),
        "stream": entry.stream,
    }
    return MAGIC + canonical.dumps(meta) + b"\n" + entry.body


def decode(raw: bytes, *, max_bytes: int, key: str) -> Entry:
    """The entry in `raw`, read under request key `key`; raises BadEntry for anything this proxy did not
    write whole for that key, and for anything over `max_bytes`, which it would not have written (the
    cache reads one byte past it)."""
    if not isinstance(raw, bytes) or not raw.startswith(MAGIC):
        raise BadEntry("no kcp2 magic")
    if len(raw) > max_bytes:
        raise BadEntry(f"larger than --max-entry-bytes ({max_bytes})")
    head, sep, body = raw[len(MAGIC) :].partition(b"\n")
    if not sep:
        raise BadEntry("no header line")
    try:
        meta = json.loads(head)
    except (ValueError, RecursionError) as exc:  # RecursionError: a header nested past the parser's limit
        raise BadEntry(f"header is not JSON: {str(exc)[:80]}") from None
    if not isinstance(meta, dict) or meta.get("status") != 200 or not isinstance(meta.get("stream"), bool):
        raise BadEntry("bad status or stream flag")
    if meta.get("key") != key:
        raise BadEntry("written for another request key")
    if meta.get("sha256") != hashlib.sha256(body).hexdigest():
        raise BadEntry("body does not match its sha256")
    return Entry(200, _headers(meta.get("headers")), body, meta["stream"])


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

