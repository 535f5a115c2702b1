"""Shared fixtures: real stores, real SQLite and PostgreSQL indexes, an isolated KCACHE_HOME."""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest
from fixed_facts import FACTS

from kcache import fingerprint
from kcache.index import Index
from kcache.store.local import LocalStore

PG_ADMIN_URL = os.environ.get("KCACHE_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    """No test reads or writes the user's ~/.cache/kcache or inherits their settings."""
    home = tmp_path / "kcache-home"
    monkeypatch.setenv("KCACHE_HOME", str(home))
    for var in ("KCACHE_STORE", "KCACHE_INDEX", "KCACHE_MODEL", "AWS_ENDPOINT_URL", "KCACHE_DEBUG"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 HTTP endpoint (moto's server) on loopback, one per test session."""
    from moto.server import ThreadedMotoServer

    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):  # fmt: skip
        os.environ[var] = value
    os.environ.pop("AWS_SESSION_TOKEN", None)
    os.environ.pop("AWS_PROFILE", None)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh bucket on the session's S3 endpoint; returns (store URL, endpoint)."""
    import boto3

    name = f"kcache-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return f"s3://{name}/cache", s3_endpoint


@pytest.fixture
def s3_store(s3_bucket):
    from kcache.store import open_store

    url, endpoint = s3_bucket
    return open_store(url, endpoint_url=endpoint)


@pytest.fixture
def store(tmp_path) -> LocalStore:
    return LocalStore(tmp_path / "store")


@pytest.fixture
def sqlite_index(tmp_path):
    index = Index.open(f"sqlite:///{tmp_path / 'index.db'}")
    yield index
    index.close()


@pytest.fixture(scope="session")
def pg_database():
    """A fresh PostgreSQL database for this test run, dropped afterwards; skips if none answers."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    from sqlalchemy.exc import OperationalError

    name = f"kcache_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = sqlalchemy.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except OperationalError as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN_URL}: {exc.orig}")
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    yield url
    with admin.connect() as conn:
        conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    admin.dispose()


@pytest.fixture
def pg_index(pg_database):
    """An index on the run's PostgreSQL database, emptied before each test."""
    from kcache.index.db import make_engine, upgrade
    from kcache.index.models import Base

    engine = make_engine(pg_database)
    upgrade(engine)
    with engine.begin() as conn:
        for table in reversed(Base.metadata.sorted_tables):
            conn.execute(table.delete())
    index = Index(engine, pg_database)
    yield index
    index.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def index(request):
    """Each index test runs on SQLite and on PostgreSQL."""
    return request.getfixturevalue("sqlite_index" if request.param == "sqlite" else "pg_index")




@pytest.fixture
def tmpfs():
    """Mounts a small tmpfs at a directory (made if missing), unmounted after the test; skips where this
    process may not mount one. A real mount point: renaming it fails with EBUSY, as in a pod whose
    volume is mounted at that directory."""
    mounted: list[str] = []

    def mount(at, size: str = "2m"):
        at.mkdir(parents=True, exist_ok=True)
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(at)], capture_output=True)
        except FileNotFoundError:
            pytest.skip("no mount(8) here")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
        mounted.append(str(at))
        return at

    yield mount
    for at in reversed(mounted):
        subprocess.run(["umount", at], check=True)


@pytest.fixture
def fp() -> fingerprint.Fingerprint:
    return fingerprint.compute(FACTS)
