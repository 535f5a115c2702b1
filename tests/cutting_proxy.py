"""A TCP proxy on 127.0.0.1 that cuts ranged GET responses mid-body, as a flaky network does.

    client ──► CuttingProxy ──► upstream (moto's S3 server)

Bytes pass through untouched, except that the first `cuts` responses to requests that `cut_if`
picks (by default: every GET with a Range header) are cut once `after` bytes of them have gone to
the client: the proxy resets the client's connection. HTTP clients here never pipeline, so a
request from the client starts the next response.
"""

from __future__ import annotations

import re
import select
import socket
import struct
import threading
from collections.abc import Callable

_REQUEST_LINE = re.compile(rb"[A-Z]+ \S+ HTTP/1\.[01]\r\n")


def ranged_get(head: bytes) -> bool:
    """`head` is the start of a request: its request line and (usually all) its headers."""
    return head.startswith(b"GET ") and b"\r\nrange:" in head.lower()


def pack_get(head: bytes) -> bool:
    """A ranged GET of a pack (refs and manifests are read by range too, and are not what is cut)."""
    return ranged_get(head) and b"/packs/" in head.split(b"\r\n", 1)[0]


class _Exchange:
    """What the proxy knows of one connection's current request."""

    def __init__(self):
        self.doomed = False  # the response is one to cut
        self.sent = 0  # response bytes forwarded since the request


class CuttingProxy:
    def __init__(self, upstream: str, *, after: int, cuts: int = 1, cut_if: Callable[[bytes], bool] = pack_get,
                 on_cut: Callable[[], None] = lambda: None):  # fmt: skip
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self._upstream = (host, int(port))
        self.after, self._cuts_left, self._cut_if = after, cuts, cut_if
        self._on_cut = on_cut  # runs before the client sees the cut: what changes then, its resume sees
        self.cut = 0  # responses cut so far
        self.ranged_gets = 0  # requests `cut_if` matched (each resume is one more)
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._open: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="cutting-proxy", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            ready, _, _ = select.select([self._listener, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            client, _ = self._listener.accept()
            upstream = socket.create_connection(self._upstream)
            with self._lock:
                self._open += [client, upstream]
            exchange = _Exchange()
            for target in (self._requests, self._responses):
                threading.Thread(target=target, args=(client, upstream, exchange), daemon=True).start()

    def _requests(self, client: socket.socket, upstream: socket.socket, exchange: _Exchange) -> None:
        while chunk := _recv(client):
            if _REQUEST_LINE.match(chunk):
                with self._lock:  # before forwarding: the response cannot start earlier
                    exchange.doomed = self._cut_if(chunk)
                    exchange.sent = 0
                    self.ranged_gets += exchange.doomed
            if not _send(upstream, chunk):
                break
        _close(upstream)

    def _responses(self, client: socket.socket, upstream: socket.socket, exchange: _Exchange) -> None:
        cutting = False
        while chunk := _recv(upstream):
            with self._lock:
                cutting = exchange.doomed and self._cuts_left > 0 and exchange.sent + len(chunk) > self.after
                if cutting:
                    self._cuts_left -= 1
                    self.cut += 1
                    chunk = chunk[: self.after - exchange.sent]
                exchange.sent += len(chunk)
            if not _send(client, chunk):
                break
            if cutting:
                self._on_cut()
                break
        _close(client, reset=cutting)
        _close(upstream)

    def close(self) -> None:
        self._wake_w.send(b"x")
        self._thread.join()
        with self._lock:
            for sock in self._open:
                _close(sock)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> CuttingProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(256 * 1024)
    except OSError:
        return b""


def _send(sock: socket.socket, data: bytes) -> bool:
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False


def _close(sock: socket.socket, reset: bool = False) -> None:
    """Close `sock`, waking the thread that reads it; with `reset`, the peer gets a RST, not a FIN."""
    try:
        if reset:  # SO_LINGER 0: as a dropped NAT entry or a dying load balancer would
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.shutdown(socket.SHUT_RD)
        else:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
