"""Network endpoints that misbehave, on 127.0.0.1, each running in threads and closed at teardown.

SilentServer     accepts TCP connections and never answers (a wedged load balancer)
S3FaultProxy     forwards to a real S3 endpoint, but pack reads (or others) stall, trickle or are cut mid-body
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class SilentServer:
    """Accepts every connection and holds it open without sending a byte."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, name="silent-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            ready, _, _ = select.select([self._listener, self._wake_r], [], [])
            if self._wake_r in ready:
                return
            conn, _ = self._listener.accept()
            self._held.append(conn)
            self.accepted.set()

    def close(self) -> None:
        self._wake_w.send(b"x")
        self._thread.join()
        for conn in self._held:
            conn.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class S3FaultProxy:
    """An HTTP proxy in front of `upstream` (moto) that damages GETs of pack objects.

    mode "stall-headers": the pack request is never answered.
    mode "stall-body":    headers and half the body are sent, then nothing more.
    mode "cut":           headers and half the body are sent, then the connection is closed.
    mode "trickle":       headers, then the body a byte every `interval` s: no read ever times out.
    `damaged`: the part of a GET's path that picks it (a manifest's "/manifests/", say).
    Stalled handlers wait on `release`, which close() sets; a trickle then sends the rest at once.
    """

    def __init__(self, upstream: str, mode: str, damaged: str = "/packs/", interval: float = 0.2):
        self.mode = mode
        self.release = threading.Event()
        self.pack_requests = threading.Event()
        host, port = upstream.removeprefix("http://").split(":")
        proxy, damaged_part = self, damaged

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._forward(send_body=False)

            def do_GET(self) -> None:
                self._forward(send_body=True)

            def _forward(self, send_body: bool) -> None:
                upstream_conn = http.client.HTTPConnection(host, int(port), timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                upstream_conn.request(self.command, self.path, headers=headers)
                response = upstream_conn.getresponse()
                body = response.read()
                upstream_conn.close()
                damaged = send_body and damaged_part in self.path and response.status < 300
                if damaged:
                    proxy.pack_requests.set()
                    if proxy.mode == "stall-headers":
                        proxy.release.wait()
                        self.close_connection = True
                        return
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(name, value)
                length = len(body) if send_body else int(response.getheader("Content-Length") or 0)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if not send_body:
                    return
                if not damaged:
                    self.wfile.write(body)
                    return
                if proxy.mode == "trickle":
                    for at in range(len(body)):
                        proxy.release.wait(interval)
                        self.wfile.write(body[at : at + 1] if not proxy.release.is_set() else body[at:])
                        self.wfile.flush()
                        if proxy.release.is_set():
                            break
                    return
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                if proxy.mode == "stall-body":
                    proxy.release.wait()
                self.close_connection = True

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> S3FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
