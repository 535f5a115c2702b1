"""Engines and schema upgrades for the index.

SQLite (the embedded default) upgrades itself on first use; any other database must be upgraded
on purpose with `kcache db upgrade`, so a fleet of pods never races to migrate production.

PostgreSQL connections get a connect timeout, a statement timeout, an idle-in-transaction timeout
and TCP keepalives, and (with psycopg 3) a bound on every round trip, so an index that accepts TCP
but never answers fails instead of holding a command forever. The statement timeout is the server's and keepalives end
only a wait on a peer that is gone: a proxy that stops forwarding once the client has logged in
(pgbouncer, a cloud SQL proxy) keeps its socket open and ACKs every byte and every probe, and the
client waited on it until the kernel gave up (hours). KCACHE_INDEX_READ_TIMEOUT is that bound:
longer than the statement timeout, since a statement may rightly run (or wait for a lock) that
long with nothing on the wire (a URL whose `options` raise statement_timeout needs it raised too).
A URL that sets `connect_timeout`, `options` or a keepalive parameter itself keeps its own values.
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from inspect import signature
from pathlib import Path

from sqlalchemy import Engine, create_engine, event, inspect, make_url, text
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError, SQLAlchemyError

from kcache import durations
from kcache.errors import ConfigError, IndexDbError
from kcache.untrusted import one_line

log = logging.getLogger(__name__)

# The newest migration in migrations/versions; tests/index/test_migrations.py keeps the two in step.
HEAD = "0102_yanks"
PG_CONNECT_TIMEOUT = 10  # seconds, for connecting and logging in
# The longest string or blob a SQLite connection reads or writes (SQLITE_LIMIT_LENGTH): any writer of
# the file is untrusted, SQLite's length() stops at a NUL and reads the whole value to count it, and
# the largest value kcache writes is a row's facts (kcache.index.repo.MAX_ROW_TEXT, 1 MiB).
SQLITE_MAX_VALUE = 8 * 1024 * 1024
UPGRADE_LOCK_WAIT = 60.0  # seconds another process may take upgrading a SQLite index before we give up
PG_STATEMENT_TIMEOUT_MS = 120_000  # no single kcache statement should run longer, GC's included
# No kcache transaction waits on anything but the database between its statements (milliseconds), yet
# one may hold a key's commit lock (Index.lock_key): a kcache process stopped mid-transaction (frozen,
# its network gone while the server's side stays open) held every publish of that key, each failing on
# the statement timeout. The server ends such a session after this long, and its locks with it.
PG_IDLE_IN_TRANSACTION_TIMEOUT_MS = 30_000
# The longest a PostgreSQL round trip may go without its answer: the statement timeout, and time for
# the server's error to come back. KCACHE_INDEX_READ_TIMEOUT overrides it.
PG_READ_TIMEOUT = "150"
# libpq's TCP settings: a peer that vanished (a node gone, a NAT that dropped the flow) is noticed in
# about a minute, not the kernel's two hours; tcp_user_timeout (ms) bounds data left unacknowledged.
PG_KEEPALIVES = {"keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3,
                 "tcp_user_timeout": 60_000}  # fmt: skip


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL, a busy timeout and foreign keys."""
    if _in_memory_sqlite(url):  # each pooled connection (each thread) would get a database of its own, empty
        raise ConfigError("index URL", url, "is an in-memory SQLite database, which no other connection or "
                          "command sees; give a file, e.g. sqlite:////var/lib/kcache/index.db")  # fmt: skip
    try:
        if url.startswith("sqlite:///"):
            Path(url.removeprefix("sqlite:///")).expanduser().parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(url, connect_args={"timeout": 30})
            event.listen(engine, "connect", _sqlite_pragmas)
            return engine
        engine = create_engine(url, pool_pre_ping=True, connect_args=_pg_connect_args(url))
        if engine.dialect.driver == "psycopg":
            event.listen(engine, "do_connect", _bounded_connect(engine.dialect.loaded_dbapi, _pg_read_timeout()))
        return engine
    except (ArgumentError, NoSuchModuleError, ValueError, TypeError) as exc:  # ValueError: ?timeout=abc, a bad port
        raise ConfigError("index URL", url, f"not a usable SQLAlchemy URL ({exc})") from None
    except ModuleNotFoundError as exc:
        raise ConfigError("index URL", url, f"driver {exc.name!r} is not installed") from None
    except OSError as exc:
        raise IndexDbError(url, f"cannot create its directory: {exc.strerror}") from None


