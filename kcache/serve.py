"""HTTP endpoints for probes and Prometheus, read from the markers under a restore root.

    GET /healthz   200 "ok" while the process is up
    GET /readyz    200 or 503 by kcache.readiness.check, with a JSON body: the verdict and each signal
                   (with --health-url, the model server's health check is one of them)
    GET /metrics   Prometheus text format 0.0.4 (kcache.metrics)

Every request reads the markers afresh (three small JSON files), so the server holds no state
and never disagrees with `kcache ready`. Stdlib only: the sidecar image stays small.

The server must keep answering the kubelet while anything else on the network misbehaves:

    accept ──► selector (one thread) ──► complete request head? ──► worker pool (WORKERS threads)
               holds idle and slow connections,                      reads markers, writes the
               each for at most IDLE_TIMEOUT s                       answer, closes
               from accept, at most MAX_CONNECTIONS
               (the oldest is dropped first)

Idle or trickling clients cost a socket, never a thread, so a probe that sends its request at
once is answered at once. Every answer closes its connection (probes open a new one anyway). A
request that ends badly (reset, timeout, oversized head) is one log line, never a traceback.
"""

from __future__ import annotations

import errno
import json
import logging
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from kcache import metrics, readiness
from kcache.errors import ConfigError
from kcache.http_client import printable

log = logging.getLogger(__name__)

WORKERS = 4
IDLE_TIMEOUT = 10.0  # seconds from accept to a complete request head
WRITE_TIMEOUT = 5.0
MAX_CONNECTIONS = 512
MAX_HEAD = 8 * 1024
BACKLOG = 128


def answer(root: Path, method: str, target: str,
           engine: readiness.EngineHealth | None = None) -> tuple[int, str, bytes]:  # fmt: skip
    """(status, content type, body) for one request; pure apart from reading the markers (and, with
    `engine`, asking the model server's health URL for /readyz and /metrics)."""
    if method not in ("GET", "HEAD"):
        return 405, "text/plain; charset=utf-8", b"only GET and HEAD\n"
    path = target.split("?", 1)[0]
    if path == "/healthz":
        return 200, "text/plain; charset=utf-8", b"ok\n"
    if path == "/readyz":
        state = readiness.check(root, engine)
        return 200 if state.ready else 503, "application/json", json.dumps(readiness.to_dict(state)).encode() + b"\n"
    if path == "/metrics":
        return 200, metrics.CONTENT_TYPE, metrics.render(metrics.collect(root, engine)).encode()
    return 404, "text/plain; charset=utf-8", b"not found: try /healthz, /readyz or /metrics\n"


@dataclass
class _Pending:
    addr: str
    deadline: float
    head: bytearray = field(default_factory=bytearray)


