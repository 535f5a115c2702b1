"""One HTTP request to a server kcache does not trust (the warmup target), with hard limits.

* One deadline for the whole request: name resolution, connect, headers and body. A per-read
  timeout is not enough: a server that sends one byte a second never trips it. A timer shuts the
  socket down when the deadline passes, which wakes whatever read is blocked. The OS resolver
  cannot be woken, so it runs in a thread the request stops waiting for; the connection then goes to
  the resolved address, while the Host header and TLS (SNI, certificate check) keep the URL's name.
* The request target is the URL's path and query as written (a trailing slash included).
* A cap on the body: a 2 GB or endless chunked answer stops at `max_body` bytes. Header lines and
  counts are capped by http.client itself.
* No redirects: a 3xx comes back as a `Response` for the caller to refuse. Following one could turn
  a POST into a body-less GET that "succeeds", or leave the host the operator named.

Failures raise `RequestFailed`, whose `transient` says whether the same request may work again
(connection refused or cut, the deadline, 408/429/502/503/504); the caller decides about retries.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

from kcache.errors import ConfigError, KcacheError

TRANSIENT_STATUS = frozenset({408, 429, 502, 503, 504})
_CHUNK = 64 * 1024


class RequestFailed(KcacheError):
    """A request that got no usable answer; `why` is safe to print (bounded, printable)."""

    def __init__(self, url: str, why: str, *, transient: bool, timed_out: bool = False):
        self.url, self.why, self.transient, self.timed_out = url, why, transient, timed_out
        super().__init__(why)


@dataclass(frozen=True)
class Response:
    status: int
    reason: str
    body: bytes
    location: str = ""  # the Location header of a 3xx, printable and bounded


def printable(text: str, limit: int = 200) -> str:
    """Hostile text made safe for a log line or a terminal: no control characters, bounded."""
    cleaned = "".join(c if c.isprintable() else "?" for c in text[: limit + 1])
    return cleaned[:limit] + "..." if len(cleaned) > limit else cleaned


def split_url(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host, port, path prefix without a trailing slash); ConfigError if it is no http(s) URL.

    The prefix is what warmup appends its paths to; `request` sends a URL's path and query as written."""
    parts = parse(url)
    return parts.scheme, parts.hostname or "", parts.port, parts.path.rstrip("/")


def parse(url: str) -> SplitResult:
    """`url` split, checked as far as a request would check it: ConfigError ("--url") otherwise."""
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # "Invalid IPv6 URL": an unclosed [
        raise ConfigError("--url", url, f"not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("--url", url, "expected http://host:port")
    try:
        _ = parts.port  # a property that parses the port
    except ValueError:
        given = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        why = f"the port {given} is out of range (0-65535)" if given.isdigit() else "the port is not a number"
        raise ConfigError("--url", url, why) from None
    if not _ip_literal(parts.hostname):
        try:
            parts.hostname.encode("idna")  # what the resolver is given: an empty or 64-character label fails
        except UnicodeError:
            raise ConfigError("--url", url, f"{printable(parts.hostname)!r} is not a valid host name") from None
    return parts


def _ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def request(method: str, url: str, *, timeout: float, max_body: int, body: bytes | tuple[bytes, ...] | None = None,
            headers: Mapping[str, str] | None = None) -> Response:  # fmt: skip
    """Send one request; the answer's status may be anything (the caller judges it). A `body` in
    pieces is sent one after the other, with its whole length (callers share a large piece)."""
    parts = parse(url)
    headers = dict(headers or {})
    if isinstance(body, tuple):  # http.client would send pieces chunked, which not every server takes
        headers.setdefault("Content-Length", str(sum(len(piece) for piece in body)))
    deadline = time.monotonic() + timeout
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=timeout)
    port = conn.port  # the scheme's default when the URL names none
    # http.client connects through this hook: to the addresses resolved within the deadline, while
    # conn.host (the Host header, SNI and the certificate check) stays the URL's name.
    conn._create_connection = lambda *_given: _connect(_resolve(url, parts.hostname, port, deadline, timeout),
                                                       deadline, timeout)  # fmt: skip
    expired = threading.Event()
    watchdog = threading.Timer(timeout, _cut, (conn, expired))
    watchdog.daemon = True
    watchdog.start()
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    answer: http.client.HTTPResponse | None = None
    try:
        conn.request(method, target, body=body, headers=headers)
        answer = conn.getresponse()
        data = _read_capped(answer, max_body, url, deadline)
        return Response(
            answer.status, printable(answer.reason or ""), data, printable(answer.getheader("Location", ""))
        )
    except (OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError) or time.monotonic() >= deadline:
            raise RequestFailed(
                url, f"no complete answer within {timeout:g} s", transient=True, timed_out=True
            ) from None
        hostile = isinstance(exc, http.client.LineTooLong) or "got more than" in str(exc)  # header limits
        raise RequestFailed(url, printable(f"{type(exc).__name__}: {exc}"), transient=not hostile) from None
    except (ValueError, UnicodeError) as exc:  # a header value or name http.client refuses to send
        raise RequestFailed(url, printable(f"{type(exc).__name__}: {exc}"), transient=False) from None
    finally:
        watchdog.cancel()
        # The answer too: one that closes the connection (no Content-Length, Connection: close) owns the
        # socket, and a refused one would keep it open as long as anything holds the failure's traceback.
        if answer is not None:
            answer.close()
        conn.close()


