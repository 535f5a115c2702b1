"""`kcache serve`: real HTTP on 127.0.0.1 port 0, Prometheus text that parses, a clean SIGTERM."""

import json
import logging
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import urllib.error
import urllib.request

import pytest
from click.testing import CliRunner
from served import kcache_server

from kcache import metrics, serve
from kcache.cli import main
from kcache.errors import ConfigError
from kcache.readiness import RESTORE_MARKER, SIGNALS, WARMUP_MARKER, WATCH_MARKER, write_marker
from kcache.serve import make_server, start_in_thread

# name{labels} value, as the 0.0.4 text format writes a sample (no timestamps here)
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def parse(text):
    """{(name, labels): value} for every sample; asserts every line is a comment or a sample."""
    samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        samples[(match[1], match[2] or "")] = float(match[4])
    return samples


@pytest.fixture
def served(tmp_path):
    server = make_server(tmp_path, "127.0.0.1", 0)
    start_in_thread(server)
    yield tmp_path, f"http://127.0.0.1:{server.port}"
    server.shutdown()
    server.server_close()


def test_healthz_and_unknown_paths(served):
    _, url = served
    assert get(url + "/healthz")[0] == 200
    assert get(url + "/nope")[0] == 404


def test_readyz_turns_green_when_the_markers_say_so(served):
    root, url = served
    code, ctype, body = get(url + "/readyz")
    assert code == 503 and ctype == "application/json"
    assert json.loads(body)["reason"] == "restore has not finished"

    write_marker(root, RESTORE_MARKER, {"status": "miss", "bundle_key": "k", "detail": ""})
    code, _, body = get(url + "/readyz")
    assert code == 503 and json.loads(body)["reason"] == "warmup has not completed"

    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 3.5, "profiles": []})
    code, _, body = get(url + "/readyz")
    doc = json.loads(body)
    assert code == 200 and {k: doc[k] for k in ("ready", "reason", "restore", "warmup", "cold")} == {
        "ready": True, "reason": "", "restore": "miss", "warmup": "ok", "cold": False}  # fmt: skip
    assert all(signal["ok"] for signal in doc["signals"].values()) and len(doc["signals"]) == 4


def test_metrics_parse_and_carry_the_required_series(served):
    root, url = served
    code, ctype, text = get(url + "/metrics")
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
    assert parse(text) == {("kcache_ready", ""): 0.0, ("kcache_ready_cold", ""): 0.0,  # nothing else made up
                           **{("kcache_ready_signal", f'{{signal="{s}"}}'): 0.0 for s in SIGNALS}}  # fmt: skip

    write_marker(root, RESTORE_MARKER, {"status": "hit", "bundle_key": "abc", "bundle_id": "b1",
                                        "files": 12, "bytes": 4096, "seconds": 1.25})  # fmt: skip
    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 7.5, "profiles": [{"name": "a"}, {"name": "b"}]})
    write_marker(root, WATCH_MARKER, {"baseline_files": 12, "new_files": {"inductor": 2, "triton": 0},
                                      "new_bytes": {"inductor": 300, "triton": 0}, "publishes": 1,
                                      "publish_errors": 0})  # fmt: skip
    samples = parse(get(url + "/metrics")[2])
    assert samples[("kcache_ready", "")] == 1
    assert all(samples[("kcache_ready_signal", f'{{signal="{s}"}}')] == 1 for s in SIGNALS)
    assert samples[("kcache_restore_info", '{bundle_key="abc",status="hit"}')] == 1
    assert samples[("kcache_restore_files", "")] == 12
    assert samples[("kcache_restore_bytes", "")] == 4096
    assert samples[("kcache_restore_seconds", "")] == 1.25
    assert samples[("kcache_warmup_info", '{status="ok"}')] == 1
    assert samples[("kcache_warmup_seconds", "")] == 7.5
    assert samples[("kcache_warmup_profiles", "")] == 2
    assert samples[("kcache_jit_files_after_ready", '{layer="inductor"}')] == 2
    assert samples[("kcache_jit_files_after_ready", '{layer="triton"}')] == 0
    assert samples[("kcache_watch_publishes_total", "")] == 1
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", get(url + "/metrics")[2], re.M))
    assert types["kcache_watch_publishes_total"] == "counter" and types["kcache_ready"] == "gauge"


