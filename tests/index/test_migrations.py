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
