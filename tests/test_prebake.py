"""`kcache prebake --entrypoint` when the user's entrypoint misbehaves: it must fail clearly (exit code,
message) or succeed, never hang and never lose the child's report."""

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from planted import publish_planted

from kcache import readiness
from kcache.cli import main
from kcache.cli.errors import ExitCode

TESTS = Path(__file__).resolve().parent

PROFILES = "profiles:\n  - {name: one, batch_size: 1, input_tokens: 4, output_tokens: 1}\n"

# ---- entrypoints (module:function targets, run in prebake's child process) -----------------------


def chatty_at_exit(batch_size, input_tokens, output_tokens):
    """Compiles, but prints to stdout once the warmup is over (an atexit hook, as some libraries have)."""
    (Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / f"kernel-{batch_size}x{input_tokens}.so").write_bytes(b"\x7fELF")
    atexit.register(print, "goodbye from the entrypoint")


def leaves_a_helper(batch_size, input_tokens, output_tokens):
    """Compiles, and forks a helper that outlives the warmup (a fork-started worker pool, a daemon)."""
    (Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / f"kernel-{batch_size}x{input_tokens}.so").write_bytes(b"\x7fELF")
    if os.fork() == 0:
        threading.Event().wait()  # until killed
        os._exit(0)


def leaves_a_thread(batch_size, input_tokens, output_tokens):
    """Compiles, and starts a thread (not a daemon) that outlives the warmup: a server loop, a
    prefetcher. Python's exit waits for it, so the child never exits after its report."""
    (Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / f"kernel-{batch_size}x{input_tokens}.so").write_bytes(b"\x7fELF")
    threading.Thread(target=threading.Event().wait, name="user-loop").start()


def fails(batch_size, input_tokens, output_tokens):
    raise RuntimeError("CUDA out of memory")


def hang(batch_size, input_tokens, output_tokens):
    threading.Event().wait()  # a deadlocked model load: never returns


def hang_after_saying_so(batch_size, input_tokens, output_tokens):
    """Writes its pid into the FIFO the test reads (which waits for it), then hangs."""
    with open(os.environ["KCACHE_TEST_FIFO"], "w") as fifo:
        fifo.write(str(os.getpid()))
    threading.Event().wait()


def dots_on_stdout(batch_size, input_tokens, output_tokens):
    """Compiles, and leaves a thread that draws progress dots on stdout, no line break, for as long as
    the process lives (a progress indicator the user's library runs)."""
    compiles(batch_size, input_tokens, output_tokens)

    def draw():
        while True:
            if sys.stdout is sys.__stdout__:  # kcache sends stdout to stderr while the warmup runs
                sys.stdout.write(".")
                sys.stdout.flush()

    threading.Thread(target=draw, name="user-dots", daemon=True).start()


def crashes(batch_size, input_tokens, output_tokens):
    """Dies mid-warmup without a word, as a segfault in a CUDA extension or the OOM killer ends it."""
    os.kill(os.getpid(), signal.SIGKILL)



FLOOD_LINES = 768  # lines of 1 MiB the next entrypoint prints after its report


def floods_stdout_at_exit(batch_size, input_tokens, output_tokens):
    """Compiles, then prints 768 MiB to stdout once the warmup is over (a library's atexit hook dumping
    its state, a thread logging in a loop): after the report, inside prebake's grace for the exit."""
    compiles(batch_size, input_tokens, output_tokens)

    def flood():
        line = b"x" * (1024 * 1024 - 1) + b"\n"
        for _ in range(FLOOD_LINES):
            os.write(1, line)

    atexit.register(flood)


# ---- helpers ------------------------------------------------------------------------------------


@pytest.fixture
def child_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    path = tmp_path / "profiles.yaml"
    path.write_text(PROFILES)
    return path


