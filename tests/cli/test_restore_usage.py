"""A restore with a flag click cannot parse still starts the pod cold (issue 9.1).

A typo in --jobs or --fallback, an unknown option, or an environment value of the wrong type is a
click usage error (exit 2), which crash-loops an init container. Restore catches its own: when
--into can be read from the arguments, it writes kcache.env and an error marker there and exits
0, unless --strict is among the arguments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kcache import envfile, sources
from kcache.cli import main
from kcache.readiness import check
from kcache.restore import read_state

# Each case: (arguments after --into ROOT, environment); callables get tmp_path.
CASES = {
    "jobs-typo": lambda t: (["--jobs", "1O"], {}),
    "jobs-out-of-range": lambda t: (["--jobs", "0"], {}),
    "fallback-typo": lambda t: (["--fallback", "toolchian"], {}),
    "unknown-option": lambda t: (["--modle", "m"], {}),
    "option-without-value": lambda t: (["--model"], {}),
    "unexpected-argument": lambda t: (["stray"], {}),
    "facts-file-is-a-directory": lambda t: (["--facts-file", str(t)], {}),
    "env-trusted-key-is-a-directory": lambda t: ([], {"KCACHE_TRUSTED_KEYS": str(t)}),
}


def invoke(args: list[str], env: dict | None = None):
    return CliRunner().invoke(main, ["restore", *args], env=env or {}, catch_exceptions=False)


def assert_cold_but_ready_to_start(root: Path) -> dict:
    state = read_state(root)
    assert state is not None and state["status"] == "error" and state["reason"], state
    assert envfile.read(root / envfile.NAME) == sources.all_exports(root)
    assert check(root).reason != "restore has not finished"
    return state


@pytest.mark.parametrize("case", list(CASES))
def test_usage_error_writes_marker_and_env_and_exits_0(tmp_path, case):
    args, env = CASES[case](tmp_path)
    root = tmp_path / "root"
    result = invoke(["--into", str(root), "--model", "m", *args], env)
    assert result.exit_code == 0, result.output + result.stderr
    failed = [line for line in result.stderr.splitlines() if "restore failed, starting cold" in line]
    assert len(failed) == 1, result.stderr
    assert_cold_but_ready_to_start(root)


@pytest.mark.parametrize("case", list(CASES))
def test_usage_error_under_strict_exits_2_with_the_marker(tmp_path, case):
    args, env = CASES[case](tmp_path)
    root = tmp_path / "root"
    result = invoke(["--strict", f"--into={root}", *args], env)
    assert result.exit_code == 2, result.output + result.stderr
    assert_cold_but_ready_to_start(root)


def test_usage_error_under_json_prints_one_error_object(tmp_path):
    root = tmp_path / "root"
    result = invoke(["--json", "--into", str(root), "--jobs", "many"])
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc["status"] == "error" and "--jobs" in doc["reason"] and doc["exit_code"] == 0
    assert "--jobs" in assert_cold_but_ready_to_start(root)["reason"]
    assert (doc["root"], doc["env_file"], doc["bundle_key"], doc["layers"]) == (str(root), str(root / "kcache.env"),
                                                                                  None, [])  # fmt: skip


def test_usage_error_reason_is_one_line_in_the_marker(tmp_path):
    root = tmp_path / "root"
    result = invoke(["--into", str(root), "--fallback", "x\n\x1b[2Jexport EVIL=1"])
    assert result.exit_code == 0, result.stderr
    reason = assert_cold_but_ready_to_start(root)["reason"]
    assert "\n" not in reason and "\x1b" not in reason
    assert "EVIL" not in envfile.read(root / envfile.NAME)


def test_without_into_a_usage_error_stays_a_usage_error(tmp_path):
    result = invoke(["--jobs", "1O"])
    assert result.exit_code == 2
    result = invoke(["--model", "m"])  # --into missing
    assert result.exit_code == 2


def test_unusable_into_starts_cold_as_restore_does_and_names_the_usage_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    result = invoke(["--into", str(tmp_path / "file"), "--jobs", "1O"])
    assert result.exit_code == 0 and "restore failed, starting cold" in result.stderr
    assert "--jobs" in result.stderr
    assert (tmp_path / "file").read_text() == "not a directory"
    assert invoke(["--strict", "--into", str(tmp_path / "file"), "--jobs", "1O"]).exit_code == 2


def test_help_still_exits_0_without_writing(tmp_path):
    result = invoke(["--into", str(tmp_path / "root"), "--help"])
    assert result.exit_code == 0 and "Usage" in result.output
    assert not (tmp_path / "root").exists()


def test_usage_error_under_strict_and_json_prints_one_object_with_the_usage_code(tmp_path):
    result = invoke(["--strict", "--json", "--into", str(tmp_path / "root"), "--jobs", "many"])
    assert result.exit_code == 2
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 2 and "--jobs" in doc["error"]


@pytest.mark.parametrize("given, env, budget", [
    (["--timeout", "2"], {}, 2.0),
    (["--timeout=5s"], {}, 5.0),
    ([], {"KCACHE_RESTORE_TIMEOUT": "3"}, 3.0),
    (["--timeout", "1h"], {}, 30.0),  # waiting for another restore's lock stays short
    (["--timeout", "soon"], {}, 30.0),
])  # fmt: skip
def test_the_failure_path_waits_for_roots_lock_no_longer_than_the_budget(tmp_path, monkeypatch, given, env, budget):
    from kcache.cli import restore_usage

    seen = []
    real = restore_usage.restore_opening
    monkeypatch.setattr(restore_usage, "restore_opening", lambda *a, **kw: seen.append(kw["timeout"]) or real(*a, **kw))
    result = invoke(["--into", str(tmp_path / "root"), "--jobs", "abc", *given], env)
    assert result.exit_code == 0 and seen == [budget]


def test_a_failing_fingerprint_is_reported_before_a_failing_store(tmp_path):
    """The store opens while the fingerprint is computed; the fingerprint's error still comes first."""
    root = tmp_path / "root"
    result = invoke(["--json", "--into", str(root), "--facts-file", str(tmp_path), "--store", "ftp://x"])
    doc = json.loads(result.stdout)
    assert doc["status"] == "error" and str(tmp_path) in doc["reason"] and "ftp" not in doc["reason"], doc
    assert doc["reason"] == assert_cold_but_ready_to_start(root)["reason"]


def test_a_failing_store_keeps_the_computed_bundle_key(tmp_path):
    root = tmp_path / "root"
    result = invoke(["--json", "--into", str(root), "--model", "m", "--store", "ftp://x"])
    doc = json.loads(result.stdout)
    assert doc["status"] == "error" and "ftp" in doc["reason"] and doc["bundle_key"], doc
    assert assert_cold_but_ready_to_start(root)["bundle_key"] == doc["bundle_key"]
