"""Models and migrations agree, and HEAD names the newest migration."""

from importlib import resources

import pytest
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from kcache.errors import IndexDbError
from kcache.index import Index
from kcache.index.db import HEAD, current_revision, make_engine, upgrade
from kcache.index.models import Base


def test_head_constant_matches_migrations():
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("kcache._migrations")))
    assert ScriptDirectory.from_config(cfg).get_current_head() == HEAD


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_models_match_migrated_schema(backend, tmp_path, request):
    url = f"sqlite:///{tmp_path / 'm.db'}" if backend == "sqlite" else request.getfixturevalue("pg_database")
    engine = make_engine(url)
    upgrade(engine)
    assert current_revision(engine) == HEAD
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    engine.dispose()
    assert diff == []


def test_sqlite_index_upgrades_itself(tmp_path):
    index = Index.open(f"sqlite:///{tmp_path / 'deep' / 'dir' / 'i.db'}")
    assert current_revision(index.engine) == HEAD
    index.close()


def test_unmigrated_postgres_is_refused_with_a_hint(pg_database):
    from sqlalchemy import create_engine

    engine = create_engine(pg_database)
    with engine.begin() as conn:
        tables = ", ".join(t.name for t in reversed(Base.metadata.sorted_tables))
        conn.exec_driver_sql(f"DROP TABLE IF EXISTS {tables}, alembic_version")
    engine.dispose()
    with pytest.raises(IndexDbError, match="kcache db upgrade"):
        Index.open(pg_database)


def test_unreachable_index_is_one_clear_error():
    with pytest.raises(IndexDbError, match="cannot connect"):
        Index.open("postgresql+psycopg://nobody@127.0.0.1:1/none?connect_timeout=2")


def test_a_fresh_sqlite_index_is_created_at_head_with_the_migrated_schema(tmp_path):
    """A new SQLite file gets its tables from the models, not by replaying the migrations: the schema
    must be what the migrations make, and a later migration must find it at HEAD."""
    fresh = Index.open(f"sqlite:///{tmp_path / 'fresh.db'}")
    migrated = make_engine(f"sqlite:///{tmp_path / 'migrated.db'}")
    upgrade(migrated)
    assert current_revision(fresh.engine) == HEAD
    for engine in (fresh.engine, migrated):
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    with fresh.engine.connect() as a, migrated.connect() as b:
        tables = ("SELECT name FROM sqlite_master WHERE type IN ('table', 'index') AND name NOT LIKE 'sqlite_%' "
                  "ORDER BY 1")
        assert a.exec_driver_sql(tables).fetchall() == b.exec_driver_sql(tables).fetchall()
    assert upgrade(fresh.engine) == (HEAD, HEAD)  # nothing left to apply
    fresh.close()
    migrated.dispose()


def test_creating_a_fresh_sqlite_index_does_not_load_alembic(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from kcache.index import Index; "
            f"Index.open('sqlite:///{tmp_path / 'i.db'}').close(); print('alembic' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("round_", range(3))  # a race: each round is one more chance to lose it
def test_processes_opening_an_old_sqlite_index_at_once_all_get_it_upgraded(tmp_path, round_):
    """After an upgrade of kcache, a restore, a watch publish and an ls open the node's index at one
    moment: alembic runs SQLite DDL outside a transaction, so concurrent upgraders interleaved and every
    one but the winner failed (duplicate column, table exists, a known revision called unknown)."""
    import os
    import subprocess
    import sys

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = make_engine(url)
    upgrade(engine, "0001")
    engine.dispose()
    gate_out, gate_in = os.pipe()  # everyone waits to read the gate; closing it releases all at once
    code = ("import os, sys\nfrom kcache.index import Index\nimport alembic.command\n"
            "os.read(int(sys.argv[2]), 1)\nIndex.open(sys.argv[1]).close()\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, url, str(gate_out)], stderr=subprocess.PIPE, text=True,
                              pass_fds=[gate_out]) for _ in range(6)]  # fmt: skip
    os.close(gate_out)
    os.close(gate_in)
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 6, "\n".join(e for e in errors if e)
    engine = make_engine(url)
    assert current_revision(engine) == HEAD
    engine.dispose()