def test_metrics_show_which_signal_holds_the_pod_and_a_cold_ready(served):
    root, url = served
    write_marker(root, RESTORE_MARKER, {"status": "miss", "bundle_key": "k"})
    write_marker(root, WARMUP_MARKER, {"status": "running", "signals": {"weights": True, "graphs": False}})
    samples = parse(get(url + "/metrics")[2])
    assert {s: samples[("kcache_ready_signal", f'{{signal="{s}"}}')] for s in SIGNALS} == {
        "restore": 1, "weights": 1, "graphs": 0, "warmup": 0}  # fmt: skip
    assert json.loads(get(url + "/readyz")[2])["reason"] == "warmup running: compiled graphs not done"
    write_marker(root, WARMUP_MARKER, {"status": "failed", "on_failure": "ready-cold",
                                       "signals": {"weights": True, "graphs": False}})  # fmt: skip
    samples = parse(get(url + "/metrics")[2])
    assert samples[("kcache_ready", "")] == 1 and samples[("kcache_ready_cold", "")] == 1
    assert get(url + "/readyz")[0] == 200


def test_label_values_and_help_are_escaped():
    text = metrics.render([metrics.family("x_info", "gauge", "a \\ b\nc", ({"v": 'q"\\\n'}, 1))])
    assert "# HELP x_info a \\\\ b\\nc" in text
    assert parse(text) == {("x_info", '{v="q\\"\\\\\\n"}'): 1}


def test_serve_command_binds_port_zero_and_stops_on_sigterm(tmp_path):
    with kcache_server("serve", "--port", "0", "--root", str(tmp_path)) as (proc, port):
        assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, proc.stderr.read()


def test_port_in_use_is_a_one_line_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = CliRunner().invoke(main, ["serve", "--port", str(taken.getsockname()[1]), "--root", str(tmp_path)])
    assert result.exit_code == 2 and "kcache: error:" in result.stderr and "Traceback" not in result.output


@pytest.mark.parametrize("command", [["serve"], ["watch", "--interval", "1h"]], ids=["serve", "watch"])
def test_a_host_that_does_not_resolve_is_a_usage_error_naming_host(tmp_path, command):
    args = [*command, "--root", str(tmp_path), "--port", "0", "--host", "no.such.host.invalid", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 2 and doc["error"].startswith("--host 'no.such.host.invalid'"), doc


@pytest.mark.parametrize("code", [socket.EAI_NONAME, socket.EAI_AGAIN, socket.EAI_FAIL, socket.EAI_NODATA])
def test_every_resolver_failure_of_the_bind_names_host(tmp_path, monkeypatch, code):
    def unresolvable(address, **_kwargs):  # what socket.create_server raises: a plain OSError
        raise OSError(code, f"Name or service not known (while attempting to bind on address {address!r})")

    monkeypatch.setattr(serve.socket, "create_server", unresolvable)
    with pytest.raises(ConfigError) as caught:
        make_server(tmp_path, "db.example", 0)
    assert caught.value.what == "--host" and caught.value.value == "db.example"
    assert "while attempting" not in caught.value.why


# ---- a server that is hard to starve ---------------------------------------------------------------


class Recorded(logging.Handler):
    """Collects kcache.serve's log lines; `wait(n)` returns once n lines arrived."""

    def __init__(self):
        super().__init__()
        self.lines, self._cond = [], threading.Condition()

    def emit(self, record):
        with self._cond:
            self.lines.append((record.getMessage(), record.exc_info))
            self._cond.notify_all()

    def wait(self, count, timeout=20):
        with self._cond:
            return self._cond.wait_for(lambda: len(self.lines) >= count, timeout)


@pytest.fixture
def recorded():
    handler, logger = Recorded(), logging.getLogger("kcache.serve")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


def open_connections(port, count, send=b""):
    conns = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port), timeout=10)
        if send:
            conn.sendall(send)
        conns.append(conn)
    return conns