def prebake(tmp_path, profiles, entrypoint, *args, code=0):
    result = CliRunner().invoke(main, ["prebake", "--root", str(tmp_path / "A"), "--entrypoint", entrypoint,
                                       "--profiles", str(profiles), "--model", "m", *args],
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == code, result.output
    return result


def test_stdout_printed_after_the_report_does_not_hide_it(tmp_path, child_path):
    out = prebake(tmp_path, child_path, "test_prebake:chatty_at_exit", "--json")
    doc = json.loads(out.stdout)
    assert doc["warmup"]["status"] == "ok" and doc["publish"] is not None


def test_a_hanging_entrypoint_is_stopped_at_the_budget_with_a_clear_error(tmp_path, child_path):
    out = prebake(tmp_path, child_path, "test_prebake:hang", "--budget", "2", code=ExitCode.WARMUP)
    assert "did not finish within 2 s (--budget)" in out.stderr
    assert "raise --budget" in out.stderr
    # The killed child's last marker said "running", with no expiry: readiness on ROOT waited for ever.
    marker = readiness.read_marker(tmp_path / "A", readiness.WARMUP_MARKER)
    assert marker["status"] == "failed" and "--budget" in marker["error"]


def test_a_failed_warmup_is_the_error_object_beside_the_report(tmp_path, child_path):
    out = prebake(tmp_path, child_path, "test_prebake:fails", "--json", code=ExitCode.WARMUP)
    doc = json.loads(out.stdout)
    assert doc["status"] == "error" and doc["exit_code"] == ExitCode.WARMUP and doc["hint"]
    assert "CUDA out of memory" in doc["error"] and doc["publish"] is None and doc["warmup"]["status"] == "failed"


def test_a_helper_the_entrypoint_leaves_running_does_not_hold_prebake(tmp_path, child_path):
    """The helper inherits the child's stdout pipe (kept open for kcache's report while the user's
    code runs): prebake waited for its end of file, and under --budget called the finished warmup
    timed out. The child's exit is what counts; what is left of its session is killed."""
    out = prebake(tmp_path, child_path, "test_prebake:leaves_a_helper", "--budget", "60", "--json")
    doc = json.loads(out.stdout)
    assert doc["warmup"]["status"] == "ok" and doc["publish"] is not None


def test_a_thread_the_entrypoint_leaves_running_does_not_lose_the_report(tmp_path, child_path):
    """The child prints its report, then Python's exit waits for the user's thread for ever: prebake
    waited for the child's exit, so under --budget it called the finished warmup timed out and
    published nothing (without a budget it hung). The report is the child's last word: once it
    came, the child gets a grace to exit, then is killed and the report kept."""
    out = prebake(tmp_path, child_path, "test_prebake:leaves_a_thread", "--budget", "60", "--json")
    doc = json.loads(out.stdout)
    assert doc["warmup"]["status"] == "ok" and doc["publish"] is not None
    assert doc["publish"]["files"] >= 1


@pytest.mark.parametrize("child_waits", [False, True], ids=["child-exits", "child-past-budget"])
def test_a_daemonized_helper_holding_stdout_does_not_hold_prebake(tmp_path, child_waits):
    """A helper that left the child's session (setsid) keeps the pipe open: closing it waited for
    the reader thread, which waited for the helper, so prebake outlived --budget by the helper's life."""
    import sys

    from kcache.prebake import ChildWarmup, WarmupChildFailed, WarmupChildTimedOut

    pid_file = tmp_path / "helper.pid"
    # The helper says over a pipe that its pid is written, then lives until killed; the child goes
    # on only then, and exits or (past the budget) waits to be killed.
    script = (f"import os, signal\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n"
              f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n    os.write(w, b'x')\n"
              f"    signal.pause()\n    os._exit(0)\nos.read(r, 1)\n"
              + ("signal.pause()\n" if child_waits else ""))  # fmt: skip

    class Child(ChildWarmup):
        def command(self, root):
            return [sys.executable, "-c", script]

    (tmp_path / "kcache.env").write_text("")
    outcome: list[BaseException] = []
    ended = threading.Event()

    def warm():
        try:
            Child("x", timeout=2).warm(tmp_path, lambda _message: None)
        except (WarmupChildFailed, WarmupChildTimedOut) as exc:
            outcome.append(exc)
        finally:
            ended.set()

    threading.Thread(target=warm, daemon=True).start()
    try:
        assert ended.wait(60), "prebake waited for the helper"
        assert len(outcome) == 1
    finally:  # the child went on only once the helper had written its pid
        if pid_file.exists() and pid_file.read_text().strip():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_sigterm_to_prebake_kills_its_warmup_child_too(tmp_path, child_path, monkeypatch):
    """The child runs in a session of its own, so the signal that stops prebake (`timeout`, a CI job
    cancelled, a Job past its deadline) never reaches it: SIGTERM ended prebake on the spot and left
    the warmup running, on the GPU, for ever. Now the child's group is killed and --json says why."""
    fifo = tmp_path / "pid.fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("KCACHE_TEST_FIFO", str(fifo))
    prebake = subprocess.Popen([sys.executable, "-m", "kcache", "prebake", "--root", str(tmp_path / "A"),
                                "--entrypoint", "test_prebake:hang_after_saying_so", "--profiles", str(child_path),
                                "--model", "m", "--json"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    child = None
    try:
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.append(fifo.read_text()), daemon=True)
        reader.start()  # its open() returns once the child opened the FIFO to write
        reader.join(120)
        if not said:  # the child never came: unblock the reader and fail
            fifo.write_text("")
        assert said and said[0], "the warmup child never started"
        child = int(said[0])
        prebake.send_signal(signal.SIGTERM)
        out, _ = prebake.communicate(timeout=60)
        assert prebake.returncode == ExitCode.TERMINATED
        assert json.loads(out)["exit_code"] == ExitCode.TERMINATED
        with pytest.raises(ProcessLookupError):  # reaped by prebake: no such process any more
            os.kill(child, 0)
        marker = readiness.read_marker(tmp_path / "A", readiness.WARMUP_MARKER)
        assert marker["status"] == "failed" and "signal 15" in marker["error"]
    finally:
        prebake.kill()
        prebake.wait()
        if child is not None:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


def compiles(batch_size, input_tokens, output_tokens):
    """Compiles one kernel of the shape into the Inductor cache ROOT/kcache.env points at."""
    (Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / f"kernel-{batch_size}x{input_tokens}.so").write_bytes(b"\x7fELF")


def test_a_signing_prebake_does_not_sign_what_a_store_writer_planted(tmp_path, child_path):
    """A store writer without the key publishes an unsigned bundle under production's key. prebake
    restored it into ROOT with no signature check, ran the warmup over it (the planted code in the
    builder) and published ROOT signed: every pod requiring signatures then restored the planted
    file. With --signing-key, prebake restores only a bundle that key signed (publish carries no
    other either); anything else is refused, as a pod refuses it, and the warmup starts cold."""
    runner = CliRunner()
    publish_planted(tmp_path, runner)
    assert runner.invoke(main, ["keygen", "ci", "--dir", str(tmp_path / "k")]).exit_code == 0
    out = prebake(tmp_path, child_path, "test_prebake:compiles", "--signing-key", str(tmp_path / "k" / "ci.key"),
                  "--json")  # fmt: skip
    doc = json.loads(out.stdout)
    assert doc["restore"]["status"] == "error" and "not signed by a trusted key" in doc["restore"]["reason"]
    assert doc["warmup"]["status"] == "ok" and doc["publish"]["created"]
    assert not (tmp_path / "A" / "inductor" / "fxgraph" / "evil.py").exists()
    pod = runner.invoke(main, ["restore", "--into", str(tmp_path / "pod"), "--model", "m", "--trusted-key",
                               str(tmp_path / "k" / "ci.pub"), "--require-signature", "--strict", "--json"],
                        catch_exceptions=False)  # fmt: skip
    assert pod.exit_code == 0, pod.output
    assert json.loads(pod.stdout)["status"] == "hit"
    assert (tmp_path / "pod" / "inductor" / "kernel-1x4.so").exists()
    assert not (tmp_path / "pod" / "inductor" / "fxgraph" / "evil.py").exists()
    # What the key signed is restored by the next prebake: the warmup starts warm.
    again = CliRunner().invoke(main, ["prebake", "--root", str(tmp_path / "B"), "--entrypoint", "test_prebake:compiles",
                                      "--profiles", str(child_path), "--model", "m", "--signing-key",
                                      str(tmp_path / "k" / "ci.key"), "--json"], catch_exceptions=False)  # fmt: skip
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["restore"]["status"] == "hit"


def test_a_signing_prebake_into_a_root_restored_from_a_planted_bundle_signs_none_of_it(tmp_path, child_path):
    """A kept build ROOT that an unchecked restore (a `kcache restore` without signatures) filled from a
    bundle a store writer planted: prebake's own restore refused that bundle, but the layers of the same
    key stay in ROOT through a refused restore, and prebake published them signed."""
    runner = CliRunner()
    publish_planted(tmp_path, runner)
    assert runner.invoke(main, ["restore", "--into", str(tmp_path / "A"), "--model", "m"]).exit_code == 0
    assert (tmp_path / "A" / "inductor" / "fxgraph" / "evil.py").exists()
    assert runner.invoke(main, ["keygen", "ci", "--dir", str(tmp_path / "k")]).exit_code == 0
    prebake(tmp_path, child_path, "test_prebake:compiles", "--signing-key", str(tmp_path / "k" / "ci.key"), "--json",
            code=ExitCode.SIGNATURE)  # fmt: skip
    pod = runner.invoke(main, ["restore", "--into", str(tmp_path / "pod"), "--model", "m", "--trusted-key",
                               str(tmp_path / "k" / "ci.pub"), "--require-signature", "--json"],
                        catch_exceptions=False)  # fmt: skip
    assert not (tmp_path / "pod" / "inductor" / "fxgraph" / "evil.py").exists(), pod.output


def test_a_report_that_follows_text_without_a_line_break_is_still_read(tmp_path, child_path):
    """The child's report is one line, but stdout text of the user's code (a thread drawing dots, no line
    break) may come right before it on that line: prebake read no report, failed a warmup that succeeded
    and published nothing."""
    out = prebake(tmp_path, child_path, "test_prebake:dots_on_stdout", "--json")
    doc = json.loads(out.stdout)
    assert doc["warmup"]["status"] == "ok" and doc["publish"]["files"] == 1


def test_a_warmup_child_that_dies_without_a_report_leaves_a_failed_marker(tmp_path, child_path):
    """The child's last marker said "running", with no expiry: a killed child (SIGTERM to prebake, --budget)
    got a failed one in its place, but one that died of its own (a segfault, the OOM killer) kept it, and
    readiness on ROOT said "warmup running" for ever."""
    out = prebake(tmp_path, child_path, "test_prebake:crashes", "--json", code=ExitCode.WARMUP)
    assert "no report" in json.loads(out.stdout)["error"]
    marker = readiness.read_marker(tmp_path / "A", readiness.WARMUP_MARKER)
    assert marker["status"] == "failed" and "no report" in marker["error"]
    assert readiness.check(tmp_path / "A").reason.startswith("warmup failed")


def test_what_the_entrypoint_prints_after_its_report_is_not_kept_in_memory(tmp_path, child_path):
    """prebake kept all of the child's stdout to find the report in it at the end: 768 MiB printed by an
    atexit hook after the report grew prebake by that much, and the joined, decoded and split copies by
    three times more; a thread printing for the whole grace could take the builder's memory. prebake
    keeps the report line alone now."""
    launcher = ("import resource, subprocess, sys\n"
                "code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
                "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
                "sys.exit(code)\n")  # the peak RSS of prebake and its warmup child, not pytest's own pages
    env = {**os.environ, "KCACHE_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "kcache", "prebake", "--root",
                           str(tmp_path / "A"), "--entrypoint", "test_prebake:floods_stdout_at_exit", "--profiles",
                           str(child_path), "--model", "m", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    peak = int(proc.stdout.split()[-1]) * 1024  # ru_maxrss is in KiB on Linux
    assert peak < 256 * 1024 * 1024, f"peak RSS {peak >> 20} MiB"
