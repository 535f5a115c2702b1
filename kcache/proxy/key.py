"""Which requests the proxy may answer from its cache, and the key it files each answer under.

A key is SHA-256 over canonical JSON of named parts (pip's cache key, in spirit):

    schema       KEY_SCHEMA; bump it whenever a part or the body's normal form changes
    fingerprint  the bundle key of what the pod runs: a new model, revision, toolchain or compile
                 option is a new key, so an update never serves the previous version's answers
    tenant       SHA-256 of the credential headers the request carries (TENANT_HEADERS and the operator's
                 --tenant-header names), each as [lower-case name, SHA-256 of its value]: one tenant never
                 gets another's answer, and no credential is kept. A request with one of them twice is not
                 cached: engines read one of the two, and which one is theirs to say
    path, query  /v1/completions and /v1/chat/completions answer differently; the query's pairs are
                 sorted by name, repeated names kept in their order (an engine reads the first or the
                 last), escapes decoded to bytes read as Latin-1 (one character a byte: no two raw
                 queries share a key, where UTF-8 decoding turns every invalid escape into U+FFFD)
    body         the request's JSON with NON_SEMANTIC fields removed (in the forms every engine takes),
                 its top-level members in any order and a top-level number integral when it can be
                 (`temperature: 0.0` is `0`); a list or object as the text of its JSON, in the order
                 and spelling it came in: an engine reads parameters by name, but structured output
                 follows a schema's property order and chat templates render `tools` unsorted, `1.0`
                 as `1.0`. A body that names a field twice at any depth is not cached (Python keeps
                 the last, other parsers the first: the engine may read another request than the key)

Only a body sent as application/json is cached (sent_as_json): the engine refuses others, or reads them
otherwise, so their answer is not the JSON request's. Nor is a request whose answer depends on more than
its bytes (remote_input): a medium at a URL other than data:, one the engine looks up, KV blocks another
engine transfers.

Deterministic by default means: `n` is absent or 1, and `temperature` is 0 or `seed` is an integer
other than -1 (vLLM's "no seed"). A missing temperature is not 0: OpenAI defaults to 1 and vLLM to
the model's generation config, so such a request samples. `--cache-sampled` caches sampling requests
too (every client then gets the first sample). Nothing here imports aiohttp or redis: the rules are
pure and tested alone.
"""

from __future__ import annotations

import hashlib
import json
import re
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kcache import canonical, readiness
from kcache.errors import ConfigError

# 2: query pairs decoded byte for byte, repeated names in order; 3: tenant of every credential header;
# 4: lists and objects in the body keyed as sent (order, number spelling)
KEY_SCHEMA = 4
CACHED_PATHS = ("/v1/completions", "/v1/chat/completions")
BYPASS_HEADER = "X-Kcache-Bypass"
NO_SEED = -1  # vLLM reads this seed as none at all (SamplingParams): the request samples afresh each time
# Headers that say who asks. An engine reads Authorization (vLLM's --api-key); a gateway in front of it may
# authenticate with another, and then every client would be one tenant. Cookie too: gateways that log users
# in (oauth2-proxy, Cloudflare Access, IAP) pass a session cookie, and shared caches treat it as a credential
# (Varnish does not cache a request that carries one). Operators name more with --tenant-header.
TENANT_HEADERS = (
    "Authorization",  # vLLM --api-key, OpenAI, most gateways
    "X-Api-Key",  # API gateways (AWS API Gateway, Kong, LiteLLM)
    "Api-Key",  # Azure OpenAI
    "Cookie",  # a browser session a gateway authenticated
)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 5.1: what a header name may be
# Fields that change who asked or how the engine schedules the request, never the tokens it returns. Each is
# left out of the key only in a form every engine takes (NON_SEMANTIC_FORMS): in another, the engine may refuse
# the request (vLLM refuses a priority other than 0 unless started with --scheduling-policy priority, and a user
# that is no string), and the answer to the request without the field is not its answer.
NON_SEMANTIC = (
    "user",  # an end-user id for abuse monitoring
    "request_id",  # vLLM: a tracing id
    "priority",  # vLLM: scheduling order
    "metadata",  # OpenAI stored completions: tags for the dashboard
    "store",  # OpenAI stored completions: whether to keep a copy
)


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