def _resolve(url: str, host: str, port: int, deadline: float, timeout: float) -> list[tuple]:
    """getaddrinfo's answer for host:port, or RequestFailed once the deadline passes without one."""
    if _ip_literal(host):  # nothing to look up: getaddrinfo answers at once
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    answer: list = []

    def lookup() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError) as exc:
            answer.append(exc)

    # A daemon thread: a resolver that never answers keeps it, not the caller (nor the exit).
    resolver = threading.Thread(target=lookup, name="kcache-resolve", daemon=True)
    resolver.start()
    resolver.join(max(0.0, deadline - time.monotonic()))
    if not answer:
        why = f"no complete answer within {timeout:g} s (resolving {printable(host)} did not finish)"
        raise RequestFailed(url, why, transient=True, timed_out=True)
    if isinstance(answer[0], UnicodeError):
        raise RequestFailed(url, printable(f"{printable(host)!r} is not a valid host name: {answer[0]}"),
                            transient=False)  # fmt: skip
    if isinstance(answer[0], OSError):
        raise answer[0]
    return answer[0]


def _connect(addresses: list[tuple], deadline: float, timeout: float) -> socket.socket:
    """A socket connected to the first of `addresses` that accepts before the deadline."""
    failure: OSError = OSError("no address to connect to")
    for family, kind, proto, _name, address in addresses:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            sock.connect(address)
            sock.settimeout(timeout)  # per read from here on; the watchdog holds the whole deadline
            return sock
        except OSError as exc:
            sock.close()
            failure = exc
    raise failure


def _cut(conn: http.client.HTTPConnection, expired: threading.Event) -> None:
    expired.set()
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already closed: nothing left to wake
            pass


def _read_capped(answer: http.client.HTTPResponse, max_body: int, url: str, deadline: float) -> bytes:
    declared = answer.getheader("Content-Length", "")
    # isascii: "²".isdigit() is true; past 18 digits over any cap, and int() refuses more than 4300
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > max_body):
        shown = declared if len(declared) <= 18 else f"a {len(declared)}-digit number of"
        raise RequestFailed(url, f"answer of {shown} bytes is over the {max_body}-byte limit", transient=False)
    parts: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() >= deadline:
            raise TimeoutError
        chunk = answer.read1(_CHUNK)  # at most one read from the socket: the deadline is checked often
        if not chunk:
            return b"".join(parts)
        size += len(chunk)
        if size > max_body:
            raise RequestFailed(url, f"answer is over the {max_body}-byte limit", transient=False)
        parts.append(chunk)
