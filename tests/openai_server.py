"""A small OpenAI-compatible server on 127.0.0.1, port 0, for warmup tests.

Speaks just enough of vLLM's API: GET /health, GET /v1/models, POST /v1/completions. Behaviour is
set per instance: `fail_status` answers completions with that status, `hold` makes completions
wait on a threading.Event (released by `close`), `unhealthy` answers /health 503 that many times
before 200 (-1: forever), `no_health` answers /health 404 like a server without it, and
`compile_into` writes one file per new request shape there, as a compiling server would. A request
naming another model than MODEL is answered 404, as vLLM does.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class OpenAIServer:
    MODEL = "tiny-test-model"
    ADAPTERS: tuple[str, ...] = ()  # listed after MODEL by /v1/models, as vLLM lists its LoRA adapters
    HEALTHY = 200  # the status of a healthy /health (204: no body, as some servers answer)

    def __init__(self, *, fail_status: int | None = None, hold: bool = False, unhealthy: int = 0,
                 no_health: bool = False, compile_into: Path | None = None, port: int = 0):  # fmt: skip
        self.fail_status, self.hold, self.unhealthy, self.no_health = fail_status, hold, unhealthy, no_health
        self.compile_into = compile_into
        self.release = threading.Event()
        self.arrived = threading.Event()  # set when the first completion request has arrived
        self.completions: list[dict] = []  # request bodies, in arrival order
        self.health_checks = 0
        self.checked = threading.Event()  # set when the first health check has arrived
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())  # port: 0 for a free one
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> OpenAIServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.release.set()  # let held handlers finish so shutdown does not wait on them
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def _send(self, status: int, doc: dict) -> None:
                body = json.dumps(doc).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                    pass

            def do_GET(self) -> None:
                if self.path == "/health":
                    with owner._lock:
                        owner.health_checks += 1
                        owner.checked.set()
                        sick = owner.unhealthy < 0 or owner.health_checks <= owner.unhealthy
                    if owner.no_health:
                        self._send(404, {"error": "not found"})
                    elif not sick and owner.HEALTHY == 204:
                        self.send_response(204)
                        self.end_headers()
                    else:
                        self._send(503 if sick else owner.HEALTHY, {})
                elif self.path == "/v1/models":
                    listed = [{"id": name, "object": "model"} for name in (owner.MODEL, *owner.ADAPTERS)]
                    self._send(200, {"object": "list", "data": listed})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner._lock:
                    owner.completions.append(body)
                    owner.arrived.set()
                    if owner.compile_into is not None:
                        shape = f"{len(body['prompt'].split())}-{body['max_tokens']}"
                        (owner.compile_into / f"kernel-{shape}.so").write_text(shape)
                if owner.hold:
                    owner.release.wait()
                if owner.fail_status:
                    self._send(owner.fail_status, {"error": {"message": "engine exploded"}})
                    return
                if body.get("model", owner.MODEL) != owner.MODEL:  # as vLLM answers a model it does not serve
                    self._send(404, {"error": {"message": f"The model `{body['model']}` does not exist."}})
                    return
                text = " x" * int(body["max_tokens"])
                self._send(200, {"object": "text_completion", "model": body.get("model"),
                                 "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})  # fmt: skip

        return Handler
