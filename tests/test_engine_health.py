"""--health-url: readiness also asks the model server, so a model container that restarted (its
markers from the first start still say ready) takes no traffic until it answers again."""

import json
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner
from hanging_server import SilentServer
from openai_server import OpenAIServer

from kcache import readiness
from kcache.cli import main
from kcache.cli.errors import ExitCode
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
    server = make_server(root, "127.0.0.1", 0, engine=EngineHealth(health_url))
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
