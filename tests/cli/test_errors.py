"""One error boundary: every exception leaves through cli/errors.py's table, never as a traceback."""

import errno
import importlib
import json
import os
import pkgutil
import signal
import socket
import sqlite3

import pytest
from click.testing import CliRunner
from command_tree import commands

import kcache
from kcache.cli import main
from kcache.cli.errors import TABLE, ExitCode, describe
from kcache.errors import Terminated

ALL_COMMANDS = sorted(path for path, _ in commands(main))


def run(*args, env=None):
    return CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)


def kcache_exception_classes():
    for info in pkgutil.walk_packages(kcache.__path__, "kcache."):
        if info.name.endswith("__main__") or "_migrations" in info.name:
            continue
        module = importlib.import_module(info.name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == info.name:
                yield value


@pytest.mark.parametrize("cls", sorted(set(kcache_exception_classes()), key=lambda c: c.__qualname__),
                         ids=lambda c: f"{c.__module__}.{c.__qualname__}")  # fmt: skip
def test_every_exception_class_has_a_row_of_its_own(cls):
    first = next((kind for kind, _code, _hint in TABLE if issubclass(cls, kind)), None)
    assert first is cls, f"{cls.__module__}.{cls.__qualname__} has no row in kcache/cli/errors.py (falls to {first})"


def test_the_walk_finds_the_classes_outside_errors_py():
    names = {c.__qualname__ for c in kcache_exception_classes()}
    assert {"ProfileError", "ServerUnavailable", "WarmupChildFailed", "ConfigError"} <= names


def test_an_unexpected_exception_is_a_bug_with_exit_70():
    message, hint, code = describe(KeyError("x"))
    assert code == ExitCode.BUG == 70 and message == "KeyError: 'x'" and "KCACHE_DEBUG=1" in hint


# ---- every command, with a failure kcache did not expect -----------------------------------------

INJECTED = "injected failure"
# Minimal valid arguments per command; the test fails when a command is registered without a row.
ARGS = {
    ("config",): [],
    ("db", "upgrade"): [],
    ("explain",): [],
    ("fingerprint",): [],
    ("gc",): ["--dry-run"],
    ("keygen",): ["k", "--dir", "{tmp}"],
    ("ls",): [],
    ("prefetch",): ["--node-cache", "{tmp}/node", "--model", "m", "--once"],
    ("prebake",): ["--root", "{tmp}/r", "--url", "http://127.0.0.1:1"],
    ("publish",): ["--from", "{tmp}"],
    ("ready",): ["--root", "{tmp}"],
    ("reindex",): [],
    ("restore",): ["--into", "{tmp}/r", "--strict"],
    ("serve",): ["--root", "{tmp}", "--port", "0"],
    ("show",): ["abc"],
    ("stats",): [],
    ("verify",): [],
    ("warmup",): ["--url", "http://127.0.0.1:1"],
    ("watch",): ["--root", "{tmp}", "--once", "--publish-every", "1m"],
    ("yank",): ["abc"],
    ("refresh",): ["--signing-key", "{tmp}/k.key"],
    ("proxy",): ["--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9", "--port", "0",
                 "--model", "m"],
}


def test_every_command_is_in_the_fault_table():
    assert sorted(ARGS) == ALL_COMMANDS


@pytest.fixture
def everything_breaks(monkeypatch):
    """The first library call of every command raises an exception kcache has no row for."""

    def boom(*_args, **_kwargs):
        raise RuntimeError(INJECTED)

    for target in ("kcache.config.resolve", "kcache.fingerprint.collect", "kcache.signing.generate",
                   "kcache.readiness.check", "kcache.cli.serve_cmd.make_server", "kcache.warmup.run",
                   "kcache.signing.load_signing_key"):  # fmt: skip
        module, name = target.rsplit(".", 1)
        monkeypatch.setattr(importlib.import_module(module), name, boom)  # kcache.cli.X_cmd names a command too


@pytest.mark.parametrize("path", ALL_COMMANDS, ids=" ".join)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_an_unexpected_error_in_any_command_is_one_line_exit_70(tmp_path, everything_breaks, path, as_json):
    args = [*path, *(a.format(tmp=tmp_path) for a in ARGS[path]), *(["--json"] if as_json else [])]
    result = run(*args)
    assert "Traceback" not in result.output
    assert result.exit_code == ExitCode.BUG, result.output
    assert f"RuntimeError: {INJECTED}" in result.stderr and "hint:" in result.stderr
    if as_json:
        doc = json.loads(result.stdout)
        assert doc["status"] == "error" and doc["exit_code"] == 70 and INJECTED in doc["error"] and doc["hint"]


@pytest.mark.parametrize("stop, code", [(KeyboardInterrupt, 130), (lambda: Terminated(signal.SIGTERM), 143)],
                         ids=["ctrl-c", "sigterm"])  # fmt: skip
def test_an_interrupt_exits_128_plus_the_signal_and_still_answers_json(monkeypatch, stop, code):
    """Under --json an interrupted command printed nothing on stdout: a script reading its one
    object got no object at all."""

    def interrupt(*_args, **_kwargs):
        raise stop()

    monkeypatch.setattr(importlib.import_module("kcache.config"), "resolve", interrupt)
    result = run("ls", "--json")
    assert result.exit_code == code and "interrupted" in result.stderr
    doc = json.loads(result.stdout)
    assert doc["status"] == "error" and doc["exit_code"] == code and "interrupted" in doc["error"]
    assert "interrupted" in run("ls").stderr and not run("ls").stdout  # without --json: stderr only


def test_kcache_debug_shows_the_traceback(everything_breaks):
    with pytest.raises(RuntimeError, match=INJECTED):
        run("ls", env={"KCACHE_DEBUG": "1"})


# ---- the two cases the issue found ----------------------------------------------------------------


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_db_upgrade_against_a_closed_port_is_an_index_error():
    result = run("db", "upgrade", "--index", f"postgresql+psycopg://kcache:pw@127.0.0.1:{closed_port()}/x")
    assert result.exit_code == ExitCode.INDEX and "Traceback" not in result.output
    assert result.stderr.startswith("kcache: error: index ") and "cannot connect" in result.stderr


@pytest.mark.parametrize("args", [["publish", "--from", "{tmp}", "--model", "m", "--index", "sqlite:///{tmp}/i.db"],
                                  ["ls"],
                                  ["config"], ["restore", "--into", "{tmp}/r", "--strict"]])  # fmt: skip
def test_kcache_home_that_is_a_file_is_a_usage_error(tmp_path, args):
    (tmp_path / "home").write_text("not a directory")
    result = run(*(a.format(tmp=tmp_path) for a in args), env={"KCACHE_HOME": str(tmp_path / "home")})
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "KCACHE_HOME" in result.stderr and "is not a directory" in result.stderr


def test_usage_errors_under_json_are_one_json_object():
    result = run("gc", "--keep-last", "many", "--json")
    assert result.exit_code == ExitCode.USAGE
    doc = json.loads(result.stdout)
    assert doc["status"] == "error" and doc["exit_code"] == 2 and "--keep-last" in doc["error"]


def test_a_bad_s3_setting_is_a_usage_error_not_a_bug(tmp_path, monkeypatch):
    monkeypatch.setenv("KCACHE_S3_CONNECT_TIMEOUT", "soon")
    result = run("verify", "--store", "s3://bucket/p", "--index", f"sqlite:///{tmp_path}/i.db")
    assert result.exit_code == ExitCode.USAGE and "KCACHE_S3_CONNECT_TIMEOUT" in result.stderr


def test_a_bad_index_read_timeout_is_a_usage_error_not_a_bug(tmp_path, monkeypatch, pg_database):
    (tmp_path / "store").mkdir()
    monkeypatch.setenv("KCACHE_INDEX_READ_TIMEOUT", "soon")
    result = run("verify", "--store", f"file://{tmp_path / 'store'}", "--index", pg_database)
    assert result.exit_code == ExitCode.USAGE and "KCACHE_INDEX_READ_TIMEOUT" in result.stderr


# ---- publish: a cache file that changes under it, a temp dir it cannot stage packs in ------------


def _publish_cli(tmp_path):
    return run("publish", "--from", tmp_path / "root", "--model", "m", "--store", f"file://{tmp_path / 'store'}",
               "--index", f"sqlite:///{tmp_path / 'i.db'}", "--json")  # fmt: skip


def test_a_file_changed_while_publish_packs_it_is_not_corruption(tmp_path, monkeypatch):
    from trees import write_tree

    from kcache import publish as publishing

    write_tree(tmp_path / "root", {"inductor/a": b"kernel one"})
    real = publishing._hash_all

    def hash_then_rewrite(*args, **kwargs):
        hashed = real(*args, **kwargs)
        (tmp_path / "root/inductor/a").write_bytes(b"kernel two")  # the compile rewrites it before it is packed
        return hashed

    monkeypatch.setattr(publishing, "_hash_all", hash_then_rewrite)
    result = _publish_cli(tmp_path)
    assert result.exit_code == ExitCode.CHANGED, result.output
    doc = json.loads(result.stdout)
    assert "changed while it was being published" in doc["error"]
    assert "compile still running" in doc["hint"] and "publish again" in doc["hint"] and "corrupt" not in doc["hint"]


@pytest.mark.parametrize("code", ["ENOSPC", "EACCES", "EROFS"])
def test_a_temp_dir_publish_cannot_create_its_workdir_in_is_named(tmp_path, monkeypatch, code):
    import errno
    import os
    import tempfile

    from trees import write_tree

    write_tree(tmp_path / "root", {"inductor/a": b"kernel"})
    real = tempfile.mkdtemp

    def mkdtemp(suffix=None, prefix=None, dir=None):
        if prefix and prefix.startswith("kcache-publish-"):
            raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)), str(tmp_path / "tmp" / prefix))
        return real(suffix, prefix, dir)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    result = _publish_cli(tmp_path)
    assert result.exit_code == ExitCode.USAGE, result.output
    doc = json.loads(result.stdout)
    assert str(tmp_path / "tmp") in doc["error"] and os.strerror(getattr(errno, code)) in doc["error"]
    assert "TMPDIR" in doc["error"] and "TMPDIR" in doc["hint"]