NON_SEMANTIC_FORMS = {
    "user": lambda v: v is None or isinstance(v, str),
    "request_id": lambda v: isinstance(v, str),
    "priority": lambda v: _is_number(v, 0),  # 0 is every engine's default; any other needs priority scheduling
    "metadata": lambda v: v is None or _is_str_map(v),
    "store": lambda v: v is None or isinstance(v, bool),
}


@dataclass(frozen=True)
class Decision:
    """A request's fate: `key` when the cache may answer it, else the bypass `reason`."""

    key: str | None
    reason: str  # "" when cacheable; else the `off` reason | bypass_header | content_type | not_json | ambiguous_auth
    # | remote_input | sampling | n
    body: dict | None  # the parsed request, for prefix measurement; None when it is not a JSON object
    # (name, value) of each tenant header the request carries, as sent: what tags the tenant's entries
    # (kcache.proxy.entry.tenant_key). Never stored, never shown.
    credentials: tuple[tuple[str, str], ...] = field(default=(), repr=False)


def decide(
    path: str,
    query: Mapping[str, str] | list[tuple[str, str]],
    headers: Mapping[str, str],
    raw: bytes,
    fingerprint: str,
    *,
    off: str = "",
    cache_sampled: bool = False,
    tenant_headers: Sequence[str] = TENANT_HEADERS,
) -> Decision:
    """Whether the cache may answer this POST to one of CACHED_PATHS, and under which key.

    `headers` may repeat a name (a multidict with `getall`, as aiohttp gives them); a plain mapping
    holds one value per name as spelt. `tenant_headers`: every header that names the tenant
    (tenant_headers() adds an operator's to TENANT_HEADERS). `off`: why the cache answers nothing at all
    (disabled: --no-cache; no_fingerprint: the restore root names none), "" while it is on.
    """
    # An encoded body is bytes the proxy does not read as the engine would (it may inflate it, or not).
    encodings = {e.strip().lower() for v in values(headers, "Content-Encoding") for e in v.split(",")}
    body = parse_body(raw) if encodings <= {"identity", ""} else None
    if off:
        return Decision(None, off, body)
    if wants_bypass(headers):
        return Decision(None, "bypass_header", body)
    if not sent_as_json(headers):
        return Decision(None, "content_type", body)
    if body is None:
        return Decision(None, "not_json", None)
    given = [(name, values(headers, name)) for name in tenant_headers]
    if any(len(found) > 1 for _, found in given):
        return Decision(None, "ambiguous_auth", body)
    if remote_input(body):
        return Decision(None, "remote_input", body)
    reason = "" if cache_sampled else nondeterminism(body)
    if reason:
        return Decision(None, reason, body)
    credentials = tuple((name, found[0]) for name, found in given if found)
    return Decision(request_key(path, query, credentials, body, fingerprint), "", body, credentials)


