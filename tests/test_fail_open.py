"""Fail-open for real: every restore that returns leaves kcache.env and an error marker behind.

Whatever goes wrong before the layout (the index, a flag, the store URL, a hostile ref, the
time budget itself), the init container must exit 0 with a pod that starts cold, and `kcache
ready` must see that restore finished. Only an unusable --into gets neither.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from hanging_server import SilentServer

from kcache import envfile, sources
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.readiness import check
from kcache.restore import read_state
from kcache.rootdir import STAGING_PREFIX
from kcache.store import ref_key
from kcache.store.local import LocalStore

MODEL = "fail-open-model"


@pytest.fixture(scope="module")
def facts_file(tmp_path_factory) -> Path:
    """This machine's own facts, as the model container would hand them to the init container."""
    path = tmp_path_factory.mktemp("facts") / "facts.json"
    done = subprocess.run([sys.executable, "-m", "kcache", "fingerprint", "--json", "--model", MODEL],
                          capture_output=True, text=True, check=True)  # fmt: skip
    path.write_text(done.stdout)
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bundle_key(facts_file: Path) -> str:
    out = CliRunner().invoke(main, ["fingerprint", "--json", "--facts-file", str(facts_file), "--model", MODEL])
    return json.loads(out.output)["bundle_key"]


