"""`kcache ready`: exit codes and one-line reasons for each marker state, and a light import."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner
from openai_server import OpenAIServer

from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.readiness import RESTORE_MARKER, WARMUP_MARKER, write_marker

NOT_READY = ExitCode.NOT_READY


def ready(*args, env=None):
    return CliRunner().invoke(main, ["ready", *args], env=env, catch_exceptions=False)


def mark(root, restore=None, warmup=None):
    root.mkdir(parents=True, exist_ok=True)
    if restore:
        write_marker(root, RESTORE_MARKER, {"status": restore, "bundle_key": "k", "detail": ""})
    if warmup:
        write_marker(root, WARMUP_MARKER, {"status": warmup, "seconds": 12.5, "profiles": []})


@pytest.mark.parametrize(
    "restore, warmup, code, says",
    [
        (None, None, NOT_READY, "not ready: restore has not finished"),
        (None, "ok", NOT_READY, "not ready: restore has not finished"),
        ("hit", None, NOT_READY, "not ready: warmup has not completed"),
        ("hit", "failed", NOT_READY, "not ready: warmup failed"),
        ("hit", "ok", 0, "ready: restore hit, warmup ok in 12.50 s"),
        ("miss", "ok", 0, "ready: restore miss"),  # a cold pod must still serve
        ("error", "ok", 0, "ready: restore error"),
    ],
)
def test_exit_code_and_reason(tmp_path, restore, warmup, code, says):
    mark(tmp_path / "root", restore, warmup)
    result = ready("--root", str(tmp_path / "root"))
    assert result.exit_code == code
    assert says in result.output and len(result.output.splitlines()) == 1


@pytest.mark.parametrize("seconds", [10**400, -5, "12"])
def test_a_ready_pod_is_ready_whatever_its_warmup_marker_says_it_took(tmp_path, seconds):
    """The marker is written by whoever can write ROOT: 10**400 made formatting the time an
    OverflowError, so the exec probe exited 70 on a ready pod and held it unready."""
    mark(tmp_path / "root", "hit")
    write_marker(tmp_path / "root", WARMUP_MARKER, {"status": "ok", "seconds": seconds, "profiles": []})
    result = ready("--root", str(tmp_path / "root"))
    assert result.exit_code == 0 and result.output == "kcache: ready: restore hit, warmup ok\n"


def signalled(root, status, weights, graphs, on_failure="unready"):
    mark(root, "hit")
    write_marker(root, WARMUP_MARKER, {"status": status, "profiles": [], "on_failure": on_failure,
                                       "signals": {"weights": weights, "graphs": graphs}})  # fmt: skip


@pytest.mark.parametrize(
    "status, weights, graphs, on_failure, code, says",
    [
        ("running", False, False, "unready", 1, "not ready: warmup running: weights not loaded yet"),
        ("running", True, False, "unready", 1, "not ready: warmup running: compiled graphs not done"),
        ("running", True, True, "unready", 1, "not ready: warmup running"),
        ("failed", True, False, "unready", 1, "not ready: warmup failed"),
        ("failed", False, False, "unready", 1, "not ready: warmup failed (weights not loaded)"),
        ("failed", True, False, "ready-cold", 0, "ready (cold): restore hit, warmup failed"),
        ("failed", False, False, "ready-cold", 1, "not ready: warmup failed (weights not loaded)"),
        ("ok", True, True, "ready-cold", 0, "ready: restore hit, warmup ok"),
    ],
)
def test_each_signal_holds_the_pod_back(tmp_path, status, weights, graphs, on_failure, code, says):
    signalled(tmp_path, status, weights, graphs, on_failure)
    result = ready("--root", str(tmp_path))
    assert result.exit_code == (NOT_READY if code else 0) and says in result.output, result.output
    doc = json.loads(ready("--root", str(tmp_path), "--json").output)
    assert {k: v["ok"] for k, v in doc["signals"].items()} == {
        "restore": True, "weights": weights, "graphs": graphs, "warmup": status == "ok"}  # fmt: skip
    assert doc["cold"] is (code == 0 and status != "ok")


def test_missing_root_is_not_ready(tmp_path):
    result = ready("--root", str(tmp_path / "nowhere"))
    assert result.exit_code == NOT_READY and "restore has not finished" in result.output


def test_root_from_environment_and_json(tmp_path):
    mark(tmp_path, "miss", "failed")
    result = ready("--json", env={"KCACHE_ROOT": str(tmp_path)})
    assert result.exit_code == NOT_READY
    assert json.loads(result.output) == {
        "ready": False, "reason": "warmup failed", "restore": "miss", "warmup": "failed", "root": str(tmp_path),
        "cold": False, "signals": {"restore": {"ok": True, "detail": "miss"},
                                   "weights": {"ok": False, "detail": "warmup failed"},
                                   "graphs": {"ok": False, "detail": "warmup failed"},
                                   "warmup": {"ok": False, "detail": "failed"}},
        # exit 11 is the error object every command prints: a script reads status and exit_code
        "status": "not_ready", "error": "warmup failed", "exit_code": NOT_READY,
        "hint": "each signal says what is missing; the markers under --root are written by restore and warmup",
    }  # fmt: skip


def test_probe_imports_nothing_heavy(tmp_path):
    mark(tmp_path, "hit", "ok")
    code = (
        "import sys\n"
        "from kcache.cli import main\n"
        f"try:\n    main(['ready', '--root', {str(tmp_path)!r}])\nexcept SystemExit as e:\n    print(e.code)\n"
        "heavy = {'torch', 'triton', 'sqlalchemy', 'boto3', 'botocore'}\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    line, exit_code, loaded = out.splitlines()
    assert line.startswith("kcache: ready") and exit_code == "0" and loaded == "[]"


@pytest.mark.parametrize("kind", ["fifo", "device", "huge"])
def test_a_marker_that_is_no_small_regular_file_reads_as_absent(tmp_path, kind):
    mark(tmp_path, "hit")
    marker = tmp_path / WARMUP_MARKER
    if kind == "fifo":
        os.mkfifo(marker)  # opening it for reading would block until a writer came
    elif kind == "device":
        marker.symlink_to("/dev/zero")
    else:
        marker.write_bytes(b'{"status": "ok", "pad": "' + b"x" * (5 * 1024 * 1024) + b'"}')
    result = ready("--root", str(tmp_path))
    assert result.exit_code == NOT_READY and "warmup has not completed" in result.output


@pytest.mark.parametrize(
    "expires, on_failure, code, says",
    [
        (-60, "ready-cold", 0, "ready (cold): restore hit"),
        (-60, "unready", 1, "not ready: warmup stopped without finishing"),
        (600, "ready-cold", 1, "not ready: warmup running: compiled graphs not done"),
        ("garbled", "ready-cold", 1, "not ready: warmup running: compiled graphs not done"),
    ],
)
def test_a_running_marker_past_its_expiry_is_a_failed_warmup(tmp_path, expires, on_failure, code, says):
    """A warmup killed mid-way (OOM) leaves "running" behind, and nothing rewrites it: once its
    budget is over the marker counts as failed, so --on-failure ready-cold still applies."""
    from datetime import datetime, timedelta, timezone

    mark(tmp_path, "hit")
    at = expires if isinstance(expires, str) else (datetime.now(timezone.utc) + timedelta(seconds=expires)).isoformat()
    doc = {"status": "running", "profiles": [], "on_failure": on_failure, "expires_at": at,
           "signals": {"weights": True, "graphs": False}}
    write_marker(tmp_path, WARMUP_MARKER, doc)
    result = ready("--root", str(tmp_path))
    assert result.exit_code == (NOT_READY if code else 0) and says in result.output, result.output


@pytest.mark.parametrize("target", ["--url", "--entrypoint"])
def test_warmup_with_a_budget_writes_running_markers_that_expire(tmp_path, monkeypatch, target):
    """--entrypoint too: a hung in-process entrypoint cannot be stopped, but its "running" marker must
    not keep the pod unready for good (without an expiry it did, whatever --budget said)."""
    from datetime import datetime, timezone

    from kcache import warmup

    seen = []
    real = warmup.write_marker
    monkeypatch.setattr(warmup, "write_marker", lambda *a, **kw: seen.append(kw.get("expires_at")) or real(*a, **kw))
    with OpenAIServer() as server:
        aim = [target, server.url if target == "--url" else "test_warmup:record"]
        CliRunner().invoke(main, ["warmup", *aim, "--root", str(tmp_path), "--budget", "600"],
                           catch_exceptions=False)  # fmt: skip
    running, final = seen[:-1], seen[-1]
    assert running and all(at > datetime.now(timezone.utc) for at in running) and final is None


def test_a_new_restore_forgets_the_last_starts_warmup(tmp_path, store, sqlite_index, fp):
    """An init container that runs again (the pod's sandbox was recreated, its emptyDir kept) starts
    a new server: the warmup marker of the last start must not make the pod ready before this one
    loaded its weights."""
    from kcache.readiness import WATCH_MARKER
    from kcache.restore import restore

    root = tmp_path / "root"
    mark(root, restore="hit", warmup="ok")
    write_marker(root, WATCH_MARKER, {"compiles": 3})
    assert ready("--root", str(root)).exit_code == 0
    restore(store, sqlite_index, fp, root)  # a miss: nothing published
    result = ready("--root", str(root))
    assert result.exit_code == NOT_READY and "warmup has not completed" in result.output
    assert not (root / WATCH_MARKER).exists()