def test_a_process_killed_while_it_creates_a_fresh_sqlite_index_leaves_it_openable(tmp_path):
    """The first publish or restore of a node creates the index; the pod is killed (SIGKILL, OOM) after
    some of the tables were made. pysqlite commits each CREATE TABLE on its own, so the file held tables
    without a schema revision, and every later command failed with "table ... already exists". The child
    parks on a FIFO right after its first table is created; only then is it killed."""
    import os

    url = f"sqlite:///{tmp_path / 'i.db'}"
    fifo = tmp_path / "after-first-table"
    os.mkfifo(fifo)
    first = next(iter(Base.metadata.sorted_tables)).name
    code = ("import sys\nfrom sqlalchemy import event\nfrom kcache.index import Index\n"
            "from kcache.index.models import Base\n"
            f"event.listen(Base.metadata.tables[{first!r}], 'after_create', lambda *a, **k: open(sys.argv[2]).read())\n"
            "Index.open(sys.argv[1])\n")  # fmt: skip
    kill_when_parked(code, url, fifo)  # once the child has made its first table
    assert_whole_at_head(url)


def test_an_index_a_killed_creation_left_without_a_revision_is_created_again(tmp_path):
    """What such a kill left before creation was one transaction: some of kcache's tables, empty (no
    command could write a row into them), and no revision. It is made whole, not refused for ever."""
    url = f"sqlite:///{tmp_path / 'i.db'}"
    engine = make_engine(url)
    for table in list(Base.metadata.sorted_tables)[:2]:
        table.create(engine)
    engine.dispose()
    index = Index.open(url)
    assert current_revision(index.engine) == HEAD
    with index.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    index.close()


@pytest.mark.parametrize("what", ["a row", "a table of someone else's"])
def test_a_database_without_a_revision_that_holds_data_is_never_dropped(tmp_path, what):
    url = f"sqlite:///{tmp_path / 'i.db'}"
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE bundles (x INTEGER)")
        conn.exec_driver_sql("INSERT INTO bundles VALUES (1)" if what == "a row" else "CREATE TABLE theirs (x INTEGER)")
    engine.dispose()
    with pytest.raises(IndexDbError):
        Index.open(url)
    engine = make_engine(url)
    with engine.connect() as conn:
        assert conn.exec_driver_sql("SELECT count(*) FROM bundles").scalar() == (what == "a row")
    engine.dispose()


@pytest.mark.parametrize("start, statement", [("0003", "_alembic_tmp_"), ("0004", "CREATE TABLE")],
                         ids=["table-copied-by-batch", "new-table"])  # fmt: skip
def test_a_process_killed_while_it_upgrades_a_sqlite_index_leaves_it_upgradable(tmp_path, start, statement):
    """A node's index from an older kcache is upgraded in place by the first command of the new one; the
    pod is killed part-way. Alembic runs SQLite's DDL without a transaction, so each statement stayed:
    a table copy half made, an index already there, and every later command failed on it. The child
    parks on a FIFO right after the first statement that names `statement`; only then is it killed."""
    import os

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = make_engine(url)
    upgrade(engine, start)
    engine.dispose()
    fifo = tmp_path / "mid-upgrade"
    os.mkfifo(fifo)
    code = ("import sys\nfrom sqlalchemy import Engine, event\nfrom kcache.index import Index\n"
            "def park(conn, cursor, sql, *args):\n"
            f"    if {statement!r} in sql:\n        open(sys.argv[2]).read()\n"
            "event.listen(Engine, 'after_cursor_execute', park)\nIndex.open(sys.argv[1])\n")  # fmt: skip
    kill_when_parked(code, url, fifo)  # once the child has run that statement
    assert_whole_at_head(url)


def kill_when_parked(code: str, url: str, fifo) -> None:
    """Run `code` in a child (argv: url, fifo) and SIGKILL it once it opens the FIFO to wait on it."""
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", code, url, str(fifo)], stderr=subprocess.PIPE, text=True)
    with open(fifo, "w"):  # returns once the child opened the FIFO: it is parked there
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)


def assert_whole_at_head(url: str) -> None:
    """The next open finds (or makes) the index at HEAD with exactly the models' schema."""
    index = Index.open(url)
    assert current_revision(index.engine) == HEAD
    with index.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    index.close()
