"""--health-url: readiness also asks the model server, so a model container that restarted (its
markers from the first start still say ready) takes no traffic until it answers again."""

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from click.testing import CliRunner
from hanging_server import SilentServer
from openai_server import OpenAIServer

from kcache import metrics, readiness
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.errors import ConfigError
from kcache.readiness import RESTORE_MARKER, WARMUP_MARKER, EngineHealth, write_marker
from kcache.serve import make_server, start_in_thread


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.fixture
def warmed(tmp_path):
    """A root whose markers say ready: restore hit, warmup ok (what the first start left behind)."""
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": "k", "detail": ""})
    write_marker(tmp_path, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
    return tmp_path


def serving(root, health_url):
    server = make_server(root, "127.0.0.1", 0, engine=EngineHealth(health_url, fresh=0))  # each GET asks again
    start_in_thread(server)
    return server, f"http://127.0.0.1:{server.port}"


def test_readyz_follows_the_engine_once_the_markers_say_ready(warmed):
    with OpenAIServer() as engine:
        server, url = serving(warmed, engine.url + "/health")
        try:
            code, body = get(url + "/readyz")
            assert code == 200, body
            assert json.loads(body)["signals"]["engine"] == {"ok": True, "detail": f"GET {engine.url}/health: 200 OK"}
            engine.close()  # the model container died; the kubelet restarts it, the markers stay
            code, body = get(url + "/readyz")
            doc = json.loads(body)
            assert code == 503 and not doc["ready"] and doc["signals"]["engine"]["ok"] is False
            assert doc["reason"].startswith(f"the model server is not healthy: GET {engine.url}/health")
            metrics = get(url + "/metrics")[1]
            assert "kcache_ready 0" in metrics and 'kcache_ready_signal{signal="engine"} 0' in metrics
        finally:
            server.shutdown()
            server.server_close()


def test_an_unhealthy_answer_is_not_ready_even_when_warmup_allowed_ready_cold(tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": "k", "detail": ""})
    write_marker(tmp_path, WARMUP_MARKER, {"status": "failed", "on_failure": "ready-cold", "profiles": [],
                                           "signals": {"weights": True, "graphs": False}})  # fmt: skip
    assert readiness.check(tmp_path).ready  # ready (cold) by the markers alone
    with OpenAIServer(unhealthy=-1) as engine:
        state = readiness.check(tmp_path, EngineHealth(engine.url + "/health"))
    assert not state.ready and not state.cold
    assert state.reason == f"the model server is not healthy: GET {engine.url}/health: 503 Service Unavailable"


def test_the_markers_still_decide_first(tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": "k", "detail": ""})
    with OpenAIServer() as engine:
        state = readiness.check(tmp_path, EngineHealth(engine.url + "/health"))
    assert not state.ready and state.reason == "warmup has not completed"
    assert state.signal("engine").ok  # reported apart all the same


def test_an_engine_that_never_answers_costs_the_probe_its_timeout_only(warmed):
    silent = SilentServer()
    try:
        state = readiness.check(warmed, EngineHealth(silent.url + "/health", timeout=0.2))
    finally:
        silent.close()
    assert not state.ready and "no complete answer within 0.2 s" in state.reason


def test_ready_command_takes_the_health_url(warmed):
    runner = CliRunner()
    with OpenAIServer() as engine:
        healthy = runner.invoke(main, ["ready", "--root", str(warmed), "--health-url", engine.url + "/health"])
    down = runner.invoke(main, ["ready", "--root", str(warmed), "--health-url", engine.url + "/health", "--json"])
    assert healthy.exit_code == 0, healthy.output
    assert down.exit_code == ExitCode.NOT_READY, down.output
    assert json.loads(down.output)["signals"]["engine"]["ok"] is False


@pytest.mark.parametrize("command", [["ready"], ["serve", "--port", "0"], ["watch", "--port", "0"]])
@pytest.mark.parametrize("bad", ["localhost:8000/health", "ftp://h/health", "http://h:99999/health", ""])
def test_a_health_url_that_is_no_http_url_is_a_usage_error(tmp_path, command, bad):
    result = CliRunner().invoke(main, [*command, "--root", str(tmp_path), "--health-url", bad])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "--health-url" in result.output


class GatedEngine:
    """A /health that counts its GETs and answers each 200 only once `release` is set."""

    def __init__(self):
        self.gets, self.arrived, self.release = 0, threading.Event(), threading.Event()
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                with owner._lock:
                    owner.gets += 1
                owner.arrived.set()
                owner.release.wait(10)  # released by the test (10 s: a bound, not a pause)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self):
        self.release.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def test_concurrent_checks_share_one_get():
    engine = GatedEngine()
    health = EngineHealth(engine.url + "/health")
    answers = []
    try:
        with ThreadPoolExecutor(8) as pool:
            first = pool.submit(health)
            assert engine.arrived.wait(10)  # the first check's GET is at the server, held there
            rest = [pool.submit(health) for _ in range(7)]
            engine.release.set()
            answers = [f.result(timeout=10) for f in [first, *rest]]
        again = health()  # within the freshness window: the same answer, no new GET
    finally:
        engine.close()
    assert engine.gets == 1
    assert answers == [(True, f"GET {engine.url}/health: 200 OK")] * 8 and again == answers[0]


def test_a_check_without_a_freshness_window_asks_every_time():
    with OpenAIServer() as engine:
        health = EngineHealth(engine.url + "/health", fresh=0)
        assert health()[0] and health()[0]
    assert engine.health_checks == 2


def test_a_silent_engine_fails_the_check_before_the_kubelet_probe_times_out(warmed):
    silent = SilentServer()
    started = time.monotonic()
    try:
        state = readiness.check(warmed, EngineHealth(silent.url + "/health"))  # the default timeout
    finally:
        silent.close()
    assert time.monotonic() - started < 1.0, "the kubelet's default timeoutSeconds is 1"
    assert not state.ready and f"no complete answer within {readiness.ENGINE_TIMEOUT:g} s" in state.reason


def test_the_health_url_is_requested_as_written(warmed):
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(200 if self.path in ("/v2/health/ready/", "/status?format=json") else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        slash = readiness.check(warmed, EngineHealth(base + "/v2/health/ready/"))
        query = readiness.check(warmed, EngineHealth(base + "/status?format=json"))
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["/v2/health/ready/", "/status?format=json"]
    assert slash.ready and query.ready


def test_a_health_url_with_a_user_or_password_is_refused_not_ignored(tmp_path):
    with pytest.raises(ConfigError) as caught:
        EngineHealth("http://user:s3cret@127.0.0.1:8000/health")
    assert caught.value.what == "--health-url"
    result = CliRunner().invoke(main, ["ready", "--root", str(tmp_path),
                                       "--health-url", "http://user:s3cret@127.0.0.1:8000/health"])  # fmt: skip
    assert result.exit_code == ExitCode.USAGE and "--health-url" in result.output
    assert "s3cret" not in result.output


@pytest.mark.parametrize("bad", ["http://[::1/health", "http://a..b:8000/health"])
def test_a_malformed_health_url_is_a_usage_error(tmp_path, bad):
    result = CliRunner().invoke(main, ["ready", "--root", str(tmp_path), "--health-url", bad])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "--health-url" in result.output


@pytest.mark.parametrize("bad", ["http://[::1:8000", "http://a..b:8000"])
def test_a_malformed_warmup_url_is_a_usage_error(tmp_path, bad):
    """As for any other bad --url (`localhost:8000`): exit 2 before warmup starts; the marker says the
    warmup failed and why (readiness had waited for good for a marker that never came)."""
    result = CliRunner().invoke(main, ["warmup", "--url", bad, "--root", str(tmp_path), "--wait-timeout", "1"])
    assert result.exit_code == ExitCode.USAGE, result.output
    marker = readiness.read_marker(tmp_path, WARMUP_MARKER)
    assert "--url" in result.output and marker["status"] == "failed" and "--url" in marker["error"]


def test_ready_cold_counts_a_healthy_engine_as_loaded_weights(tmp_path):
    """The server loaded after warmup's --wait-timeout: the failed marker says weights false for good."""
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": "k", "detail": ""})
    write_marker(tmp_path, WARMUP_MARKER, {"status": "failed", "on_failure": "ready-cold", "profiles": [],
                                           "signals": {"weights": False, "graphs": False}})  # fmt: skip
    assert not readiness.check(tmp_path).ready
    with OpenAIServer() as engine:
        state = readiness.check(tmp_path, EngineHealth(engine.url + "/health"))
    assert state.ready and state.cold and state.signal("weights").ok
    with OpenAIServer(unhealthy=-1) as engine:
        sick = readiness.check(tmp_path, EngineHealth(engine.url + "/health"))
    assert not sick.ready and sick.reason == "warmup failed (weights not loaded)"


def test_without_ready_cold_a_healthy_engine_does_not_undo_a_failed_warmup(tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": "k", "detail": ""})
    write_marker(tmp_path, WARMUP_MARKER, {"status": "failed", "on_failure": "unready", "profiles": [],
                                           "signals": {"weights": False, "graphs": False}})  # fmt: skip
    with OpenAIServer() as engine:
        state = readiness.check(tmp_path, EngineHealth(engine.url + "/health"))
    assert not state.ready and not state.signal("weights").ok


def test_marker_strings_are_bounded_in_readyz_and_metrics(tmp_path):
    huge = "x" * (1024 * 1024)
    write_marker(tmp_path, RESTORE_MARKER, {"status": huge, "bundle_key": huge})
    write_marker(tmp_path, WARMUP_MARKER, {"status": huge, "expires_at": huge, "signals": {"weights": True}})
    write_marker(tmp_path, readiness.WATCH_MARKER, {"new_files": {huge: 1}, "new_bytes": {huge: 2}})
    answer = json.dumps(readiness.to_dict(readiness.check(tmp_path)))
    scrape = metrics.render(metrics.collect(tmp_path))
    assert len(answer) < 4096 and len(scrape) < 8192, (len(answer), len(scrape))
    write_marker(tmp_path, WARMUP_MARKER, {"status": ["not", "a", "string"] * 100000})
    assert len(json.dumps(readiness.to_dict(readiness.check(tmp_path)))) < 4096


def test_watch_help_says_the_health_url_is_for_the_port_server():
    (option,) = [p for p in main.commands["watch"].params if p.name == "health_url"]
    assert "--port" in option.help


def test_metrics_help_texts_cover_ready_cold_and_the_engine():
    lines = metrics.render(metrics.collect(Path("/nonexistent"))).splitlines()
    (ready_help,) = [line for line in lines if line.startswith("# HELP kcache_ready ")]
    assert "ready-cold" in ready_help and "--health-url" in ready_help
    assert "ok | failed | running" in metrics.__doc__
