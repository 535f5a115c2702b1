"""The probe server under hostile load: real sockets on 127.0.0.1 port 0, a model server that hangs."""

import json
import logging
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from click.testing import CliRunner

from kcache import readiness, serve
from kcache.cli import main
from kcache.readiness import RESTORE_MARKER, WARMUP_MARKER, WATCH_MARKER, write_marker
from kcache.serve import make_server, start_in_thread

HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
READYZ = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"


class Recorded(logging.Handler):
    """Collects kcache.serve's log lines; `wait_for(pred)` returns once a line matches."""

    def __init__(self):
        super().__init__()
        self.lines, self._cond = [], threading.Condition()

    def emit(self, record):
        with self._cond:
            self.lines.append(record.getMessage())
            self._cond.notify_all()

    def wait_for(self, pred, timeout=20):
        with self._cond:
            return self._cond.wait_for(lambda: any(pred(line) for line in self.lines), timeout)


@pytest.fixture
def recorded():
    handler, logger = Recorded(), logging.getLogger("kcache.serve")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


class HungEngine:
    """A model server wedged while loading: accepts every connection and never answers."""

    def __init__(self):
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/health"
        self.conns, self._cond = [], threading.Condition()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._cond:
                self.conns.append(conn)
                self._cond.notify_all()

    def wait_for_requests(self, count, timeout=20):
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.conns) >= count, timeout), "no health check reached the engine"

    def close(self):
        """Ends every health check it holds or has queued (shutdown wakes the blocked accept())."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=10)
        self._listener.close()
        with self._cond:
            for conn in self.conns:
                conn.close()


@pytest.fixture
def hung_engine():
    engine = HungEngine()
    yield engine
    engine.close()


def ready_root(root):
    write_marker(root, RESTORE_MARKER, {"status": "hit", "bundle_key": "k"})
    write_marker(root, WARMUP_MARKER, {"status": "ok", "signals": {"weights": True, "graphs": True}})
    return root


def send(port, request, host="127.0.0.1"):
    conn = socket.create_connection((host, port), timeout=10)
    conn.sendall(request)
    return conn


def read_all(conn):
    data = b""
    while chunk := conn.recv(1 << 16):
        data += chunk
    conn.close()
    return data


def status_of(answer):
    return int(answer.split(b" ", 2)[1]) if answer else None


# ---- 1. one bad event must not end the selector thread; a dead one must end the process ----------


class SteppedSelector:
    """Wraps the server's selector so that the test decides when each select() runs: events that
    happen between two steps arrive in one batch, in the order they happened."""

    def __init__(self, real):
        self._real, self._cond, self._calls, self._allowed, self.free = real, threading.Condition(), 0, 0, False

    def select(self, timeout=None):
        with self._cond:
            self._calls += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.free or self._allowed >= self._calls)
        return self._real.select(timeout)

    def step(self):
        """Let one select() run and return once the loop has handled its batch and asks again."""
        with self._cond:
            assert self._cond.wait_for(lambda: self._calls > self._allowed, 20), "the selector thread stopped"
            self._allowed = self._calls
            self._cond.notify_all()
            assert self._cond.wait_for(lambda: self._calls > self._allowed, 20), "the selector thread stopped"

    def run_freely(self):
        with self._cond:
            self.free = True
            self._cond.notify_all()

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_dropping_the_oldest_connection_in_the_same_batch_as_its_data_keeps_serving(tmp_path, recorded):
    server = serve.ProbeServer(("127.0.0.1", 0), ready_root(tmp_path), max_connections=2)
    stepped = server._selector = SteppedSelector(server._selector)
    worker = start_in_thread(server)
    try:
        stepped.step()  # the first select() was waiting before anyone connected
        oldest, other = send(server.port, b"GET /"), send(server.port, b"GET /")
        stepped.step()  # accepts both
        stepped.step()  # reads both partial heads: two connections pending, the limit
        stepped.step()  # a round with nothing to read (up to 1 s): epoll would list the descriptors it
        #                 reported last round first, and the next batch must follow the order below
        newest = send(server.port, b"GET /")  # the listener is readable first ...
        oldest.sendall(b"healthz HTTP/1.1\r\n\r\n")  # ... then the oldest, whom the accept drops
        stepped.step()
        stepped.run_freely()
        assert worker.is_alive()
        assert recorded.wait_for(lambda line: "dropped: 2 connections open" in line)
        with pytest.raises(ConnectionResetError):  # closed unanswered, its request unread: it was dropped
            oldest.recv(100)
        newest.sendall(b"readyz HTTP/1.1\r\n\r\n")
        other.sendall(b"healthz HTTP/1.1\r\n\r\n")
        assert status_of(read_all(newest)) == 200 and status_of(read_all(other)) == 200
        assert status_of(read_all(send(server.port, HEALTHZ))) == 200
    finally:
        stepped.run_freely()
        server.shutdown()
        server.server_close()


# The selector loop fails outside any one connection's event (select() itself, say): the process
# must not go on with a dead probe port.
BROKEN_LOOP = """
import sys
from kcache import serve
from kcache.cli import run

