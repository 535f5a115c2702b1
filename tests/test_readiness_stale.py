"""Readiness on a reused volume: a warmup marker that follows an earlier restore must not make the
pod of a later restore ready."""

import json
import threading

from click.testing import CliRunner
from openai_server import OpenAIServer

from kcache import readiness
from kcache.cli import main
from kcache.cli.errors import ExitCode

PROFILES = "profiles:\n  - {name: one, batch_size: 1, input_tokens: 4, output_tokens: 1}\n"


def cli(*args, code=0):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def test_a_warmup_of_the_last_pod_that_ends_after_a_new_restore_does_not_make_it_ready(tmp_path):
    root, profiles = tmp_path / "root", tmp_path / "profiles.yaml"
    profiles.write_text(PROFILES)
    cli("restore", "--into", str(root), "--model", "m")  # the last pod's restore
    with OpenAIServer(hold=True) as server:
        # The last pod's warmup, still running while its pod terminates (the volume outlives it).
        old = threading.Thread(target=cli, args=("warmup", "--url", server.url, "--root", str(root),
                                                 "--profiles", str(profiles)))  # fmt: skip
        old.start()
        assert server.arrived.wait(30)
        cli("restore", "--into", str(root), "--model", "m")  # the new pod's init container
        server.release.set()
        old.join()
    assert readiness.read_marker(root, readiness.WARMUP_MARKER)["status"] == "ok"  # written after the restore
    state = readiness.check(root)
    assert not state.ready
    assert state.reason == "warmup has not completed (its marker follows an earlier restore)"
    out = cli("ready", "--root", str(root), "--json", code=ExitCode.NOT_READY)
    assert json.loads(out.output)["ready"] is False


def test_a_warmup_after_the_restore_in_place_makes_the_pod_ready(tmp_path):
    root, profiles = tmp_path / "root", tmp_path / "profiles.yaml"
    profiles.write_text(PROFILES)
    cli("restore", "--into", str(root), "--model", "m")
    with OpenAIServer() as server:
        cli("warmup", "--url", server.url, "--root", str(root), "--profiles", str(profiles))
    marker = readiness.read_marker(root, readiness.WARMUP_MARKER)
    restored = readiness.read_marker(root, readiness.RESTORE_MARKER)
    assert marker["restore_finished_at"] == restored["finished_at"]
    assert readiness.check(root).ready


def test_a_warmup_marker_that_names_no_restore_reads_as_before(tmp_path):
    readiness.write_marker(tmp_path, readiness.RESTORE_MARKER, {"status": "hit"})
    readiness.write_marker(tmp_path, readiness.WARMUP_MARKER, {"status": "ok", "profiles": []})
    assert readiness.check(tmp_path).ready


def test_a_warmup_that_started_before_any_restore_does_not_count(tmp_path):
    profiles = tmp_path / "profiles.yaml"
    profiles.write_text(PROFILES)
    with OpenAIServer() as server:
        cli("warmup", "--url", server.url, "--root", str(tmp_path), "--profiles", str(profiles))
    assert readiness.read_marker(tmp_path, readiness.WARMUP_MARKER)["restore_finished_at"] is None
    readiness.write_marker(tmp_path, readiness.RESTORE_MARKER, {"status": "hit"})
    assert readiness.check(tmp_path).reason == "warmup has not completed (its marker follows an earlier restore)"