@pytest.mark.parametrize("send", [b"", b"GET /readyz HTTP/1.1\r\nX-Slow: "], ids=["idle", "slow-headers"])
def test_hundreds_of_stalled_connections_do_not_starve_probes_or_add_threads(served, send):
    root, url = served
    port = int(url.rsplit(":", 1)[1])
    threads_before = threading.active_count()
    conns = open_connections(port, 300, send)
    try:
        for _ in range(5):
            assert get(url + "/healthz")[0] == 200
        assert get(url + "/readyz")[0] == 503  # answered (not ready yet), not timed out
        assert threading.active_count() <= threads_before + serve.WORKERS
    finally:
        for conn in conns:
            conn.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout(tmp_path, recorded):
    server = serve.ProbeServer(("127.0.0.1", 0), tmp_path, idle_timeout=0.2)
    start_in_thread(server)
    try:
        (conn,) = open_connections(server.port, 1, b"GET /healthz HTTP/1.1\r\n")
        assert conn.recv(100) == b""  # closed by the server, long before the 10 s client timeout
        assert recorded.wait(1)
        assert recorded.lines[0][0].endswith("aborted: no complete request within 0.2 s")
        conn.close()
    finally:
        server.shutdown()
        server.server_close()


def test_aborted_requests_are_one_line_each_without_a_traceback(served, recorded):
    _, url = served
    port = int(url.rsplit(":", 1)[1])
    for conn in open_connections(port, 20, b"GET /metrics HTTP/1.1\r\n"):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()  # a reset in the middle of the request head
    assert recorded.wait(20)
    assert len(recorded.lines) == 20 and all(exc is None for _, exc in recorded.lines)
    assert all("aborted" in line for line, _ in recorded.lines)


def test_an_oversized_head_gets_431_and_other_methods_405(served):
    _, url = served
    port = int(url.rsplit(":", 1)[1])
    (conn,) = open_connections(port, 1, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"x" * (2 * serve.MAX_HEAD))
    assert conn.makefile("rb").readline().startswith(b"HTTP/1.1 431")
    conn.close()
    request = urllib.request.Request(url + "/readyz", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=10)
    assert caught.value.code == 405


def test_head_requests_get_headers_only(served):
    _, url = served
    with urllib.request.urlopen(urllib.request.Request(url + "/healthz", method="HEAD"), timeout=10) as response:
        assert response.status == 200 and response.headers["Content-Length"] == "3" and response.read() == b""


def test_serve_command_logs_dropped_connections_without_tracebacks(tmp_path):
    with kcache_server("serve", "--port", "0", "--root", str(tmp_path)) as (proc, port):
        for conn in open_connections(port, 30, b"GET /readyz HTTP/1.1\r\n"):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
        assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        stderr = proc.stderr.read()
    assert "Traceback" not in stderr and len(stderr.splitlines()) <= 30


def test_a_watch_marker_with_wrong_types_still_gives_metrics(served):
    root, url = served
    write_marker(root, WATCH_MARKER, {"baseline_files": "many", "new_files": ["inductor"],
                                      "new_bytes": {"triton": "big", "cuda": 5}, "publishes": None})  # fmt: skip
    code, _, text = get(url + "/metrics")
    samples = parse(text)
    assert code == 200 and samples[("kcache_watch_baseline_files", "")] == 0
    assert samples[("kcache_jit_bytes_after_ready", '{layer="cuda"}')] == 5
    assert not any(name == "kcache_jit_files_after_ready" for name, _ in samples)


def test_numbers_no_float_holds_are_left_out_of_the_metrics(served):
    root, url = served
    write_marker(root, RESTORE_MARKER, {"status": "hit", "bundle_key": "k", "seconds": 10**400, "files": 3})
    write_marker(root, WATCH_MARKER, {"baseline_files": 10**400, "new_files": {"inductor": -(10**400), "triton": 2},
                                      "publishes": 1})  # fmt: skip
    (root / WARMUP_MARKER).write_text('{"status": "ok", "seconds": 1e400}')  # parses to inf
    code, _, text = get(url + "/metrics")
    samples = parse(text)
    assert code == 200 and samples[("kcache_restore_files", "")] == 3
    assert ("kcache_restore_seconds", "") not in samples and ("kcache_warmup_seconds", "") not in samples
    assert samples[("kcache_watch_baseline_files", "")] == 0 and samples[("kcache_watch_publishes_total", "")] == 1
    assert samples[("kcache_jit_files_after_ready", '{layer="triton"}')] == 2
    assert ("kcache_jit_files_after_ready", '{layer="inductor"}') not in samples


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2) to read a listen backlog")
def test_the_listen_backlog_takes_a_burst_of_probes(served):
    _, url = served
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True).stdout
    (line,) = out.splitlines()
    assert int(line.split()[2]) >= 128  # a listening socket's Send-Q column is its backlog
