"""An HTTP server on 127.0.0.1 that answers the way a hostile or broken server would.

Written on raw sockets so that it can do what no well-behaved server library allows: claim a 2 GB
body, stream chunks forever, send one byte at a time, redirect a POST. Each route is a function
(server, sock, request) that writes the raw answer; GET /health and /v1/models answer 200 unless a
route replaces them. `sent` counts the bytes every answer wrote, `requests` lists (method, path).
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: bytes


Route = Callable[["HostileServer", socket.socket, Request], None]


class HostileServer:
    def __init__(self, routes: dict[str, Route]):
        self.routes = {"GET /health": ok({}), "GET /v1/models": ok({"data": [{"id": "m"}]}), **routes}
        self.stop = threading.Event()
        self.sent = 0
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._accepting = threading.Thread(target=self._accept, daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        while not self.stop.is_set():
            conn, _ = self._listener.accept()
            if self.stop.is_set():
                conn.close()
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            request = read_request(conn)
            if request is None:
                return
            with self._lock:
                self.requests.append((request.method, request.path))
            route = self.routes.get(f"{request.method} {request.path}", not_found)
            try:
                route(self, conn, request)
            except OSError:  # the client hung up: what these tests want it to do
                pass

    def send(self, conn: socket.socket, data: bytes) -> None:
        conn.sendall(data)
        with self._lock:
            self.sent += len(data)

    def close(self) -> None:
        self.stop.set()
        socket.create_connection(self._listener.getsockname()).close()  # wakes the blocked accept()
        self._accepting.join()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=10)

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_request(conn: socket.socket) -> Request | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = next(
        (int(v) for k, _, v in (line.partition(":") for line in lines[1:]) if k.lower() == "content-length"), 0
    )
    while len(body) < length:
        body += conn.recv(65536)
    return Request(method, path, body)


def answer(status: str, doc: object, extra: str = "") -> bytes:
    body = json.dumps(doc).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}"
            "Connection: close\r\n\r\n").encode() + body  # fmt: skip


def ok(doc: object) -> Route:
    return lambda server, conn, request: server.send(conn, answer("200 OK", doc))


def not_found(server: HostileServer, conn: socket.socket, request: Request) -> None:
    server.send(conn, answer("404 Not Found", {"error": "not found"}))


COMPLETION = {"choices": [{"index": 0, "text": " x", "finish_reason": "length"}]}


def huge_body(server: HostileServer, conn: socket.socket, request: Request) -> None:
    """Claims 2 GB and streams zeros until the client stops reading."""
    server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2147483648\r\n\r\n")
    while not server.stop.is_set():
        server.send(conn, b"0" * 65536)


def endless_chunks(server: HostileServer, conn: socket.socket, request: Request) -> None:
    """A chunked body that never ends (no Content-Length to refuse up front)."""
    server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n" % 65536 + b" " * 65536 + b"\r\n"
    while not server.stop.is_set():
        server.send(conn, chunk)


def trickle(data: bytes, interval: float = 0.05) -> Route:
    """Sends `data` one byte per `interval`: every read finishes fast, the whole takes long."""

    def route(server: HostileServer, conn: socket.socket, request: Request) -> None:
        for i in range(len(data)):
            if server.stop.wait(interval):
                return
            server.send(conn, data[i : i + 1])

    return route


def redirect(location: str, status: str = "302 Found") -> Route:
    return lambda server, conn, request: server.send(conn, answer(status, {}, f"Location: {location}\r\n"))


def fail_then_ok(failures: int, status: str = "503 Service Unavailable") -> Route:
    """Answers `status` to the first `failures` requests, then a completion."""
    count = {"n": 0}

    def route(server: HostileServer, conn: socket.socket, request: Request) -> None:
        with server._lock:
            count["n"] += 1
            failing = count["n"] <= failures
        server.send(conn, answer(status, {"error": "busy"}) if failing else answer("200 OK", COMPLETION))

    return route