def test_a_temp_dir_that_fills_while_a_pack_is_staged_is_named(tmp_path, monkeypatch):
    import errno

    from trees import write_tree

    from kcache import packs

    write_tree(tmp_path / "root", {"inductor/a": b"kernel"})
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))

    class Full:
        """The pack file on a disk with no room left."""

        def __init__(self, file):
            self._file = file

        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self._file, name)

    real_init = packs.PackWriter.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._out.file = Full(self._out.file)

    monkeypatch.setattr(packs.PackWriter, "__init__", init)
    result = _publish_cli(tmp_path)
    assert result.exit_code == ExitCode.USAGE, result.output
    doc = json.loads(result.stdout)
    assert str(tmp_path / "tmp") in doc["error"] and "No space left" in doc["error"] and "TMPDIR" in doc["hint"]
    assert list((tmp_path / "tmp").iterdir()) == []  # the staging directory went with the failure


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EFBIG])
def test_a_full_root_is_told_to_make_room_not_to_pick_another_directory(tmp_path, code):
    """A restore root that filled up (or hit a quota, or ulimit -f) is the right directory: the hint
    for a root kcache cannot use at all sent the operator to look for another one."""
    from kcache.cli.errors import describe
    from kcache.restore import _root_error

    message, hint, exit_code = describe(_root_error(tmp_path, OSError(code, os.strerror(code))))
    assert exit_code == 7 and str(tmp_path) in message
    assert "room" in hint and "--into" not in hint


