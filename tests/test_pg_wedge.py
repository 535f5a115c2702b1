"""A PostgreSQL index behind a proxy that stops answering once the client has logged in.

The proxy's kernel keeps ACKing (the socket is open), so neither TCP keepalives nor the server's
statement_timeout ends the client's wait: only kcache's own bound on each round trip does. Every
command must then end with the index's error exit (restore: cold, inside its budget), not hang.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
from click.testing import CliRunner
from test_fail_open import MODEL, assert_cold_but_ready_to_start
from trees import write_tree
from wedging_forwarder import WedgingForwarder

from kcache.cli import main
from kcache.cli.errors import ExitCode

BOUND = 120  # seconds: generous; without a client-side bound the wait lasts until TCP gives up (hours)


def run_bounded(args: list[str]):
    """The real CLI in a thread; None if it is still waiting after BOUND s."""
    done: list = []
    worker = threading.Thread(target=lambda: done.append(CliRunner().invoke(main, args, catch_exceptions=False)),
                              daemon=True)  # fmt: skip
    worker.start()
    worker.join(BOUND)
    return done[0] if done else None


@pytest.fixture(scope="module")
def facts_file(tmp_path_factory):
    """This machine's own facts, as the model container would hand them to the init container."""
    path = tmp_path_factory.mktemp("facts") / "facts.json"
    done = subprocess.run([sys.executable, "-m", "kcache", "fingerprint", "--json", "--model", MODEL],
                          capture_output=True, text=True, check=True)  # fmt: skip
    path.write_text(done.stdout)
    return path


@pytest.fixture
def wedge_at(pg_index, monkeypatch):
    """A forwarder to the test run's PostgreSQL (at head, empty) that wedges on the given cue."""
    monkeypatch.setenv("KCACHE_INDEX_READ_TIMEOUT", "2")
    host, port = pg_index.engine.url.host, pg_index.engine.url.port or 5432
    opened: list[WedgingForwarder] = []

    def make(cue: bytes) -> tuple[WedgingForwarder, str]:
        opened.append(WedgingForwarder((host, port), cue))
        return opened[-1], opened[-1].url(pg_index.url)

    yield make
    for forwarder in opened:
        forwarder.close()


def test_gc_on_an_index_that_stops_answering_after_login_ends_with_the_index_error(tmp_path, wedge_at):
    (tmp_path / "store").mkdir()  # gc opens only a store that exists
    forwarder, url = wedge_at(b"alembic_version")  # the first statement after login
    result = run_bounded(["gc", "--store", f"file://{tmp_path / 'store'}", "--index", url, "--keep-last", "1"])
    assert forwarder.wedged.is_set(), result and result.output
    assert result is not None, f"gc still waiting on a wedged index after {BOUND} s"
    assert result.exit_code == ExitCode.INDEX, result.output


def test_publish_whose_commit_meets_a_wedged_index_ends_with_the_index_error(tmp_path, wedge_at):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph", "triton/k/kernel.cubin": b"\x7fELF"})
    forwarder, url = wedge_at(b"pg_advisory_xact_lock")  # the commit point
    result = run_bounded(["publish", "--from", str(tmp_path / "src"), "--model", "m", "--store",
                          f"file://{tmp_path / 'store'}", "--index", url])  # fmt: skip
    assert forwarder.wedged.is_set(), result and result.output
    assert result is not None, f"publish still waiting on a wedged index after {BOUND} s"
    assert result.exit_code == ExitCode.INDEX, result.output


def test_postgresql_connections_carry_keepalives_unless_the_url_sets_them(pg_database):
    from kcache.index.db import make_engine

    for url, idle in ((pg_database, "30"), (f"{pg_database}?keepalives_idle=7", "7")):
        engine = make_engine(url)
        try:
            with engine.connect() as conn:
                params = conn.connection.driver_connection.info.get_parameters()
        finally:
            engine.dispose()
        assert params["keepalives_idle"] == idle and params["tcp_user_timeout"] == "60000"


def test_restore_on_an_index_that_stops_answering_after_login_ends_cold_inside_its_budget(tmp_path, facts_file,
                                                                                           wedge_at):  # fmt: skip
    """A real init container process, with the default (longer) round-trip bound: its budget ends it."""
    (tmp_path / "store").mkdir()
    forwarder, url = wedge_at(b"alembic_version")
    env = {k: v for k, v in os.environ.items() if k != "KCACHE_INDEX_READ_TIMEOUT"}
    child = subprocess.Popen([sys.executable, "-m", "kcache", "restore", "--into", str(tmp_path / "root"), "--model",
                              MODEL, "--facts-file", str(facts_file), "--timeout", "3", "--store",
                              f"file://{tmp_path / 'store'}", "--index", url],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        _out, err = child.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        child.kill()
        pytest.fail("restore hung on a wedged index")
    assert forwarder.wedged.is_set()
    assert child.returncode == 0, err
    assert "did not finish within 3 s" in assert_cold_but_ready_to_start(tmp_path / "root")["reason"]


def test_a_psycopg_whose_wait_takes_other_arguments_gets_keepalives_only(pg_database):
    """The bound overrides psycopg 3.3's Connection.wait(gen, interval, timeout), which is not its public
    API: a release that changed it must leave connections as psycopg makes them, not break every statement."""
    import psycopg
    from sqlalchemy import make_url

    from kcache.index import db

    class Changed(psycopg.Connection):
        def wait(self, gen, *, deadline=None):  # a release that reshaped the method
            return super().wait(gen)

    dsn = make_url(pg_database).set(drivername="postgresql").render_as_string(hide_password=False)
    for connection_class, bounded in ((psycopg.Connection, True), (Changed, False)):
        release = SimpleNamespace(errors=psycopg.errors, Connection=connection_class, connect=connection_class.connect)
        conn = db._bounded_connect(release, 1.0)(None, None, [dsn], {})
        try:
            assert conn.execute("SELECT 1").fetchone() == (1,)
            assert (type(conn).__name__ == "BoundedConnection") is bounded
        finally:
            conn.close()
