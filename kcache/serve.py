"""HTTP endpoints for probes and Prometheus, read from the markers under a restore root.

    GET /healthz   200 "ok" while the process is up
    GET /readyz    200 or 503 by kcache.readiness.check, with a JSON body: the verdict and each signal
                   (with --health-url, the model server's health check is one of them)
    GET /metrics   Prometheus text format 0.0.4 (kcache.metrics)

Every request reads the markers afresh (three small JSON files), so the server holds no state
and never disagrees with `kcache ready`. Stdlib only: the sidecar image stays small.

The server must keep answering the kubelet while anything else on the network misbehaves:

    accept ──► selector (one thread) ──► /readyz, /metrics ──► worker pool (WORKERS threads,
      ▲        reads each request head            │            at most MAX_QUEUED requests
      │        within IDLE_TIMEOUT s of accept,   │            waiting or running; past that
      │        at most MAX_CONNECTIONS open       │            503 "busy" at once): reads the
      │        (the oldest is dropped first)      │            markers (and the engine)
      │                                           ▼                        │
      │        /healthz, 404, 405, 400, 431 ──► writer (the selector) ◄────┘
      └─────── closes                           sends without blocking, the whole answer
                                                within WRITE_TIMEOUT s
Idle, trickling or non-reading clients cost a socket, never a thread, and /healthz never waits
for the markers or the engine. Every answer closes its connection (probes open a new one
anyway). A request that ends badly (reset, timeout, oversized head, refused as busy) is one log
line, never a traceback; an error in one connection's event costs that connection only. Should
the selector loop itself fail, `failure` says why and start_in_thread's `stopped` event is set:
a process must not go on with a dead probe port.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import json
import logging
import os
import queue
import selectors
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

from kcache import metrics, readiness
from kcache.errors import ConfigError, KcacheError
from kcache.http_client import printable

log = logging.getLogger(__name__)

WORKERS = 4
MAX_QUEUED = 16  # /readyz and /metrics requests waiting for or held by a worker
IDLE_TIMEOUT = 10.0  # seconds from accept to a complete request head
WRITE_TIMEOUT = 5.0  # seconds from a ready answer to its last byte sent
MAX_CONNECTIONS = 512  # reading a request or writing an answer
MAX_HEAD = 8 * 1024
BACKLOG = 128
TEXT = "text/plain; charset=utf-8"


def answer(root: Path, method: str, target: str,
           engine: readiness.EngineHealth | None = None) -> tuple[int, str, bytes]:  # fmt: skip
    """(status, content type, body) for one request; pure apart from reading the markers (and, with
    `engine`, asking the model server's health URL for /readyz and /metrics)."""
    static = static_answer(method, target)
    if static is not None:
        return static
    if target.split("?", 1)[0] == "/readyz":
        state = readiness.check(root, engine)
        return 200 if state.ready else 503, "application/json", json.dumps(readiness.to_dict(state)).encode() + b"\n"
    return 200, metrics.CONTENT_TYPE, metrics.render(metrics.collect(root, engine)).encode()


def static_answer(method: str, target: str) -> tuple[int, str, bytes] | None:
    """The answer when it needs neither the markers nor the engine; None for /readyz and /metrics."""
    if method not in ("GET", "HEAD"):
        return 405, TEXT, b"only GET and HEAD\n"
    path = target.split("?", 1)[0]
    if path == "/healthz":
        return 200, TEXT, b"ok\n"
    if path in ("/readyz", "/metrics"):
        return None
    return 404, TEXT, b"not found: try /healthz, /readyz or /metrics\n"


@dataclass
class _Conn:
    addr: str
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    target: str = ""
    out: memoryview = field(default_factory=lambda: memoryview(b""))  # what is left to send


class ProbeServer:
    failure: Exception | None = None  # why serve_forever ended, when not by shutdown()

    def __init__(self, address: tuple[str, int], root: Path, *, workers: int = WORKERS,
                 idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 max_queued: int = MAX_QUEUED, engine: readiness.EngineHealth | None = None):  # fmt: skip
        self.root, self.engine = Path(root), engine
        self.idle_timeout, self.max_connections, self.max_queued = idle_timeout, max_connections, max_queued
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        # "::" alone would take IPv6 only, and the kubelet probes the pod's IPv4 address
        dualstack = family == socket.AF_INET6 and _unspecified(address[0]) and socket.has_dualstack_ipv6()
        self._listener = socket.create_server(address, family=family, backlog=BACKLOG, dualstack_ipv6=dualstack)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kcache-probe")
        self._slots = threading.Semaphore(max_queued)
        self._answers: queue.SimpleQueue = queue.SimpleQueue()  # (conn, _Conn, data) from the workers
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # insertion order = deadline order, as each dict's timeout is fixed
        self._reading: dict[socket.socket, _Conn] = {}
        self._writing: dict[socket.socket, _Conn] = {}
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
                    self._handle(key.fileobj)
                self._expire()
        finally:
            self._selector.unregister(self._listener)
            self._selector.unregister(self._wake_r)
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serve_forever and wait for it to return (as socketserver's shutdown does)."""
        self._stop.set()
        self._wake()
        self._stopped.wait()

    def server_close(self) -> None:
        """Close every connection; requests still queued for a worker are cancelled, not answered."""
        self._pool.shutdown(wait=True, cancel_futures=True)  # the running ones end within the engine's timeout
        for conn in [*self._reading, *self._writing]:
            self._drop(conn)
        while not self._answers.empty():
            self._answers.get_nowait()[0].close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._selector.close()

    def raise_if_failed(self) -> None:
        """KcacheError if serve_forever ended on an error rather than by shutdown()."""
        if self.failure is not None:
            why = self.failure.strerror if isinstance(self.failure, OSError) and self.failure.strerror else self.failure
            raise KcacheError(f"probe server stopped: {type(self.failure).__name__}: {why}")

    def _handle(self, sock) -> None:
        """One select() event."""
        if sock is self._listener:
            self._guarded(sock, self._accept)
        elif sock is self._wake_r:
            self._take_answers()
        elif sock in self._reading:
            self._guarded(sock, self._read, sock)
        elif sock in self._writing:
            self._guarded(sock, self._write, sock)
        # else: dropped earlier in this batch (the oldest, to make room for a new connection)

    def _guarded(self, sock, step, *args) -> None:
        """Whatever goes wrong with one connection costs that connection, never the loop."""
        try:
            step(*args)
        except Exception as exc:
            log.error("probe server: %s in %s: %s", type(exc).__name__, step.__name__, exc)
            log.debug("probe server: %s failed", step.__name__, exc_info=True)
            if sock is not self._listener and sock is not self._wake_r:
                self._drop(sock)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, InterruptedError):  # full: the selector has wake-ups enough to read
            pass

    def _next_expiry(self) -> float:
        deadlines = [next(iter(conns.values())).deadline for conns in (self._reading, self._writing) if conns]
        return max(0.0, min([1.0, *(deadline - time.monotonic() for deadline in deadlines)]))

    def _accept(self) -> None:
        while True:
            try:
                conn, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors, say: keep serving those already open
                log.warning("probe server: cannot accept: %s", exc.strerror or exc)
                return
            open_now = len(self._reading) + len(self._writing)
            if open_now >= self.max_connections:
                oldest = next(iter(self._reading or self._writing))
                state = self._reading.get(oldest) or self._writing[oldest]
                log.warning("probe request from %s dropped: %d connections open", state.addr, open_now)
                self._drop(oldest)
            conn.setblocking(False)
            self._reading[conn] = _Conn(_address(addr), time.monotonic() + self.idle_timeout)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        state = self._reading[conn]
        try:
            data = conn.recv(MAX_HEAD)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort(conn, f"{type(exc).__name__} while reading")
            return
        if not data:
            if state.head:
                self._abort(conn, "closed before the request was complete")
            else:  # a TCP probe: connect, then close
                self._drop(conn)
            return
        state.head += data
        if b"\r\n\r\n" in state.head or len(state.head) > MAX_HEAD:
            self._selector.unregister(conn)
            del self._reading[conn]
            self._dispatch(conn, state)

    def _dispatch(self, conn: socket.socket, state: _Conn) -> None:
        """Answer at once what needs no marker; hand /readyz and /metrics to a worker while one is free
        or MAX_QUEUED allow."""
        head = bytes(state.head)
        method, state.target = _request_line(head)
        if b"\r\n\r\n" not in head:
            quick = 431, TEXT, b"request head too large\n"
        elif not method:
            quick = 400, TEXT, b"bad request line\n"
        else:
            quick = static_answer(method, state.target)
        if quick is None and not self._slots.acquire(blocking=False):
            log.warning("probe request from %s refused: busy, %d requests queued", state.addr, self.max_queued)
            quick = 503, TEXT, b"busy\n"
        if quick is not None:
            self._send(conn, state, _encode(method, *quick))
            return
        future = self._pool.submit(self._respond, conn, state, method)
        future.add_done_callback(lambda done, conn=conn: _close_if_cancelled(done, conn))

    def _respond(self, conn: socket.socket, state: _Conn, method: str) -> None:
        """In a worker: read the markers (and the engine); the selector thread sends the answer."""
        try:
            try:
                status, ctype, body = answer(self.root, method, state.target, self.engine)
            except Exception as exc:  # a marker no code path expected: answer 500, keep serving
                log.warning("probe request %s %s failed: %s: %s", method, state.target, type(exc).__name__, exc)
                status, ctype, body = 500, TEXT, b"internal error; see the server's log\n"
            self._answers.put((conn, state, _encode(method, status, ctype, body)))
        finally:
            self._slots.release()
        self._wake()

    def _take_answers(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass  # drained: the answers queued before the last wake-up are all in the queue
        while not self._answers.empty():
            conn, state, data = self._answers.get_nowait()
            self._guarded(conn, self._send, conn, state, data)

    def _send(self, conn: socket.socket, state: _Conn, data: bytes) -> None:
        state.out, state.deadline = memoryview(data), time.monotonic() + WRITE_TIMEOUT
        self._writing[conn] = state
        self._selector.register(conn, selectors.EVENT_WRITE)
        self._write(conn)  # most answers fit the socket's buffer: sent now, closed now

    def _write(self, conn: socket.socket) -> None:
        state = self._writing[conn]
        try:
            sent = conn.send(state.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._abort(conn, f"{type(exc).__name__} while answering {state.target}")
            return
        state.out = state.out[sent:]
        if not state.out:
            log.debug("%s %s answered", state.addr, state.target)
            self._drop(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for conn, _ in _overdue(self._reading, now):
            self._abort(conn, f"no complete request within {self.idle_timeout:g} s")
        for conn, state in _overdue(self._writing, now):
            self._abort(conn, f"answer not read within {WRITE_TIMEOUT:g} s while answering {state.target}")

    def _abort(self, conn: socket.socket, why: str) -> None:
        state = self._reading.get(conn) or self._writing.get(conn)
        if state is not None:
            log.warning("probe request from %s aborted: %s", state.addr, why)
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        """Close a connection the selector holds, whichever its state; a second call does nothing."""
        if self._reading.pop(conn, None) is not None or self._writing.pop(conn, None) is not None:
            try:
                self._selector.unregister(conn)
            except (KeyError, ValueError):  # never registered (a failed register), or closed already
                pass
        conn.close()


def _overdue(conns: dict[socket.socket, _Conn], now: float) -> list[tuple[socket.socket, _Conn]]:
    """The connections past their deadline: the first ones, as the dict is in deadline order."""
    return list(itertools.takewhile(lambda item: item[1].deadline <= now, conns.items()))


def _close_if_cancelled(future: Future, conn: socket.socket) -> None:
    if future.cancelled():  # server_close: no worker will answer it
        conn.close()


def _encode(method: str, status: int, ctype: str, body: bytes) -> bytes:
    header = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {ctype}\r\n"
              f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    return header if method == "HEAD" else header + body


def _request_line(head: bytes) -> tuple[str, str]:
    """(method, target) of `GET /path HTTP/1.1`; ("", "") when the line is not that shape."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/") or not parts[1].startswith("/"):
        return "", ""
    return printable(parts[0], 16), printable(parts[1])  # they reach the log


def _unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _address(addr) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


def make_server(root: Path, host: str = "127.0.0.1", port: int = 0,
                engine: readiness.EngineHealth | None = None) -> ProbeServer:  # fmt: skip
    """Bind (port 0 picks a free port; read it from `.port`). Raises ConfigError if the address is taken
    or the host name does not resolve."""
    try:
        return ProbeServer((host, port), root, engine=engine)
    except (UnicodeError, TypeError):  # a name IDNA cannot encode (a label past 63, bytes no encoding names)
        raise ConfigError("--host", host, "is not a host name or address") from None
    except OSError as exc:
        raise bind_error(exc, host, port) from None


# What the kernel answers a bind with for an address it will not listen on, the host's fault: taken,
# not this machine's, a privileged port, an address no socket can bind (an IPv6 link-local one without
# its %interface, a multicast one: EINVAL), a family the node has turned off (IPv6 disabled).
_ADDRESS_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES, errno.EINVAL, errno.EAFNOSUPPORT)


def bind_error(exc: OSError, host: str, port: int, flag: str = "--port") -> OSError | ConfigError:
    """The usage error for a bind to host:port that failed with `exc` (`exc` itself when it is none of
    those: a process out of file descriptors is no flag's fault). For `kcache serve`, `watch --port` and
    the proxy alike."""
    # socket.create_server re-raises the resolver's gaierror as a plain OSError with its errno: the
    # EAI_* codes are the negative ones (EAI_NONAME, EAI_AGAIN, ...).
    if isinstance(exc, socket.gaierror) or (exc.errno is not None and exc.errno < 0):
        why = (exc.strerror or str(exc)).split(" (while attempting", 1)[0]
        return ConfigError("--host", host, f"cannot be resolved: {why}")
    if exc.errno not in _ADDRESS_ERRORS:
        return exc
    why = os.strerror(exc.errno)
    if exc.errno == errno.EINVAL and _link_local(host):
        why += " (a link-local IPv6 address needs its interface, e.g. fe80::1%eth0)"
    elif exc.errno == errno.EAFNOSUPPORT:
        why += " (IPv6 is off on this node? 0.0.0.0 listens on IPv4)"
    return ConfigError(f"--host/{flag}", f"[{host}]:{port}" if ":" in host else f"{host}:{port}", why)


def _link_local(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_link_local
    except ValueError:  # a name, or an address with its %scope already
        return False


def serve_until(server: ProbeServer, stop: threading.Event) -> None:
    """Serve in a worker thread until `stop` is set, then shut down and close the socket. Raises
    KcacheError if the server stopped on its own (its loop failed): the probe port is dead."""
    worker = start_in_thread(server, stop)
    try:
        stop.wait()
    finally:
        server.shutdown()
        worker.join()
        server.server_close()
    server.raise_if_failed()


def start_in_thread(server: ProbeServer, stopped: threading.Event | None = None) -> threading.Thread:
    """Serve in a daemon thread; the caller stops it with server.shutdown(). `stopped` is set when
    serve_forever returns, by shutdown() or because it failed (`server.failure` then says why)."""

    def run() -> None:
        try:
            server.serve_forever()
        except Exception as exc:
            server.failure = exc
            log.error("probe server stopped: %s: %s", type(exc).__name__, exc)
            log.debug("probe server stopped", exc_info=True)
        finally:
            if stopped is not None:
                stopped.set()

    worker = threading.Thread(target=run, name="kcache-serve", daemon=True)
    worker.start()
    return worker