def expire(self):
    raise OSError(12, "Cannot allocate memory")

serve.ProbeServer._expire = expire
sys.argv[0] = "kcache"
run()
"""


@pytest.mark.parametrize("command", [["serve"], ["watch", "--interval", "1h"]], ids=["serve", "watch"])
def test_a_probe_server_that_dies_ends_the_process_with_an_error(tmp_path, command):
    proc = subprocess.Popen([sys.executable, "-c", BROKEN_LOOP, *command, "--root", str(tmp_path), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode not in (0, None), stderr
    assert "probe server stopped" in stderr and "Cannot allocate memory" in stderr, stderr
    assert "Traceback" not in stderr


# ---- 2. /healthz never waits for the engine; the pool's queue is bounded --------------------------


def test_healthz_is_answered_while_every_worker_waits_for_a_hung_engine(tmp_path, hung_engine):
    engine = readiness.EngineHealth(hung_engine.url, timeout=60)
    server = make_server(ready_root(tmp_path), "127.0.0.1", 0, engine=engine)
    start_in_thread(server)
    try:
        waiting = [send(server.port, READYZ) for _ in range(2 * serve.WORKERS)]
        hung_engine.wait_for_requests(1)
        for request in (HEALTHZ, b"GET /nope HTTP/1.1\r\n\r\n", b"POST /readyz HTTP/1.1\r\n\r\n", b"HELLO\r\n\r\n"):
            conn = send(server.port, request)
            conn.settimeout(5)  # far less than the engine's 60 s
            assert status_of(read_all(conn)) in (200, 404, 405, 400)
    finally:
        hung_engine.close()
        server.shutdown()
        server.server_close()
    for conn in waiting:
        conn.close()


def test_requests_past_the_queue_limit_get_503_busy_at_once(tmp_path, hung_engine, recorded):
    engine = readiness.EngineHealth(hung_engine.url, timeout=60)
    server = make_server(ready_root(tmp_path), "127.0.0.1", 0, engine=engine)
    start_in_thread(server)
    count = 64
    try:
        conns = [send(server.port, READYZ) for _ in range(count)]
        hung_engine.wait_for_requests(1)
        answers, deadline = {}, time.monotonic() + 10
        with selectors.DefaultSelector() as sel:
            for conn in conns:
                sel.register(conn, selectors.EVENT_READ)
            while len(answers) < count - serve.MAX_QUEUED and time.monotonic() < deadline:
                for key, _ in sel.select(timeout=1):
                    answers[key.fileobj] = read_all(key.fileobj)
                    sel.unregister(key.fileobj)
        assert len(answers) == count - serve.MAX_QUEUED  # the others still wait for the engine
        assert all(answer.startswith(b"HTTP/1.1 503") and answer.endswith(b"busy\n") for answer in answers.values())
        assert sum("busy" in line for line in recorded.lines) == count - serve.MAX_QUEUED
    finally:
        hung_engine.close()
        server.shutdown()
        server.server_close()
    for conn in conns:
        conn.close()


class SlowEngine:
    """Stands in for EngineHealth: every check takes `seconds` (a model server at its timeout), counted."""

    def __init__(self, seconds):
        self.seconds, self.calls, self.called = seconds, 0, threading.Event()

    def __call__(self):
        self.calls += 1
        self.called.set()
        time.sleep(self.seconds)  # the work being simulated, not a synchronisation
        return False, "GET http://engine/health: timed out"


def test_closing_cancels_queued_requests_instead_of_running_their_engine_checks(tmp_path):
    engine = SlowEngine(0.5)
    server = make_server(ready_root(tmp_path), "127.0.0.1", 0, engine=engine)
    start_in_thread(server)
    conns = [send(server.port, READYZ) for _ in range(4 * serve.WORKERS)]
    assert engine.called.wait(20)
    server.shutdown()
    server.server_close()
    assert engine.calls <= serve.WORKERS  # those running finished; the queued ones never asked the engine
    for conn in conns:  # every client has its answer or a closed connection: none is left hanging
        conn.settimeout(5)
        try:
            assert status_of(read_all(conn)) in (None, 503)
        except ConnectionResetError:  # closed with its request unread
            pass


# ---- 3. --host :: takes IPv4 probes too, and the printed URL brackets it ---------------------------

needs_dualstack = pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="needs a dual-stack IPv6 socket")


@needs_dualstack
def test_host_double_colon_answers_ipv4_and_ipv6(tmp_path):
    server = make_server(tmp_path, "::", 0)
    start_in_thread(server)
    try:
        assert status_of(read_all(send(server.port, HEALTHZ, "127.0.0.1"))) == 200
        assert status_of(read_all(send(server.port, HEALTHZ, "::1"))) == 200
    finally:
        server.shutdown()
        server.server_close()


@needs_dualstack
@pytest.mark.parametrize("command", [["serve"], ["watch", "--interval", "1h"]], ids=["serve", "watch"])
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_an_ipv6_host_is_bracketed_in_the_announced_url(tmp_path, command, as_json):
    args = [sys.executable, "-m", "kcache", *command, "--root", str(tmp_path), "--port", "0", "--host", "::"]
    proc = subprocess.Popen(args + (["--json"] if as_json else []), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()
        url = json.loads(line)["url"] if as_json else line.split(" on ", 1)[1].split(" for ", 1)[0]
        bound = re.fullmatch(r"http://\[::\]:(\d+)", url)
        assert bound, line
        assert status_of(read_all(send(int(bound[1]), HEALTHZ, "127.0.0.1"))) == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_bracketed_ipv6_host_is_taken_as_it_is_written_in_a_url(tmp_path):
    # [::1] is how an IPv6 address is written in a URL; it names the same address as ::1.
    args = [sys.executable, "-m", "kcache", "serve", "--root", str(tmp_path), "--port", "0", "--host", "[::1]",
            "--json"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        doc = json.loads(proc.stdout.readline() or proc.stderr.read())
        assert doc["url"] == f"http://[::1]:{doc['port']}", doc
        assert status_of(read_all(send(doc["port"], HEALTHZ, "::1"))) == 200
    finally:
        proc.kill()
        proc.wait()


@needs_dualstack
def test_an_ipv6_address_in_use_is_named_with_brackets(tmp_path):
    with socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True) as taken:
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--root", str(tmp_path), "--host", "::", "--port", str(port),
                                           "--json"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert f"'[::]:{port}'" in json.loads(result.stdout)["error"]


# ---- 4. a client that never reads its answer holds no worker --------------------------------------

METRICS = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def big_metrics(root):
    """A root whose /metrics is ~5.5 MiB (a watch marker, under its 4 MiB limit, that names 60k layers):
    far more than a socket buffer holds for a client that does not read."""
    layers = {f"l{i}": 1 for i in range(60_000)}
    write_marker(ready_root(root), WATCH_MARKER, {"new_files": layers, "new_bytes": layers})
    return root


def test_clients_that_never_read_a_large_answer_do_not_hold_the_workers(tmp_path, monkeypatch, recorded):
    monkeypatch.setattr(serve, "WRITE_TIMEOUT", 60.0)  # far more than five renders of the answer on a slow core
    server = make_server(big_metrics(tmp_path), "127.0.0.1", 0)
    start_in_thread(server)
    stuck = []
    try:
        for _ in range(serve.WORKERS):  # the old pool's every thread, each in a send for WRITE_TIMEOUT
            conn = socket.socket()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.connect(("127.0.0.1", server.port))
            conn.sendall(METRICS)  # and never reads
            stuck.append(conn)
        answers = []
        for request in (HEALTHZ, METRICS):
            conn = send(server.port, request)
            conn.settimeout(20)  # a third of the write timeout the stuck clients could hold a worker for
            answers.append(read_all(conn))
        assert status_of(answers[0]) == 200
        assert status_of(answers[1]) == 200 and len(answers[1]) > 5 << 20
    finally:
        for conn in stuck:
            conn.close()
        server.shutdown()
        server.server_close()


def test_an_answer_nobody_reads_is_dropped_after_the_write_timeout(tmp_path, monkeypatch, recorded):
    monkeypatch.setattr(serve, "WRITE_TIMEOUT", 0.3)
    server = make_server(big_metrics(tmp_path), "127.0.0.1", 0)
    start_in_thread(server)
    try:
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect(("127.0.0.1", server.port))
        conn.sendall(METRICS)
        assert recorded.wait_for(lambda line: "aborted" in line and "while answering /metrics" in line)
        conn.close()
        assert status_of(read_all(send(server.port, HEALTHZ))) == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_signal_that_comes_while_the_main_thread_holds_the_stop_events_lock_still_stops():
    """SIGTERM's handler set the stop event itself, in the main thread, which for a moment inside
    `stop.wait()` holds that event's (not reentrant) lock: the handler then waited on it for ever,
    and `watch` hung at SIGTERM (seen once in CI) until the kubelet killed it."""
    code = (
        "import signal\n"
        "from kcache.cli.serve_cmd import stop_on_signals\n"
        "stop = stop_on_signals()\n"
        "handler = signal.getsignal(signal.SIGTERM)\n"
        "with stop._cond:\n"  # where Event.wait() is when the signal's handler runs there
        "    handler(signal.SIGTERM, None)\n"
        "assert stop.wait(30)\n"
        "print('stopped')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "stopped", done.stderr
