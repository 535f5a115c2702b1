"""`kcache warmup` and `kcache prebake` stopped by a signal, in a real process.

In a container without an init, kcache is PID 1, and the kernel delivers no signal to PID 1 that it
has no handler for: a warmup with Python's default SIGTERM disposition ignored the kubelet's SIGTERM,
kept the pod for its whole grace period and was SIGKILLed. Here the process is an ordinary child, which
SIGTERM's default disposition kills on the spot (exit -15, no marker): only a handler the command
installs itself ends it with 143 and a marker that says so, which is what PID 1 needs too.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from openai_server import OpenAIServer

from kcache import readiness
from kcache.cli.errors import ExitCode
from kcache.prebake import EXIT_GRACE

TESTS = Path(__file__).resolve().parent


def profiles(tmp_path: Path, batch_size: int) -> Path:
    path = tmp_path / "profiles.yaml"
    path.write_text(f"profiles:\n  - {{name: p, batch_size: {batch_size}, input_tokens: 4, output_tokens: 1}}\n")
    return path


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "kcache", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def stop(process: subprocess.Popen, signum: int = signal.SIGTERM) -> tuple[int, str, str]:
    """Send `signum`, then wait for the exit: far less than the held request's 300 s deadline."""
    process.send_signal(signum)
    try:
        out, err = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"still running 30 s after signal {signum}: {err[-2000:]}")
    return process.returncode, out, err


def stop_when(process: subprocess.Popen, reached, what: str, signum: int = signal.SIGTERM) -> tuple[int, str, str]:
    """Once `reached` is set (the child got that far: `what`), `stop` it; the child never outlives the test."""
    try:
        assert reached.wait(60), what
        return stop(process, signum)
    finally:
        process.kill()
        process.wait()


def laid_out(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    readiness.write_marker(root, readiness.RESTORE_MARKER, {"status": "miss"})
    return root


@pytest.mark.parametrize("batch_size", [1, 4], ids=["single", "batch"])
@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, ExitCode.TERMINATED), (signal.SIGINT, ExitCode.INTERRUPTED)],
                         ids=["SIGTERM", "SIGINT"])  # fmt: skip
def test_a_signal_during_url_warmup_ends_it_with_a_failed_marker(tmp_path, batch_size, signum, code):
    """The server holds the first completion; the signal comes while warmup waits for it. Warmup must
    exit at once (a batch's requests run on threads, which the exit must not wait for either) and
    leave a failed marker: under ready-cold, with the weights loaded, readiness lets the pod serve
    rather than wait for a warmup that will never finish."""
    root = laid_out(tmp_path / "root")
    with OpenAIServer(hold=True) as server:
        warmup = start("warmup", "--url", server.url, "--root", str(root), "--profiles",
                       str(profiles(tmp_path, batch_size)), "--on-failure", "ready-cold", "--json")  # fmt: skip
        rc, out, _ = stop_when(warmup, server.arrived, "warmup never sent a request", signum)
    assert rc == code
    assert json.loads(out)["exit_code"] == code
    marker = readiness.read_marker(root, readiness.WARMUP_MARKER)
    assert marker["status"] == "failed" and f"signal {int(signum)}" in marker["error"]
    assert marker["signals"]["weights"] is True  # what held when the signal came is kept
    state = readiness.check(root)
    assert state.ready and state.cold


def test_sigterm_during_a_parallel_warmup_does_not_wait_for_the_profiles_under_way(tmp_path):
    """--parallel runs profiles on a pool of its own: leaving it waited for the held request."""
    root = laid_out(tmp_path / "root")
    chosen = tmp_path / "two.yaml"
    chosen.write_text("profiles:\n  - {name: a, batch_size: 1, input_tokens: 4, output_tokens: 1}\n"
                      "  - {name: b, batch_size: 1, input_tokens: 8, output_tokens: 1}\n")  # fmt: skip
    with OpenAIServer(hold=True) as server:
        warmup = start("warmup", "--url", server.url, "--root", str(root), "--profiles", str(chosen),
                       "--parallel", "2")  # fmt: skip
        rc, _, _ = stop_when(warmup, server.arrived, "warmup never sent a request")
    assert rc == ExitCode.TERMINATED
    assert readiness.read_marker(root, readiness.WARMUP_MARKER)["status"] == "failed"


def test_sigterm_while_waiting_for_the_server_leaves_a_failed_marker(tmp_path):
    """A server that never becomes healthy: the signal comes during the wait (--wait-timeout 600)."""
    root = laid_out(tmp_path / "root")
    with OpenAIServer(unhealthy=-1) as server:
        warmup = start("warmup", "--url", server.url, "--root", str(root))
        rc, _, _ = stop_when(warmup, server.checked, "warmup never asked the server's health")
    assert rc == ExitCode.TERMINATED
    marker = readiness.read_marker(root, readiness.WARMUP_MARKER)
    assert marker["status"] == "failed" and marker["signals"]["weights"] is False
    assert not readiness.check(root).ready  # unready: the server never answered


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_as_pid_1_of_its_own_namespace_warmup_still_stops_on_sigterm(tmp_path):
    """The container's case itself: warmup is PID 1 of a new PID namespace, which the kernel sends no
    signal it has no handler for (a SIGTERM from the parent namespace too). It was ignored."""
    root = laid_out(tmp_path / "root")
    with OpenAIServer(hold=True) as server:
        unshare = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-m", "kcache",
                                    "warmup", "--url", server.url, "--root", str(root), "--json"],
                                   stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert server.arrived.wait(60), "warmup never sent a request"
            (pid,) = (int(p) for p in Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text().split())
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
            nspid = next(line for line in status if line.startswith("NSpid:"))
            assert nspid.split()[-1] == "1"  # its pid in its own namespace
            os.kill(pid, signal.SIGTERM)
            out, _ = unshare.communicate(timeout=30)
        finally:
            unshare.kill()
            unshare.wait()
    assert json.loads(out)["exit_code"] == ExitCode.TERMINATED
    assert readiness.read_marker(root, readiness.WARMUP_MARKER)["status"] == "failed"