def tenant_headers(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """TENANT_HEADERS and then `extra`, each name once whatever its case; ValueError for a name no header has."""
    names: dict[str, str] = {}
    for name in (*TENANT_HEADERS, *extra):
        if not is_header_name(name):
            raise ValueError(f"{name!r} is not an HTTP header name")
        names.setdefault(name.lower(), name)
    return tuple(names.values())


def is_header_name(name: str) -> bool:
    """Whether `name` is an RFC 9110 token, what a header's name must be (a colon or a space is not)."""
    return _TOKEN.fullmatch(name) is not None


def values(headers: Mapping[str, str], name: str) -> list[str]:
    """Every value of header `name`, in order: a repeated header must not hide behind its first value."""
    getall = getattr(headers, "getall", None)
    if getall is not None:
        return list(getall(name, []))
    return [value for k, value in headers.items() if k.lower() == name.lower()]  # names are case-insensitive


# Levels of nesting a body must be able to take on top of its own: the key and the prefix measurement
# serialise it again from a few frames deeper than parse_body, and must never be the ones to fail.
DEPTH_HEADROOM = 16


def parse_body(raw: bytes) -> dict | None:
    """The request body as a JSON object with a canonical form; None for anything else.

    JSON that parses is not always JSON canonical.dumps can write: NaN, 1e400 (which parses to inf),
    a lone surrogate (an escape like \\ud800, or raw bytes, which json.loads reads with surrogatepass),
    or nesting at the edge of the recursion limit. Such a body cannot be keyed or measured, so it is
    `not_json`: forwarded unchanged, never cached.
    """
    try:
        doc = json.loads(raw, object_pairs_hook=_unique)
        wrapped = doc
        for _ in range(DEPTH_HEADROOM):
            wrapped = [wrapped]
        canonical.dumps(wrapped)
    except (ValueError, RecursionError):  # UnicodeError is a ValueError
        return None
    return doc if isinstance(doc, dict) else None


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    """An object's members, refused when a name comes twice (after unescaping: "a" and "\\u0061" are one)."""
    doc = dict(pairs)
    if len(doc) != len(pairs):
        raise ValueError("a name appears twice in one object")  # parse_body: not_json
    return doc


def sent_as_json(headers: Mapping[str, str]) -> bool:
    """Whether the body comes as `application/json` (any case, any parameters), in one Content-Type header.

    The media type is part of the request: vLLM refuses a body sent as anything else (400), FastAPI alone
    hands a text/plain body to the model as bytes (422), and without a Content-Type at all the engines
    differ. So the cache answers only what every engine reads as JSON, and keys it as before; the rest
    reaches the engine, which decides. Parameters change nothing: json.loads reads the bytes' encoding itself.
    Only the value's ends are stripped (as every HTTP parser does): vLLM compares what precedes the ';' as it
    stands, so `application/json ;charset=utf-8` is refused there (400) and must not hit here.
    """
    found = values(headers, "Content-Type")
    return len(found) == 1 and found[0].strip().split(";", 1)[0].lower() == "application/json"


def wants_bypass(headers: Mapping[str, str]) -> bool:
    """`X-Kcache-Bypass: 1` (or true/yes), or `Cache-Control: no-cache` / `no-store`."""
    if any(v.strip().lower() in ("1", "true", "yes") for v in values(headers, BYPASS_HEADER)):
        return True
    # Repeated Cache-Control headers are one comma-separated list (RFC 9110 5.3).
    directives = {d.strip().lower() for v in values(headers, "Cache-Control") for d in v.split(",")}
    return bool(directives & {"no-cache", "no-store"})


# Members of a chat message's content part that name a medium by URL (vLLM, SGLang: http(s):, file:, data:).
MEDIA_URLS = ("image_url", "audio_url", "video_url")
# Top-level fields that bring KV blocks from another engine (disaggregated prefill): vLLM's, SGLang's.
TRANSFERS = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")


def remote_input(body: Mapping[str, Any]) -> bool:
    """Whether the answer depends on more than the request: an input the engine fetches or looks up.

    A medium at a URL other than data: (what lies there may change behind a cached answer; a data: URL is the
    medium itself, keyed like any text), one named by a `uuid` (the engine's media cache answers for it) or a
    file id (an upload the server holds), and KV blocks another engine transfers: their block ids are reused,
    and a replayed prefill answer would send its decode peer to blocks freed long since.
    """
    if any(body.get(name) is not None for name in TRANSFERS):
        return True
    messages = body.get("messages")
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and _looked_up(part):
                return True
    return False


def _looked_up(part: Mapping[str, Any]) -> bool:
    if part.get("uuid") is not None or part.get("file_id") is not None:
        return True
    file = part.get("file")
    if isinstance(file, dict) and file.get("file_id") is not None:
        return True
    for name in MEDIA_URLS:
        if name in part:
            medium = part[name]
            url = medium.get("url") if isinstance(medium, dict) else medium
            if not (isinstance(url, str) and url[:5].lower() == "data:"):  # " data:" too: a URL parser strips it
                return True
    return False


def nondeterminism(body: Mapping[str, Any]) -> str:
    """Why the engine may answer this request differently each time ("" when it will not)."""
    n = body.get("n", 1)
    if n is not None and not _is_number(n, 1):
        return "n"
    if _is_number(body.get("temperature"), 0):
        return ""
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and seed != NO_SEED:
        return ""
    return "sampling"


def _is_number(value: Any, expected: int) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == expected


def query_pairs(raw_query: str) -> list[tuple[str, str]]:
    """The raw query string's name/value pairs, as the key reads them (see the module docstring)."""
    return urllib.parse.parse_qsl(raw_query, keep_blank_values=True, encoding="latin-1")


def request_key(path: str, query, credentials: Sequence[tuple[str, str]], body: Mapping[str, Any],
                fingerprint: str) -> str:  # fmt: skip
    """`credentials`: (name, value) of each tenant header the request carries, each name once."""
    items = query.items() if isinstance(query, Mapping) else query
    parts = {
        "schema": KEY_SCHEMA,
        "fingerprint": fingerprint,
        "tenant": tenant(credentials),
        "path": path,
        "query": sorted(([str(k), str(v)] for k, v in items), key=lambda pair: pair[0]),  # stable: repeats in order
        "body": {name: _member(value) for name, value in body.items() if not _left_out(name, value)},
    }
    return canonical.sha256(canonical.dumps(parts))


def _left_out(name: str, value: Any) -> bool:
    """Whether a top-level member stays out of the key: a NON_SEMANTIC field in a form every engine takes."""
    form = NON_SEMANTIC_FORMS.get(name)
    return form is not None and form(value)


def tenant(credentials: Sequence[tuple[str, str]]) -> str:
    """Who asked, without keeping a credential: SHA-256 of the sorted [lower-case name, SHA-256 of value] pairs.

    No credential at all is the one anonymous tenant; an empty value is a credential, and not that one. A value
    is hashed as its bytes (aiohttp decodes header bytes that are not UTF-8 with surrogateescape).
    """
    pairs = sorted(
        [name.lower(), hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()]
        for name, value in credentials
    )
    return canonical.sha256(canonical.dumps(pairs))


def _member(value: Any) -> Any:
    """A top-level member as the key holds it (see the module docstring). A list or object becomes
    {"as_sent": its JSON text}: never a scalar, so no string shares a key with the value it spells.
    The C encoder takes any depth parse_body let through, where a walk in Python spends frames a level."""
    if isinstance(value, (dict, list)):
        return {"as_sent": json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)}
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


_BUNDLE_KEY = re.compile(r"[0-9a-f]{32}")


def fingerprint_from_root(root: Path) -> str:
    """The bundle key `kcache restore` computed for this pod, from ROOT/.kcache-state.json.

    Written on a hit, a miss and an error alike, but a restore that failed before it computed the
    fingerprint (a bad flag, a probe that crashed) writes none. The file is on a shared volume: anything
    but 32 hex digits is refused rather than hashed into keys. Raises ConfigError; `kcache proxy` then
    serves with its cache off rather than keep the pod from serving.
    """
    state = readiness.read_marker(root, readiness.RESTORE_MARKER)
    if state is None:
        raise ConfigError("--root", str(root), f"no readable {readiness.RESTORE_MARKER}: run `kcache restore --into` "
                          "it first, or give the fingerprint flags (--model ...) instead")  # fmt: skip
    bundle_key = state.get("bundle_key")
    if not isinstance(bundle_key, str) or not _BUNDLE_KEY.fullmatch(bundle_key):
        raise ConfigError("--root", str(root), f"{readiness.RESTORE_MARKER} has no valid bundle_key")
    return bundle_key