def _in_memory_sqlite(url: str) -> bool:
    if not url.startswith("sqlite:"):
        return False
    rest = url.removeprefix("sqlite:").lstrip("/")
    path, _, query = rest.partition("?")
    return path in ("", ":memory:") or "mode=memory" in query


def _pg_connect_args(url: str) -> dict:
    """libpq timeouts for psycopg (3 or 2); other drivers get their defaults."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql" or parsed.get_driver_name() not in ("psycopg", "psycopg2"):
        return {}
    args: dict = {}
    if "connect_timeout" not in parsed.query:
        args["connect_timeout"] = PG_CONNECT_TIMEOUT
    if "options" not in parsed.query:
        args["options"] = (f"-c statement_timeout={PG_STATEMENT_TIMEOUT_MS} "
                           f"-c idle_in_transaction_session_timeout={PG_IDLE_IN_TRANSACTION_TIMEOUT_MS}")
    args.update({name: value for name, value in PG_KEEPALIVES.items() if name not in parsed.query})
    return args


def _pg_read_timeout() -> float:
    text = os.environ.get("KCACHE_INDEX_READ_TIMEOUT") or PG_READ_TIMEOUT
    return durations.parse(text, "KCACHE_INDEX_READ_TIMEOUT", bare_seconds=True, positive=True).total_seconds()


def _bounded_connect(psycopg, read_timeout: float):
    """A `do_connect` hook: psycopg 3 connections whose every round trip (a statement, a commit, a
    rollback) ends within `read_timeout` s. One that does not is closed (what it was in the middle
    of is unknown) and fails as OperationalError, which SQLAlchemy takes for a lost connection."""
    wait_timeout = getattr(psycopg.errors, "_WaitTimeout", None)
    if wait_timeout is None or not _waits_with_timeout(psycopg.Connection):  # keepalives only
        return lambda _dialect, _record, cargs, cparams: psycopg.connect(*cargs, **cparams)

    class BoundedConnection(psycopg.Connection):
        def wait(self, gen, interval=0.1, timeout=None):
            try:
                return super().wait(gen, interval, read_timeout if timeout is None else timeout)
            except wait_timeout:
                self.pgconn.finish()
                raise psycopg.OperationalError(f"no answer within {read_timeout:g} s (KCACHE_INDEX_READ_TIMEOUT): "
                                               "the server or a proxy in front of it is stuck") from None  # fmt: skip

    return lambda _dialect, _record, cargs, cparams: BoundedConnection.connect(*cargs, **cparams)


def _waits_with_timeout(connection_class) -> bool:
    """Whether `Connection.wait` is psycopg 3.3's `(gen, interval, timeout)`, the method the bound
    overrides. It is not psycopg's public API: another release that changed it gets keepalives only,
    not every statement failing on a signature that no longer fits."""
    try:
        names = list(signature(connection_class.wait).parameters)
    except (TypeError, ValueError):
        return False
    return names[:4] == ["self", "gen", "interval", "timeout"]


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    if hasattr(dbapi_conn, "setlimit"):  # Python 3.11+: no value longer than a row of ours may be
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, SQLITE_MAX_VALUE)
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def current_revision(engine: Engine) -> str | None:
    """The schema revision recorded in the database, or None for an empty one."""
    with engine.connect() as conn:
        if not inspect(conn).has_table("alembic_version"):
            return None
        return conn.execute(text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(engine: Engine, target: str = "head") -> tuple[str | None, str]:
    """Apply pending migrations up to `target`. Returns (revision before, revision after).

    On SQLite all of them are one transaction: alembic runs SQLite's DDL without one, so a process
    killed part-way (the node's first command after a kcache upgrade, OOM-killed) left a table copy
    or an index that every later upgrade failed on ("table _alembic_tmp_bundles already exists")."""
    from alembic import command
    from alembic.config import Config

    before = current_revision(engine)
    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("kcache._migrations")))
    sqlite = engine.dialect.name == "sqlite"
    with engine.connect() as conn, _ddl_transaction(conn) if sqlite else conn.begin():
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, target)
    return before, current_revision(engine) or ""


def ensure_schema(engine: Engine, url: str) -> None:
    """Make sure the schema is at HEAD: upgrade SQLite in place, refuse anything else."""
    try:
        revision = current_revision(engine)
        if revision == HEAD:
            return
        _check_known(url, revision)
        if engine.dialect.name == "sqlite":
            with _upgrade_lock(engine, url):
                revision = current_revision(engine)  # another process may have upgraded it meanwhile
                if revision == HEAD or (revision is None and _create_fresh(engine)):
                    return
                _check_known(url, revision)
                from alembic.util import CommandError

                log.info("upgrading index %s from %s to %s", url, revision, HEAD)
                try:
                    upgrade(engine)
                except CommandError as exc:
                    if not _known(revision):  # a newer kcache's schema
                        raise IndexDbError(url, f"schema is at {revision}, which this kcache (schema {HEAD}) does "
                                                "not know: use a newer kcache") from None  # fmt: skip
                    raise IndexDbError(url, f"cannot upgrade from {revision}: {exc}") from None
                except SQLAlchemyError:
                    # A kcache without this lock may have migrated the same file a moment earlier.
                    if current_revision(engine) != HEAD:
                        raise
            return
    except OperationalError as exc:
        raise IndexDbError(url, f"cannot connect: {describe_error(exc)}") from None
    except SQLAlchemyError as exc:
        raise IndexDbError(url, describe_error(exc)) from None
    raise IndexDbError(url, f"schema is at {revision or 'nothing'}, not {HEAD}: run `kcache db upgrade`")


@contextmanager
def _upgrade_lock(engine: Engine, url: str) -> Iterator[None]:
    """One upgrader of a SQLite file at a time (across processes): alembic runs SQLite's DDL outside a
    transaction, and upgraders that interleaved failed (a column or table already there). Without a
    file (in memory), or where the lock cannot be created (a read-only directory), no lock."""
    from kcache import filelock

    database = engine.url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    try:
        lock = filelock.acquire(Path(f"{database}.upgrade-lock"), filelock.EXCLUSIVE,
                                time.monotonic() + UPGRADE_LOCK_WAIT)  # fmt: skip
    except OSError as exc:
        log.debug("no upgrade lock beside %s: %s", database, exc)
        yield
        return
    if lock is None:
        raise IndexDbError(url, f"another process has been upgrading it for {UPGRADE_LOCK_WAIT:g} s")
    with lock:
        yield


def _revision_or_none(engine: Engine) -> str | None:
    """The recorded revision, or None where even that cannot be read (the error at hand says more)."""
    try:
        return current_revision(engine)
    except SQLAlchemyError:
        return None


def _known(revision: str | None) -> bool:
    """Whether this kcache has a migration whose id is `revision`: its own ids only, not what alembic
    resolves besides them ("heads", "0001@head", a prefix), nor what it fails on unchecked ("@")."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    cfg = Config()
    cfg.set_main_option("script_location", str(resources.files("kcache._migrations")))
    return revision is not None and revision in {r.revision for r in ScriptDirectory.from_config(cfg).walk_revisions()}


# What a migration id of a newer kcache could be: ours are `0102_yanks`. alembic's symbols are not.
_REVISION_ID = re.compile(r"[0-9A-Za-z_]{1,64}")


def _check_known(url: str, revision: str | None) -> None:
    """IndexDbError for a recorded revision that is none of this kcache's migrations, before alembic is
    given it: a newer kcache's (an older one's `db upgrade` after a rollback), or what no migration is
    named (alembic_version written by hand, or by whoever can write the index), on which alembic failed
    with a bare AssertionError or took a symbol ("heads") for this kcache's head."""
    if revision is None or _known(revision):
        return
    if _REVISION_ID.fullmatch(revision) and revision not in ("base", "head", "heads"):
        raise IndexDbError(url, f"schema is at {revision}, which this kcache (schema {HEAD}) does not know: "
                                "use a newer kcache")  # fmt: skip
    raise IndexDbError(url, f"schema is at {one_line(revision, 80)!r}, which names no migration (alembic_version "
                            "changed by hand?); restore the index from a backup, or `kcache reindex` into a new one")


def _create_fresh(engine: Engine) -> bool:
    """An empty SQLite database gets the schema at HEAD straight from the models, stamped HEAD:
    0.01 s instead of alembic's 0.12 s of replaying every migration, and the same schema (the
    migrations test checks that models and migrations agree). False when it holds any table, or
    another process created them first (then the caller looks again).

    All of it is one SQLite transaction: pysqlite commits each CREATE TABLE on its own, and a
    process killed part-way (an OOM-killed pod, the node's first restore) left tables without a
    revision, which every later command failed on ("table ... already exists"). What such a kill
    left (some of kcache's tables, every one empty, no revision) is dropped and created again."""
    from kcache.index.models import Base

    try:
        with engine.connect() as conn, _ddl_transaction(conn):
            found = inspect(conn).get_table_names()
            if found and not _left_by_a_killed_create(conn, found, set(Base.metadata.tables)):
                return False
            for name in found:
                log.warning("index %s: table %s without a schema revision, empty: created again", engine.url, name)
                conn.exec_driver_sql(f'DROP TABLE "{name}"')
            Base.metadata.create_all(conn)
            conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
                              "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"))  # fmt: skip
            conn.execute(text("INSERT INTO alembic_version (version_num) VALUES (:head)"), {"head": HEAD})
        return True
    except SQLAlchemyError:
        if current_revision(engine) != HEAD:
            raise
        return True


