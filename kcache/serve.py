"""HTTP endpoints for probes and Prometheus, read from the markers under a restore root.

    GET /healthz   200 "ok" while the process is up
    GET /readyz    200 or 503 by kcache.readiness.check, with a JSON body: {"ready", "reason", ...}
    GET /metrics   Prometheus text format 0.0.4 (kcache.metrics)

Every request reads the markers afresh (three small JSON files), so the server holds no state
and never disagrees with `kcache ready`. Stdlib only: the sidecar image stays small.
"""

from __future__ import annotations

import errno
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from kcache import metrics, readiness
from kcache.errors import ConfigError

log = logging.getLogger(__name__)


class ProbeServer(ThreadingHTTPServer):
    daemon_threads = True  # a hung client must not hold up shutdown

    def __init__(self, address: tuple[str, int], root: Path):
        self.root = Path(root)
        super().__init__(address, _Handler)

    @property
    def port(self) -> int:
        return self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    server: ProbeServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            self._send(200, "text/plain; charset=utf-8", b"ok\n")
        elif path == "/readyz":
            state = readiness.check(self.server.root)
            body = readiness.to_dict(state)
            self._send(200 if state.ready else 503, "application/json", json.dumps(body).encode() + b"\n")
        elif path == "/metrics":
            self._send(200, metrics.CONTENT_TYPE, metrics.render(metrics.collect(self.server.root)).encode())
        else:
            self._send(404, "text/plain; charset=utf-8", b"not found: try /healthz, /readyz or /metrics\n")

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # probes every few seconds: debug, not stderr
        log.debug("%s %s", self.address_string(), format % args)


def make_server(root: Path, host: str = "127.0.0.1", port: int = 0) -> ProbeServer:
    """Bind (port 0 picks a free port; read it from `.port`). Raises ConfigError if the address is taken."""
    try:
        return ProbeServer((host, port), root)
    except OSError as exc:
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