class ProbeServer:
    def __init__(self, address: tuple[str, int], root: Path, *, workers: int = WORKERS,
                 idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 engine: readiness.EngineHealth | None = None):  # fmt: skip
        self.root, self.engine = Path(root), engine
        self.idle_timeout, self.max_connections = idle_timeout, max_connections
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._listener = socket.create_server(address, family=family, backlog=BACKLOG)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kcache-probe")
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._pending: dict[socket.socket, _Pending] = {}  # insertion order = accept order
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._stopped.set()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def serve_forever(self) -> None:
        self._stopped.clear()
        self._stop.clear()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(timeout=self._next_expiry()):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake_r:
                        self._read(key.fileobj)
                self._expire()
        finally:
            self._selector.unregister(self._listener)
            self._selector.unregister(self._wake_r)
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever and wait for it to return (as socketserver's shutdown does)."""
        self._stop.set()
        self._wake_w.send(b"x")
        self._stopped.wait()

    def server_close(self) -> None:
        for conn in list(self._pending):
            self._drop(conn)
        self._pool.shutdown(wait=True)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    def _next_expiry(self) -> float:
        if not self._pending:
            return 1.0
        oldest = next(iter(self._pending.values())).deadline  # the first accepted expires first
        return max(0.0, min(1.0, oldest - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: keep serving those already open
                log.warning("probe server: cannot accept: %s", exc.strerror or exc)
                return
            if len(self._pending) >= self.max_connections:
                oldest = next(iter(self._pending))
                log.warning("probe request from %s dropped: %d connections open", self._pending[oldest].addr,
                            len(self._pending))  # fmt: skip
                self._drop(oldest)
            conn.setblocking(False)
            self._pending[conn] = _Pending(_address(addr), time.monotonic() + self.idle_timeout)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        pending = self._pending[conn]
        try:
            data = conn.recv(MAX_HEAD)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort(conn, f"{type(exc).__name__} while reading")
            return
        if not data:
            if pending.head:
                self._abort(conn, "closed before the request was complete")
            else:  # a TCP probe: connect, then close
                self._drop(conn)
            return
        pending.head += data
        if b"\r\n\r\n" in pending.head or len(pending.head) > MAX_HEAD:
            self._selector.unregister(conn)
            del self._pending[conn]
            self._pool.submit(self._respond, conn, bytes(pending.head), pending.addr)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, pending in list(self._pending.items()):
            if pending.deadline > now:
                break
            self._abort(conn, f"no complete request within {self.idle_timeout:g} s")

    def _abort(self, conn: socket.socket, why: str) -> None:
        log.warning("probe request from %s aborted: %s", self._pending[conn].addr, why)
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        del self._pending[conn]
        conn.close()

    def _respond(self, conn: socket.socket, head: bytes, addr: str) -> None:
        method, target = _request_line(head)
        if b"\r\n\r\n" not in head:
            status, ctype, body = 431, "text/plain; charset=utf-8", b"request head too large\n"
        elif not method:
            status, ctype, body = 400, "text/plain; charset=utf-8", b"bad request line\n"
        else:
            try:
                status, ctype, body = answer(self.root, method, target, self.engine)
            except Exception as exc:  # a marker no code path expected: answer 500, keep serving
                log.warning("probe request %s %s failed: %s: %s", method, target, type(exc).__name__, exc)
                status, ctype, body = 500, "text/plain; charset=utf-8", b"internal error; see the server's log\n"
        reason = HTTPStatus(status).phrase
        header = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                  "Connection: close\r\n\r\n").encode()  # fmt: skip
        try:
            conn.settimeout(WRITE_TIMEOUT)
            conn.sendall(header if method == "HEAD" else header + body)
            log.debug("%s %s %s %d", addr, method, target, status)
        except OSError as exc:
            log.warning("probe request from %s aborted: %s while answering %s", addr, type(exc).__name__, target)
        finally:
            conn.close()


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, target) of `GET /path HTTP/1.1`; ("", "") when the line is not that shape."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/") or not parts[1].startswith("/"):
        return "", ""
    return printable(parts[0], 16), printable(parts[1])  # they reach the log


def _address(addr) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


def make_server(root: Path, host: str = "127.0.0.1", port: int = 0,
                engine: readiness.EngineHealth | None = None) -> ProbeServer:  # fmt: skip
    """Bind (port 0 picks a free port; read it from `.port`). Raises ConfigError if the address is taken
    or the host name does not resolve."""
    try:
        return ProbeServer((host, port), root, engine=engine)
    except OSError as exc:
        # socket.create_server re-raises the resolver's gaierror as a plain OSError with its
        # errno: the EAI_* codes are the negative ones (EAI_NONAME, EAI_AGAIN, ...).
        if isinstance(exc, socket.gaierror) or (exc.errno is not None and exc.errno < 0):
            why = (exc.strerror or str(exc)).split(" (while attempting", 1)[0]
            raise ConfigError("--host", host, f"cannot be resolved: {why}") from None
        if exc.errno in (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES):
            raise ConfigError("--host/--port", f"{host}:{port}", exc.strerror or str(exc)) from None
        raise


def serve_until(server: ProbeServer, stop: threading.Event) -> None:
    """Serve in a worker thread until `stop` is set, then shut down and close the socket."""
    worker = start_in_thread(server)
    try:
        stop.wait()
    finally:
        server.shutdown()
        worker.join()
        server.server_close()


def start_in_thread(server: ProbeServer) -> threading.Thread:
    """Serve in a daemon thread; the caller stops it with server.shutdown()."""
    worker = threading.Thread(target=server.serve_forever, name="kcache-serve", daemon=True)
    worker.start()
    return worker