def _left_by_a_killed_create(conn, found: list[str], ours: set[str]) -> bool:
    """Whether the tables `found` (no alembic_version among them) are what a creation killed before
    it committed left: only kcache's own, and empty (nothing could write a row without a revision)."""
    if not set(found) <= ours:
        return False
    return not any(conn.exec_driver_sql(f'SELECT 1 FROM "{name}" LIMIT 1').first() for name in found)


@contextmanager
def _ddl_transaction(conn) -> Iterator[None]:
    """A SQLite transaction that DDL is part of, begun at once with the write lock (BEGIN IMMEDIATE:
    what it looks at cannot change before it commits); rolled back on any failure."""
    dbapi = conn.connection.driver_connection
    isolation = dbapi.isolation_level
    dbapi.isolation_level = None  # pysqlite then neither begins nor commits behind our back
    try:
        conn.exec_driver_sql("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            if dbapi.in_transaction:  # SQLite ends some failed ones itself (SQLITE_FULL)
                conn.exec_driver_sql("ROLLBACK")
            raise
        conn.exec_driver_sql("COMMIT")
    finally:
        conn.rollback()  # SQLAlchemy's own (autobegun) transaction: nothing is left in it
        dbapi.isolation_level = isolation


def describe_error(exc: Exception) -> str:
    msg = str(getattr(exc, "orig", None) or exc)
    return msg.strip().splitlines()[0] if msg.strip() else type(exc).__name__


def upgrade_url(url: str, target: str = "head") -> tuple[str | None, str]:
    """`kcache db upgrade`: upgrade the index at `url`, with failures as IndexDbError."""
    from alembic.util import CommandError

    engine = make_engine(url)
    try:
        _check_known(url, current_revision(engine))
        return upgrade(engine, target)
    except OperationalError as exc:
        raise IndexDbError(url, f"cannot connect: {describe_error(exc)}") from None
    except CommandError as exc:
        revision = _revision_or_none(engine)
        if revision is not None and not _known(revision):  # an older kcache's `db upgrade` after a rollback
            raise IndexDbError(url, f"schema is at {revision}, which this kcache (schema {HEAD}) does "
                                    "not know: use a newer kcache") from None  # fmt: skip
        raise IndexDbError(url, describe_error(exc)) from None
    except SQLAlchemyError as exc:
        raise IndexDbError(url, describe_error(exc)) from None
    finally:
        engine.dispose()
