"""The real CLI through click's runner, against real stores and indexes."""

import json

import click
import pytest
from click.testing import CliRunner
from trees import write_tree

from kcache.cli import main


def run(*args, ok=True):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result


def commands(group: click.Group, prefix=()):
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, prefix + (name,))
        else:
            yield prefix + (name,), command


@pytest.mark.parametrize(
    "path, command", list(commands(main)), ids=lambda v: " ".join(v) if isinstance(v, tuple) else ""
)
def test_every_command_has_help_with_an_example(path, command):
    text = run(*path, "--help").output
    assert "Example" in text, f"kcache {' '.join(path)} --help has no example"
    for param in command.params:
        if isinstance(param, click.Option):
            assert param.help, f"option {param.opts} of kcache {' '.join(path)} has no help"


def test_publish_restore_round_trip_with_json(tmp_path):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph", "triton/k/kernel.cubin": b"\x7fELF"})
    published = json.loads(run("publish", "--from", str(tmp_path / "src"), "--model", "m", "--json").output)
    assert {"bundle_key", "bundle_id", "files", "bytes", "new_blobs", "new_bytes", "seconds"} <= set(published)
    assert published["files"] == 2 and published["new_blobs"] == 2
    again = json.loads(run("publish", "--from", str(tmp_path / "src"), "--model", "m", "--json").output)
    assert again["new_blobs"] == 0 and again["bundle_id"] == published["bundle_id"]

    restored = json.loads(run("restore", "--into", str(tmp_path / "dst"), "--model", "m", "--json").output)
    assert restored["status"] == "hit" and restored["bundle_id"] == published["bundle_id"]
    assert {"status", "bundle_id", "files", "bytes", "seconds", "reason"} <= set(restored)
    assert (tmp_path / "dst/triton/k/kernel.cubin").read_bytes() == b"\x7fELF"

    listed = json.loads(run("ls", "--json").output)
    assert [b["id"] for b in listed] == [published["bundle_id"]]
    shown = run("show", published["bundle_id"][:10], "--files").output
    assert "inductor/fxgraph/g" in shown and published["bundle_key"] in shown


def test_miss_is_exit_zero_unless_strict(tmp_path):
    miss = run("restore", "--into", str(tmp_path / "a"), "--model", "nothing-published")
    assert "miss" in miss.output and (tmp_path / "a/kcache.env").exists()
    strict = run("restore", "--into", str(tmp_path / "b"), "--strict", ok=False)
    assert strict.exit_code != 0


def test_errors_fail_open_with_one_line_and_strict_fails(tmp_path):
    args = ("restore", "--into", str(tmp_path / "r"), "--store", "gopher://nowhere")
    open_ = run(*args)
    assert "restore failed, starting cold" in open_.stderr and "gopher" in open_.stderr
    assert "Traceback" not in open_.output
    # Even a failure before any store access leaves a pod that starts: env file and error marker.
    assert (tmp_path / "r/kcache.env").is_file()
    assert json.loads((tmp_path / "r/.kcache-state.json").read_text())["status"] == "error"
    strict = run(*args, "--strict", ok=False)
    assert strict.exit_code == 2 and "failing (--strict)" in strict.stderr


def test_unreachable_index_fails_open_with_json(tmp_path):
    out = run("restore", "--into", str(tmp_path / "r"), "--json",
              "--index", "postgresql+psycopg://x@127.0.0.1:1/none?connect_timeout=2")  # fmt: skip
    doc = json.loads(out.stdout)
    assert doc["status"] == "error" and "cannot connect" in doc["reason"]


def test_other_commands_map_errors_to_exit_codes(tmp_path):
    (tmp_path / "file").write_text("x")
    bad_store = run("publish", "--from", str(tmp_path), "--store", "ftp://x", ok=False)
    assert bad_store.exit_code == 2 and bad_store.stderr.startswith("kcache: error:") and "hint:" in bad_store.stderr
    missing = run("show", "deadbeef", ok=False)
    assert missing.exit_code == 3
    bad_fact = run("fingerprint", "--fact", "oops", ok=False)
    assert bad_fact.exit_code == 2 and "NAME=VALUE" in bad_fact.stderr


def test_fingerprint_json_and_overrides():
    doc = json.loads(run("fingerprint", "--json", "--fact", "gpu.sm=sm_90", "--model", "m", "--extra", "tp=2").output)
    assert set(doc) == {"bundle_key", "toolchain_key", "workload_key", "facts"}
    assert doc["facts"]["gpu.sm"] == "sm_90" and doc["facts"]["extra.tp"] == "2"


def test_db_upgrade_is_idempotent(tmp_path):
    url = f"sqlite:///{tmp_path / 'i.db'}"
    assert "upgraded from empty" in run("db", "upgrade", "--index", url).output
    assert "up to date" in run("db", "upgrade", "--index", url).output
