"""One HTTP request to a server kcache does not trust (the warmup target), with hard limits.

* One deadline for the whole request: connect, headers and body. A per-read timeout is not enough:
  a server that sends one byte a second never trips it. A timer shuts the socket down when the
  deadline passes, which wakes whatever read is blocked.
* A cap on the body: a 2 GB or endless chunked answer stops at `max_body` bytes. Header lines and
  counts are capped by http.client itself.
* No redirects: a 3xx comes back as a `Response` for the caller to refuse. Following one could turn
  a POST into a body-less GET that "succeeds", or leave the host the operator named.

Failures raise `RequestFailed`, whose `transient` says whether the same request may work again
(connection refused or cut, the deadline, 408/429/502/503/504); the caller decides about retries.
"""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

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
    """(scheme, host, port, path prefix without a trailing slash); ConfigError if it is no http(s) URL."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError("--url", url, "expected http://host:port")
    try:
        port = parts.port
    except ValueError:
        given = parts.netloc.rpartition("@")[2].rpartition(":")[2]
        why = f"the port {given} is out of range (0-65535)" if given.isdigit() else "the port is not a number"
        raise ConfigError("--url", url, why) from None
    return parts.scheme, parts.hostname, port, parts.path.rstrip("/")


def request(method: str, url: str, *, timeout: float, max_body: int, body: bytes | None = None,
            headers: Mapping[str, str] | None = None) -> Response:  # fmt: skip
    """Send one request; the answer's status may be anything (the caller judges it)."""
    scheme, host, port, path = split_url(url)
    kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = kind(host, port, timeout=timeout)
    expired = threading.Event()
    watchdog = threading.Timer(timeout, _cut, (conn, expired))
    watchdog.daemon = True
    watchdog.start()
    deadline = time.monotonic() + timeout
    try:
        conn.request(method, path or "/", body=body, headers=dict(headers or {}))
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
    finally:
        watchdog.cancel()
        conn.close()


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
    if declared.isdigit() and int(declared) > max_body:
        raise RequestFailed(url, f"answer of {int(declared)} bytes is over the {max_body}-byte limit", transient=False)
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