@pytest.fixture
def empty_pg_database(pg_database):
    """A PostgreSQL database nobody ran `kcache db upgrade` on, on the test run's server."""
    import sqlalchemy

    name = f"kcache_empty_{uuid.uuid4().hex[:8]}"
    admin = sqlalchemy.create_engine(pg_database, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    yield pg_database.rsplit("/", 1)[0] + "/" + name
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


def newer_sqlite_index(tmp_path: Path) -> str:
    """A SQLite index that a newer kcache migrated past anything this one knows."""
    path = tmp_path / "newer.db"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        db.execute("INSERT INTO alembic_version VALUES ('9999')")
    return f"sqlite:///{path}"


def nested_ref_store(tmp_path: Path, key: str) -> str:
    """A store whose ref for our key is JSON nested deep enough to exhaust Python's recursion."""
    store = LocalStore(tmp_path / "store")
    store.put_bytes(ref_key(key), b"[" * 100_000 + b"]" * 100_000)
    return store.url


def nested_file(tmp_path: Path, name: str) -> str:
    """A JSON file nested deep enough to exhaust Python's recursion (a config another container wrote)."""
    path = tmp_path / name
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    return str(path)


# Each case: (extra arguments, extra environment); callables get (tmp_path, facts_file, request).
CASES = {
    "index-down": lambda t, f, r: (["--index", f"postgresql+psycopg://root@127.0.0.1:{free_port()}/none"], {}),
    "index-not-upgraded": lambda t, f, r: (["--index", r.getfixturevalue("empty_pg_database")], {}),
    "index-newer-than-kcache": lambda t, f, r: (["--index", newer_sqlite_index(t)], {}),
    "facts-file-typo": lambda t, f, r: (["--facts-file", str(t / "no-such-facts.json")], {}),
    "deeply-nested-facts-file": lambda t, f, r: (["--facts-file", nested_file(t, "facts.json")], {}),
    "deeply-nested-model-config": lambda t, f, r: (["--model-config", nested_file(t, "config.json")], {}),
    "trusted-key-typo": lambda t, f, r: (["--trusted-key", str(t / "no-such.pub")], {}),
    "unknown-store-scheme": lambda t, f, r: (["--store", "gs://bucket/cache"], {}),
    "deeply-nested-ref": lambda t, f, r: (["--store", nested_ref_store(t, bundle_key(f)), "--index", "none"], {}),
    "timeout-nan": lambda t, f, r: (["--timeout", "nan"], {}),
    "timeout-inf": lambda t, f, r: (["--timeout", "inf"], {}),
    "timeout-zero": lambda t, f, r: (["--timeout", "0"], {}),
    "timeout-huge": lambda t, f, r: (["--timeout", "9" * 400], {}),
    "env-timeout-garbage": lambda t, f, r: ([], {"KCACHE_RESTORE_TIMEOUT": "abc"}),
    "env-require-signature-garbage": lambda t, f, r: ([], {"KCACHE_REQUIRE_SIGNATURE": "abc"}),
    "bundle-id-prefix": lambda t, f, r: (["--bundle", "45422f"], {}),
    # Facts that cannot be keyed: canonical JSON is UTF-8 without NaN (each was a bug exit, 70).
    "model-not-utf8": lambda t, f, r: (["--model", "m\udce9"], {}),
    "model-config-nan": lambda t, f, r: (["--model-config", text_file(t, '{"rope_scaling": {"factor": NaN}}')], {}),
    "model-config-infinity": lambda t, f, r: (["--model-config", text_file(t, '{"max_len": -Infinity}')], {}),
    "model-config-lone-surrogate": lambda t, f, r: (["--model-config", text_file(t, '{"name": "\\ud800"}')], {}),
    "manifest-cap-superscript": lambda t, f, r: ([], {"KCACHE_MAX_MANIFEST_BYTES": "\u00b2"}),
}


def text_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.json"
    path.write_text(text)
    return str(path)


def run_restore(root: Path, facts_file: Path, args: list[str], env: dict, *extra: str):
    base = ["restore", "--into", str(root), "--model", MODEL, "--facts-file", str(facts_file)]
    return CliRunner().invoke(main, [*base, *args, *extra], env=env, catch_exceptions=False)


def assert_cold_but_ready_to_start(root: Path) -> dict:
    state = read_state(root)
    assert state is not None and state["status"] == "error" and state["reason"], state
    exports = envfile.read(root / envfile.NAME)
    assert exports == sources.all_exports(root)
    for source in sources.BUILTIN:
        assert source.restore_dir(root).is_dir()
    assert check(root).reason != "restore has not finished"
    return state


@pytest.mark.parametrize("case", list(CASES))
def test_early_failure_writes_marker_and_env_and_exits_0(tmp_path, facts_file, request, case):
    args, env = CASES[case](tmp_path, facts_file, request)
    result = run_restore(tmp_path / "root", facts_file, args, env)
    assert result.exit_code == 0, result.output + result.stderr
    assert "Traceback" not in result.output + result.stderr
    assert [line for line in result.stderr.splitlines() if "restore failed, starting cold" in line], result.stderr
    assert_cold_but_ready_to_start(tmp_path / "root")

    os.unlink(tmp_path / "root" / ".kcache-state.json")
    strict = run_restore(tmp_path / "root", facts_file, args, env, "--strict")
    assert strict.exit_code not in (0, 70), strict.stderr  # a named failure, not "a bug in kcache"
    assert_cold_but_ready_to_start(tmp_path / "root")


@pytest.mark.parametrize("planted", ["link-outside", "file", "fifo"])
def test_a_root_whose_tmp_is_unusable_still_gets_kcache_env(tmp_path, facts_file, planted):
    """ROOT/tmp left on a kept volume as a link out of ROOT (say to /dev/shm), a file or a FIFO:
    restore lays nothing there and fails, but it wrote no kcache.env either, and a model command that
    sources it (README's `. /cache/kcache.env`) failed on every start. The env file leaves out TMPDIR,
    which would send the model's temp files through the link or nowhere, and exports the rest as ever."""
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    if planted == "link-outside":
        (root / "tmp").symlink_to(outside)
    elif planted == "file":
        (root / "tmp").write_bytes(b"not a directory")
    else:
        os.mkfifo(root / "tmp")
    result = run_restore(root, facts_file, ["--store", f"file://{tmp_path / 'store'}", "--index", "none"], {})
    assert result.exit_code == 0, result.output + result.stderr
    state = read_state(root)
    assert state["status"] == "error" and "tmp" in state["reason"], state
    exports = envfile.read(root / envfile.NAME)
    assert exports == {k: v for k, v in sources.all_exports(root).items() if k != "TMPDIR"}
    assert list(outside.rglob("*")) == []
    assert check(root).reason != "restore has not finished"


def test_a_cubin_place_restore_cannot_list_still_gets_kcache_env(tmp_path, facts_file):
    """ROOT/flashinfer_cubin left on a kept volume as a directory restore's user cannot list (a container
    of the pod made it, mode 000): whether to export FLASHINFER_CUBIN_DIR asked for its entries, and the
    PermissionError left no kcache.env at all, where any other unusable place is only left out of it."""
    from unprivileged import run_kcache

    root = tmp_path / "root"
    (root / "flashinfer_cubin").mkdir(parents=True)
    (root / "flashinfer_cubin").chmod(0)
    args = ["restore", "--into", root, "--model", MODEL, "--facts-file", facts_file, "--store",
            f"file://{tmp_path / 'store'}", "--index", "none"]  # fmt: skip
    done = run_kcache(args)
    assert done.returncode == 0, done.stderr
    assert b"Traceback" not in done.stderr
    exports = envfile.read(root / envfile.NAME)
    assert exports == {k: v for k, v in sources.all_exports(root).items() if k != "FLASHINFER_CUBIN_DIR"}
    assert check(root).reason != "restore has not finished"


@pytest.mark.parametrize("long", [True, False], ids=["past-name-max", "thousands-deep-near-path-max"])
def test_a_root_path_the_kernel_cannot_take_fails_open(tmp_path, facts_file, long):
    """--into with a component past NAME_MAX made exists() raise ENAMETOOLONG before restore's fail-open
    path; one ~2000 levels deep made Path.mkdir(parents=True) recurse, and, just under PATH_MAX, giving back
    the room set aside for the marker raised ENAMETOOLONG over the failure: exit 70, even without --strict."""
    from kcache.removal import remove_tree

    top = tmp_path / "into"
    depth = (4070 - len(str(top))) // 2  # ROOT just under PATH_MAX (4096), whatever the temp dir's length
    into = top / ("x" * 300) if long else top.joinpath(*["d"] * depth)
    base = ["restore", "--into", str(into), "--model", MODEL, "--facts-file", str(facts_file), "--json"]
    try:
        relaxed = CliRunner().invoke(main, base, catch_exceptions=False)
        assert relaxed.exit_code == 0 and "bug" not in relaxed.output, relaxed.output
        strict = CliRunner().invoke(main, [*base, "--strict"], catch_exceptions=False)
        assert strict.exit_code == ExitCode.ROOT, strict.output  # no ROOT, or no room in it for what restore writes
    finally:  # pytest's own cleanup recurses
        if (tmp_path / "into").exists():
            remove_tree(tmp_path / "into")


@pytest.mark.parametrize("given", ["45422f", "45422f" * 11, "G" * 64, " " + "a" * 64])
def test_a_bundle_id_that_is_not_a_full_id_is_a_usage_error_not_a_lost_object(tmp_path, facts_file, given):
    result = run_restore(tmp_path / "root", facts_file, ["--bundle", given], {}, "--strict", "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == doc["exit_code"] == 2, result.output
    assert "full bundle id" in doc["error"] and "kcache ls --json" in doc["error"] and "missing" not in doc["error"]
    assert_cold_but_ready_to_start(tmp_path / "root")


def test_a_full_bundle_id_in_capitals_is_still_that_bundle(tmp_path, facts_file):
    result = run_restore(tmp_path / "root", facts_file, ["--bundle", "AB" * 32], {}, "--strict", "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == 10 and doc["status"] == "miss" and "ab" * 6 in doc["reason"]  # looked up: not there


def test_the_json_error_has_the_fields_a_hit_or_miss_has(tmp_path, facts_file):
    root = tmp_path / "root"
    miss = json.loads(run_restore(tmp_path / "other", facts_file, [], {}, "--json").stdout)
    error = json.loads(run_restore(root, facts_file, ["--store", "gs://bucket/cache"], {}, "--json").stdout)
    assert set(miss) - {"status"} <= set(error) and {"error", "hint", "exit_code"} <= set(error)
    assert error["status"] == "error" and error["bundle_key"] == bundle_key(facts_file)
    assert error["root"] == str(root) and error["env_file"] == str(root / envfile.NAME)
    assert (error["layers"], error["signed_by"], error["donors"], error["bundle_id"]) == ([], None, {}, None)
    early = json.loads(run_restore(root, facts_file, ["--timeout", "nan"], {}, "--json").stdout)
    assert early["bundle_key"] is None and early["env_file"] == str(root / envfile.NAME)  # before the fingerprint


@pytest.mark.parametrize("value", ["300", "5m", "90s", "1m30s", "2.5"])
def test_restore_timeout_accepts_seconds_and_durations(tmp_path, facts_file, value):
    result = run_restore(tmp_path / "root", facts_file, [], {"KCACHE_RESTORE_TIMEOUT": value}, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["status"] == "miss"
    assert read_state(tmp_path / "root")["status"] == "miss"


def test_unusable_into_is_the_one_failure_without_a_marker(tmp_path, facts_file):
    (tmp_path / "file").write_text("not a directory")
    result = run_restore(tmp_path / "file", facts_file, [], {})
    assert result.exit_code == 0 and "restore failed, starting cold" in result.stderr


# ---- a PostgreSQL index that accepts and never answers --------------------------------------


def restore_on_silent_index(root: Path, facts_file: Path, server: SilentServer, timeout: str) -> subprocess.Popen:
    """A real init container process whose PostgreSQL index is `server`, which never answers."""
    return subprocess.Popen(
        [sys.executable, "-m", "kcache", "restore", "--into", str(root), "--model", MODEL, "--facts-file",
         str(facts_file), "--timeout", timeout, "--index", f"postgresql+psycopg://root@127.0.0.1:{server.port}/x"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_silent_postgresql_index_fails_open_within_the_budget(tmp_path, facts_file):
    """A real init container process: the budget covers opening the index, so it ends cold."""
    root = tmp_path / "root"
    with SilentServer() as server:
        child = restore_on_silent_index(root, facts_file, server, "3")
        try:
            _out, err = child.communicate(timeout=60)  # generous: a hang would last forever
        except subprocess.TimeoutExpired:
            child.kill()
            pytest.fail("restore hung on an index that never answers")
        assert server.accepted.is_set()  # it really went to the silent server
    assert child.returncode == 0, err
    state = assert_cold_but_ready_to_start(root)
    assert "did not finish within 3 s" in state["reason"]


def test_a_restore_that_timed_out_opening_its_index_still_records_the_workload(tmp_path, facts_file):
    """The fingerprint was computed before the index hung: the marker keeps it, so the sidecar's
    `watch`/`publish --from ROOT` without --model publishes under this pod's model, not nothing."""
    from kcache.publish import restore_inputs

    root = tmp_path / "root"
    with SilentServer() as server:
        child = restore_on_silent_index(root, facts_file, server, "2")
        _out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    state = assert_cold_but_ready_to_start(root)
    assert "did not finish within 2 s" in state["reason"]
    assert restore_inputs(root) == {"model.id": MODEL}
    fingerprint = subprocess.run([sys.executable, "-m", "kcache", "fingerprint", "--model", MODEL, "--facts-file",
                                  str(facts_file), "--json"], capture_output=True, text=True, check=True)  # fmt: skip
    assert state["bundle_key"] == json.loads(fingerprint.stdout)["bundle_key"]


def test_silent_postgresql_index_fails_on_its_own_connect_timeout():
    """Outside restore's budget too (gc, publish, ls): connecting gives up instead of hanging."""
    import threading

    from kcache.errors import IndexDbError
    from kcache.index import Index

    outcome: list = []
    with SilentServer() as server:
        url = f"postgresql+psycopg://root@127.0.0.1:{server.port}/x"

        def attempt() -> None:
            try:
                Index.open(url)
            except IndexDbError as exc:
                outcome.append(exc)

        worker = threading.Thread(target=attempt, daemon=True)
        worker.start()
        worker.join(90)  # generous: the default connect timeout is far shorter, a hang is forever
        assert not worker.is_alive(), "connecting to a silent PostgreSQL never gave up"
    assert outcome and "cannot connect" in str(outcome[0])


@pytest.mark.parametrize("value", ["1", "true", "ON"])
def test_require_signature_from_the_environment_still_applies(tmp_path, facts_file, value):
    result = run_restore(tmp_path / "root", facts_file, [], {"KCACHE_REQUIRE_SIGNATURE": value}, "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["status"] == "error"
    assert "--require-signature" in assert_cold_but_ready_to_start(tmp_path / "root")["reason"]


def test_postgresql_sessions_carry_a_statement_timeout_unless_the_url_sets_one(pg_database):
    from kcache.index.db import make_engine

    for url, expected in ((pg_database, "2min"), (f"{pg_database}?options=-c%20statement_timeout%3D5000", "5s")):
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                assert conn.exec_driver_sql("SHOW statement_timeout").scalar() == expected
        finally:
            engine.dispose()


def _published(tmp_path, store, index, fp):
    from trees import write_tree

    from kcache.publish import publish

    write_tree(tmp_path / "src", {"inductor/k.py": b"kernel"})
    return publish(store, index, fp, sources.select(), root=tmp_path / "src", env={})


def test_a_disk_that_fills_after_the_swap_still_leaves_kcache_env_and_a_marker(tmp_path, store, sqlite_index, fp,
                                                                                 monkeypatch):  # fmt: skip
    """The bundle took the last free bytes: no new file can be written in ROOT, yet kcache.env and
    the marker must be (the pod sources one and readiness waits for the other)."""
    import errno

    from kcache import atomic
    from kcache import restore as restoring

    _published(tmp_path, store, sqlite_index, fp)
    real_swap, real_write, full = restoring._swap, atomic.write, []
    monkeypatch.setattr(restoring, "_swap", lambda *a: (real_swap(*a), full.append(True)))

    def write(*args, **kwargs):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(atomic, "write", write)
    root = tmp_path / "root"
    result = restoring.restore(store, sqlite_index, fp, root)
    assert result.status == "hit" and (root / "inductor/k.py").read_bytes() == b"kernel"
    assert "TORCHINDUCTOR_CACHE_DIR" in (root / envfile.NAME).read_text()
    assert read_state(root)["status"] == "hit" and check(root).restore["status"] == "hit"
    assert not [p.name for p in root.iterdir() if "reserved" in p.name]  # the room is given back


def test_a_bad_kcache_run_as_still_leaves_kcache_env(tmp_path, store, sqlite_index, fp, monkeypatch):
    from kcache.errors import ConfigError
    from kcache.restore import restore

    _published(tmp_path, store, sqlite_index, fp)
    monkeypatch.setenv("KCACHE_RUN_AS", "model\tuser")
    root = tmp_path / "root"
    with pytest.raises(ConfigError, match="run-as"):
        restore(store, sqlite_index, fp, root)
    assert "TORCHINDUCTOR_CACHE_DIR" in (root / envfile.NAME).read_text()
    assert read_state(root)["status"] == "error"


def test_cleanup_stops_at_the_budget_and_the_next_restore_finishes_it(tmp_path, store, sqlite_index, fp, monkeypatch):
    """Deleting the previous layers and a killed restore's leftovers is bounded by --timeout: a
    restore past its deadline leaves the rest behind (out of the layers' way) for the next one."""
    from kcache import rootdir
    from kcache.restore import restore

    _published(tmp_path, store, sqlite_index, fp)
    root = tmp_path / "root"
    leftover = root / f"{STAGING_PREFIX}1-killed" / "files/inductor"
    for d in range(3):
        (leftover / f"d{d}").mkdir(parents=True)
        (leftover / f"d{d}/f").write_bytes(b"x")
    (root / "inductor").mkdir()
    (root / "inductor/old.py").write_bytes(b"previous bundle")
    monkeypatch.setattr(rootdir, "_now", lambda: float("inf"))  # every deadline has passed
    result = restore(store, sqlite_index, fp, root, timeout=60)
    assert result.status == "hit" and (root / "inductor/k.py").read_bytes() == b"kernel"
    assert not (root / "inductor/old.py").exists()
    left = sorted(p.name for p in root.glob(STAGING_PREFIX + "*"))
    assert left and read_state(root)["status"] == "hit"
    monkeypatch.undo()
    assert restore(store, sqlite_index, fp, root, timeout=60).status == "hit"
    assert not list(root.glob(STAGING_PREFIX + "*"))


def test_cleanup_without_a_budget_removes_everything(tmp_path):
    from kcache import rootdir

    stale = tmp_path / f"{STAGING_PREFIX}1-killed"
    (stale / "a/b").mkdir(parents=True)
    (stale / "a/b/f").write_bytes(b"x")
    (stale / "link").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere/keep").write_bytes(b"not ours")
    with rootdir.staging_removed(tmp_path, None):  # no budget: waited for to the end
        pass
    assert not stale.exists() and (tmp_path / "elsewhere/keep").read_bytes() == b"not ours"


@pytest.mark.parametrize("timeout", [None, 60], ids=["no-budget", "budget"])
def test_a_previous_layer_nested_past_the_recursion_limit_is_removed(tmp_path, store, sqlite_index, fp, timeout):
    """The model compiles into the restored layers, so what they hold is the workload's. shutil.rmtree
    recursed once a level (Python 3.11): a tree ~1000 deep there made the next restore without a
    budget a bug exit, and with one left it in a staging directory every later restore failed to
    delete again."""
    from trees import nest

    from kcache.removal import remove_tree
    from kcache.restore import restore

    _published(tmp_path, store, sqlite_index, fp)
    root = tmp_path / "root"
    nest(root / "inductor", ["d"] * 1100, "k.so", b"compiled by the pod")
    try:
        result = restore(store, sqlite_index, fp, root, timeout=timeout)
        assert result.status == "hit" and (root / "inductor/k.py").read_bytes() == b"kernel"
        assert not (root / "inductor/d").exists()
        assert not list(root.glob(STAGING_PREFIX + "*"))
    finally:  # pytest's own cleanup recurses too
        for left in [root / "inductor/d", *root.glob(STAGING_PREFIX + "*")]:
            if left.is_dir():
                remove_tree(left)


def test_a_swap_that_fails_part_way_puts_every_layer_back(tmp_path, store, sqlite_index, fp, monkeypatch):
    """ROOT never holds some layers of the new bundle beside the old rest: a rename that fails on
    the second layer (EXDEV from a mount, EACCES on another user's directory) undoes the first."""
    import errno

    from trees import write_tree

    from kcache import restore as restoring
    from kcache.errors import RootError
    from kcache.publish import publish

    write_tree(tmp_path / "src", {"inductor/k.py": b"new graph", "triton/k1/add.cubin": b"new kernel"})
    publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    root = tmp_path / "root"
    write_tree(root, {"inductor/k.py": b"old graph", "triton/k1/add.cubin": b"old kernel"})
    real = os.rename

    def rename(src, dst):
        if str(dst).endswith("/triton") and str(src).endswith("/files/triton"):  # the new layer into place
            raise OSError(errno.EXDEV, "Invalid cross-device link", str(dst))
        return real(src, dst)

    monkeypatch.setattr(restoring.os, "rename", rename)
    with pytest.raises(RootError):
        restoring.restore(store, sqlite_index, fp, root)
    assert (root / "inductor/k.py").read_bytes() == b"old graph"
    assert (root / "triton/k1/add.cubin").read_bytes() == b"old kernel"
    assert read_state(root)["status"] == "error"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_restore_stopped_by_a_signal_still_leaves_env_and_marker(tmp_path, facts_file, sig):
    """The kubelet stops an init container with SIGTERM (pod deleted, node drained); a person with ^C.
    Either way what ROOT holds must say the restore ended, as for any other failure."""
    root = tmp_path / "root"
    with SilentServer() as server:
        child = restore_on_silent_index(root, facts_file, server, "120")
        try:
            assert server.accepted.wait(60), "restore never reached its index"
            child.send_signal(sig)
            _out, err = child.communicate(timeout=60)
        finally:
            if child.poll() is None:
                child.kill()
    assert child.returncode == 128 + sig, err
    state = assert_cold_but_ready_to_start(root)
    assert "interrupted" in state["reason"]


@pytest.mark.parametrize("planted", ["directory", "dangling-link", "link-to-a-directory", "socket"])
def test_a_lock_path_that_is_no_file_does_not_keep_every_restore_out(tmp_path, store, sqlite_index, fp, planted):
    """ROOT outlives pods on a node-local volume, and whoever else writes it (the model container, in
    a shared ROOT) may leave something at .kcache-lock that no lock file can be opened as. Every
    restore then failed before its marker: no pod on that volume would ever become ready."""
    from kcache import rootdir
    from kcache.restore import restore

    _published(tmp_path, store, sqlite_index, fp)
    root = tmp_path / "root"
    root.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_bytes(b"not ours")
    lock = root / rootdir.LOCK_NAME
    listener = socket.socket(socket.AF_UNIX)
    {"directory": lambda: (lock.mkdir(), (lock / "inside").write_bytes(b"x")),
     "dangling-link": lambda: lock.symlink_to(tmp_path / "nowhere"),
     "link-to-a-directory": lambda: lock.symlink_to(elsewhere),
     "socket": lambda: listener.bind(str(lock))}[planted]()  # fmt: skip
    with listener:
        result = restore(store, sqlite_index, fp, root, timeout=60)
    assert result.status == "hit" and (root / "inductor/k.py").read_bytes() == b"kernel"
    assert read_state(root)["status"] == "hit" and (root / envfile.NAME).is_file()
    assert lock.is_file() and not lock.is_symlink()
    assert not list(root.glob(STAGING_PREFIX + "*")) and (elsewhere / "keep").read_bytes() == b"not ours"


@pytest.mark.parametrize("name", [envfile.NAME, ".kcache-state.json"])
def test_a_directory_where_the_env_file_or_the_marker_goes_does_not_keep_the_pod_from_starting(
    tmp_path, store, sqlite_index, fp, name
):
    """Something else writing a kept ROOT left a directory at kcache.env (the model's command sources
    it) or at the marker (readiness waits for it): the rename onto it failed, and the pod never
    started. Neither name is ever a directory of ours, so it goes aside with the staging."""
    from kcache.restore import restore

    _published(tmp_path, store, sqlite_index, fp)
    root = tmp_path / "root"
    (root / name).mkdir(parents=True)
    (root / name / "inside").write_bytes(b"x")
    result = restore(store, sqlite_index, fp, root, timeout=60)
    assert result.status == "hit" and (root / "inductor/k.py").read_bytes() == b"kernel"
    assert (root / envfile.NAME).is_file() and read_state(root)["status"] == "hit"
    assert not list(root.glob(STAGING_PREFIX + "*"))


def test_a_directory_where_warmup_writes_its_marker_is_cleared_by_restore(tmp_path, store, sqlite_index, fp):
    """Restore begins a pod's start and clears the last start's warmup and watch markers; a directory
    at one of them was left, and the warmup that follows could never write its marker (no rename
    replaces a directory): the pod would never become ready."""
    from kcache.readiness import WARMUP_MARKER, WATCH_MARKER, write_marker
    from kcache.restore import restore

    _published(tmp_path, store, sqlite_index, fp)
    root = tmp_path / "root"
    for name in (WARMUP_MARKER, WATCH_MARKER):
        (root / name).mkdir(parents=True)
        (root / name / "inside").write_bytes(b"x")
    assert restore(store, sqlite_index, fp, root, timeout=60).status == "hit"
    for name in (WARMUP_MARKER, WATCH_MARKER):
        assert not (root / name).exists()
        write_marker(root, name, {"status": "ok"})  # what warmup and watch do next
    assert not list(root.glob(STAGING_PREFIX + "*"))


@pytest.mark.parametrize("name", [f".tmp-{envfile.NAME}-reserved", ".tmp-.kcache-state.json-reserved"])
def test_a_fifo_where_room_is_set_aside_does_not_hang_restore(tmp_path, facts_file, name):
    """Opening a FIFO for writing waits for a reader: with one planted at a reserve file's name (a
    kept volume, another container), restore never ended and held ROOT's lock for good."""
    root = tmp_path / "root"
    root.mkdir()
    os.mkfifo(root / name)
    child = subprocess.Popen(
        [sys.executable, "-m", "kcache", "restore", "--into", str(root), "--model", MODEL, "--facts-file",
         str(facts_file), "--timeout", "3", "--store", f"file://{tmp_path / 'store'}", "--index", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _out, err = child.communicate(timeout=60)  # generous: a hang would last forever
    except subprocess.TimeoutExpired:
        child.kill()
        with open(os.open(root / name, os.O_RDONLY | os.O_NONBLOCK), "rb"):  # let it go
            pass
        pytest.fail("restore hung on a FIFO in ROOT")
    assert child.returncode == 0, err
    assert read_state(root)["status"] == "miss"  # an empty store: the restore itself ran
    assert envfile.read(root / envfile.NAME) == sources.all_exports(root)