@pytest.mark.parametrize("batch_size", [1, 4], ids=["single", "batch"])
def test_sigterm_during_prebake_url_warmup_publishes_nothing(tmp_path, batch_size):
    """prebake --url had no handler either: ignored as PID 1. Stopped mid-warmup, it must not go on
    to publish what the warmup compiled so far, and its marker says the warmup failed."""
    from click.testing import CliRunner

    from kcache.cli import main

    root = tmp_path / "root"
    laid = CliRunner().invoke(main, ["restore", "--into", str(root), "--model", "m"], catch_exceptions=False)
    assert laid.exit_code == 0, laid.output
    with OpenAIServer(hold=True) as server:
        prebake = start("prebake", "--url", server.url, "--root", str(root), "--profiles",
                        str(profiles(tmp_path, batch_size)), "--model", "m", "--allow-empty", "--json")  # fmt: skip
        rc, out, _ = stop_when(prebake, server.arrived, "prebake never sent a request")
    assert rc == ExitCode.TERMINATED
    assert json.loads(out)["exit_code"] == ExitCode.TERMINATED
    listed = CliRunner().invoke(main, ["ls", "--model", "m", "--json"], catch_exceptions=False)
    assert listed.exit_code == 0 and json.loads(listed.output) == [], listed.output
    assert readiness.read_marker(root, readiness.WARMUP_MARKER)["status"] == "failed"


# ---- an entrypoint that leaves a thread running ------------------------------------------------------


def leaves_a_thread(batch_size, input_tokens, output_tokens):
    """Starts a thread (not a daemon) that never ends, a server loop or a prefetcher, and registers an
    atexit hook, as libraries do. Python's exit joins the thread before it runs the hooks."""
    atexit.register(Path(os.environ["KCACHE_TEST_ATEXIT"]).write_text, "ran")
    threading.Thread(target=threading.Event().wait, name="user-loop").start()


@pytest.mark.parametrize("entrypoint, code", [("test_warmup_signals:leaves_a_thread", 0),
                                              ("thread_then_error:run", ExitCode.USAGE)],
                         ids=["after-the-report", "import-fails"])  # fmt: skip
def test_a_thread_the_entrypoint_leaves_running_does_not_hold_warmup_for_ever(tmp_path, monkeypatch, entrypoint,
                                                                               code):  # fmt: skip
    """The report and the marker were written, then the process never exited: `warmup; exec watch`
    never reached watch, a Job never completed. The thread gets prebake's grace (EXIT_GRACE), then
    the process exits with the warmup's code, after the atexit hooks (the user's too)."""
    ran = tmp_path / "atexit-ran"
    monkeypatch.setenv("KCACHE_TEST_ATEXIT", str(ran))
    (tmp_path / "thread_then_error.py").write_text(
        "import atexit, os, pathlib, threading\n"
        "atexit.register(pathlib.Path(os.environ['KCACHE_TEST_ATEXIT']).write_text, 'ran')\n"
        "threading.Thread(target=threading.Event().wait, name='user-loop').start()\n"
        "raise RuntimeError('no GPU')\n"
    )  # fmt: skip
    monkeypatch.chdir(tmp_path)  # an entrypoint's module is looked up in the current directory first
    root = laid_out(tmp_path / "root")
    warmup = start("warmup", "--entrypoint", entrypoint, "--root", str(root), "--profiles",
                   str(profiles(tmp_path, 1)), "--json")  # fmt: skip
    try:
        out, err = warmup.communicate(timeout=EXIT_GRACE + 50)
    except subprocess.TimeoutExpired:
        pytest.fail("warmup never exited: Python's exit waits for the entrypoint's thread")
    finally:
        warmup.kill()
        warmup.wait()
    assert warmup.returncode == code, err
    marker = readiness.read_marker(root, readiness.WARMUP_MARKER)
    assert marker["status"] == ("ok" if code == 0 else "failed")
    if code == 0:
        assert json.loads(out)["status"] == "ok"
    assert ran.read_text() == "ran"
    assert "user-loop" in err  # the warning names what it did not wait for


def test_sigterm_while_the_entrypoint_imports_leaves_a_failed_marker(tmp_path, monkeypatch):
    """A model load at import time (the module builds its model when imported) is where a pod deleted
    early finds warmup: the handler must already be in place then."""
    (tmp_path / "slow_import.py").write_text(
        "import sys, threading\nsys.stderr.write('importing\\n')\nsys.stderr.flush()\nthreading.Event().wait()\n"
        "def run(batch_size, input_tokens, output_tokens):\n    pass\n"
    )  # fmt: skip
    monkeypatch.chdir(tmp_path)
    root = laid_out(tmp_path / "root")
    warmup = start("warmup", "--entrypoint", "slow_import:run", "--root", str(root), "--on-failure", "ready-cold")
    try:
        for line in warmup.stderr:  # the module's own line: the import is under way
            if line.strip() == "importing":
                break
        else:
            pytest.fail("the entrypoint's module never started importing")
        rc, _, _ = stop(warmup)
    finally:
        warmup.kill()
        warmup.wait()
    assert rc == ExitCode.TERMINATED
    marker = readiness.read_marker(root, readiness.WARMUP_MARKER)
    assert marker["status"] == "failed" and "signal 15" in marker["error"]
    assert not readiness.check(root).ready  # nothing ran: the weights never loaded, even under ready-cold