def _closed_stdout(tmp_path, *args):
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte
    try:
        env = {**os.environ, "KCACHE_HOME": str(tmp_path)}
        return subprocess.run([sys.executable, "-m", "kcache", *args], stdout=write, stderr=subprocess.PIPE,
                              env=env, timeout=120)  # fmt: skip
    finally:
        os.close(write)


def test_output_cut_off_by_its_reader_is_no_bug(tmp_path):
    """`kcache stats | head -c1`: the write after the reader left raised BrokenPipeError, reported as a
    bug (exit 70). Exit 141, as shells report SIGPIPE, and nothing on stderr but what the command said."""
    done = _closed_stdout(tmp_path, "config", "--json")
    assert done.returncode == ExitCode.BROKEN_PIPE == 141, done.stderr
    assert b"bug" not in done.stderr and b"Traceback" not in done.stderr


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--version"], ["gc", "--help"], ["db", "--help"]])
def test_help_and_version_cut_off_by_their_reader_exit_as_every_command_does(tmp_path, args):
    """`kcache --help | head -0` exited 1 (click's own answer to EPIPE, printed before any command ran),
    where `kcache gc --help | head -0` exited 141 as README's table says."""
    done = _closed_stdout(tmp_path, *args)
    assert (done.returncode, done.stderr) == (ExitCode.BROKEN_PIPE, b"")


def test_ls_of_a_row_with_text_for_its_size_is_an_index_error(tmp_path):
    """SQLite keeps text in a BIGINT column: ls read bytes 'x' back and crashed formatting it, as a bug."""
    from trees import write_tree

    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    index = f"sqlite:///{tmp_path / 'i.db'}"
    assert run("publish", "--from", tmp_path / "src", "--model", "m", "--index", index).exit_code == 0
    with sqlite3.connect(tmp_path / "i.db") as conn:
        conn.execute("UPDATE bundles SET bytes = 'x'")
    result = run("ls", "--index", index)
    assert result.exit_code == ExitCode.INDEX and "Traceback" not in result.output
    assert "bytes" in result.stderr
