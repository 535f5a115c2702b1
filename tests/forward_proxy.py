"""A plain HTTP forward proxy (what HTTP_PROXY names) for reads: it sends every request to one upstream
address whatever host the request names, with that host in the Host header, and records the hosts.

A virtual-hosted S3 request names `<bucket>.localhost:<port>`, which no resolver here answers: through
this proxy it still reaches the test's S3 server, which reads the bucket from the Host header.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class ForwardProxy:
    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.hosts: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                target = urlsplit(self.path)  # an absolute URI: a client talking to a proxy
                proxy.hosts.append(target.netloc)
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() != "proxy-connection"}
                    path = target.path + (f"?{target.query}" if target.query else "")
                    conn.request(self.command, path, headers=headers)
                    answer = conn.getresponse()
                    body = answer.read()
                finally:
                    conn.close()
                self.send_response(answer.status, answer.reason)
                for name, value in answer.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                # A HEAD's length is the object's, as the upstream said; a body's is what was read.
                length = answer.getheader("Content-Length", "0") if self.command == "HEAD" else len(body)
                self.send_header("Content-Length", str(length))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = _forward

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ForwardProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
