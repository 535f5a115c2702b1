"""No command prints a password: not in errors, not in JSON reasons, not on success, not in logs."""

import json
import logging
import socket

import pytest
from click.testing import CliRunner

from kcache.cli import RedactingFormatter, main

SECRET = "Zq9xSecretPw"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def dead_index():
    return f"postgresql+psycopg://kcache:{SECRET}@127.0.0.1:{closed_port()}/kcache?connect_timeout=2"


COMMANDS = [["ls"], ["stats"], ["gc", "--dry-run"], ["verify"], ["explain"], ["db", "upgrade"]]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("as_json", [[], ["--json"]], ids=["text", "json"])
def test_index_errors_hide_the_password(dead_index, command, as_json):
    result = run(*command, "--index", dead_index, *as_json)
    assert result.exit_code == 5, result.output
    assert SECRET not in result.output and "kcache:***@127.0.0.1" in result.stderr
    if as_json:
        assert "kcache:***@" in json.loads(result.stdout)["error"]


def test_restore_json_reason_hides_the_password(tmp_path, dead_index):
    result = run("restore", "--into", tmp_path / "r", "--index", dead_index, "--json")
    assert result.exit_code == 0 and SECRET not in result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "error" and "kcache:***@" in doc["reason"]


@pytest.mark.parametrize("as_json", [False, True])
def test_db_upgrade_success_hides_the_password(pg_database, as_json):
    url = pg_database.replace("://postgres@", f"://postgres:{SECRET}@")  # trust auth ignores the password
    assert SECRET in url
    result = run("db", "upgrade", "--index", url, *(["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    assert SECRET not in result.output and "postgres:***@" in result.output
    if as_json:
        assert json.loads(result.stdout)["status"] == "ok"


@pytest.mark.parametrize("store", [f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix", f"gopher://u:{SECRET}@host/x"])
def test_store_urls_with_credentials_are_hidden(tmp_path, store):
    result = run("publish", "--from", tmp_path, "--store", store, "--index", f"sqlite:///{tmp_path}/i.db", "--json")
    assert result.exit_code != 0 and SECRET not in result.output


def test_config_hides_every_secret(monkeypatch):
    monkeypatch.setenv("KCACHE_STORE", f"s3://AKIAEXAMPLE:{SECRET}@bucket/p")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"https://u:{SECRET}@minio:9000")
    result = run("config", "--index", f"postgresql://k@db/k?password={SECRET}", "--json")
    assert result.exit_code == 0 and SECRET not in result.output
    doc = json.loads(result.output)
    assert doc["index"] == {"value": "postgresql://k@db/k?password=***", "origin": "flag --index"}
    assert doc["store"]["origin"] == "env KCACHE_STORE" and doc["endpoint"]["origin"] == "env AWS_ENDPOINT_URL_S3"


def test_log_lines_are_redacted():
    url = f"postgresql://u:{SECRET}@h/db"
    record = logging.LogRecord("kcache.x", logging.INFO, __file__, 1, "opening %s", (url,), None)
    line = RedactingFormatter("%(message)s").format(record)
    assert line == "opening postgresql://u:***@h/db"


@pytest.mark.parametrize("as_json", [False, True])
def test_warmup_target_hides_the_password(as_json):
    url = f"http://user:{SECRET}@127.0.0.1:{closed_port()}"
    result = run("warmup", "--url", url, "--wait-timeout", "0", *(["--json"] if as_json else []))
    assert result.exit_code != 0 and SECRET not in result.output and "user:***@" in result.output
