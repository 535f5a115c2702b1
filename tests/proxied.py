"""Helpers for the proxy tests: a Proxy on its own event-loop thread, a plain HTTP client that keeps
the raw bytes, /metrics parsing, and a private redis-server that a test may stop or kill."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from kcache.proxy.server import Proxy, ProxyConfig


class RunningProxy:
    """A Proxy serving on 127.0.0.1 from a daemon thread's event loop; a context manager."""

    def __init__(self, config: ProxyConfig):
        self.proxy = Proxy(config)
        self.loop = asyncio.new_event_loop()
        self.port = self.loop.run_until_complete(self.proxy.start("127.0.0.1", 0))
        self.metrics_port = self.proxy.metrics_port
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def __enter__(self) -> RunningProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.run_until_complete(self.proxy.close())
        self.loop.close()

    def post(self, path: str, doc: dict, headers: dict | None = None) -> Reply:
        return request(self.port, "POST", path, json.dumps(doc).encode(), headers)

    def get(self, path: str) -> Reply:
        return request(self.port, "GET", path)

    def metric(self, name: str, **labels: str) -> float:
        reply = request(self.metrics_port, "GET", "/metrics")
        assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain; version=0.0.4")
        return metric(reply.body.decode(), name, **labels)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes  # de-chunked: exactly the bytes the sender framed

    def json(self) -> dict:
        return json.loads(self.body)


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text; 0 when the series is absent (counters start absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(want) + r"\}" if want else "") + r" (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def metrics_port_of(proc) -> int:
    """The metrics port `kcache proxy`'s start line names (tests/served.py keeps the line)."""
    return int(re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", proc.start_line)[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """redis-server on a free port with its files in `workdir`, for tests that stop or kill it; `args`
    are more of redis-server's options (`--rename-command A B`: a Redis that answers A as B would)."""

    def __init__(self, workdir: Path, *args: str):
        if shutil.which("redis-server") is None:
            pytest.skip("redis-server is not installed")
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(workdir),
             "--save", "", "--appendonly", "no", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._wait_until_ready()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _wait_until_ready(self) -> None:
        """Until redis-server logs that it accepts connections (it ends its output if it cannot start);
        the rest of its log is drained on a thread, so a full pipe never stops it."""
        seen = []
        for line in self.proc.stdout:
            if b"Ready to accept connections" in line:
                threading.Thread(target=self.proc.stdout.read, daemon=True).start()
                return
            seen.append(line.decode(errors="replace"))
        raise RuntimeError(f"redis-server on port {self.port} did not start: {''.join(seen[-5:])}")

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)  # alive but silent: a slow or black-holed Redis

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.kill()
