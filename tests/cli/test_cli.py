"""The real CLI through click's runner, against real stores and indexes."""

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from command_tree import commands
from trees import write_tree

from kcache.cli import main
from kcache.cli.errors import EXIT_MEANINGS, ExitCode


def run(*args, ok=True):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output
    return result




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
    assert [b["bundle_id"] for b in listed] == [published["bundle_id"]]
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
    assert set(doc) == {"bundle_key", "toolchain_key", "workload_key", "facts", "mismatches"}
    assert doc["facts"]["gpu.sm"] == "sm_90" and doc["facts"]["extra.tp"] == "2"


def test_db_upgrade_is_idempotent(tmp_path):
    url = f"sqlite:///{tmp_path / 'i.db'}"
    assert "upgraded from empty" in run("db", "upgrade", "--index", url).output
    assert "up to date" in run("db", "upgrade", "--index", url).output


def test_db_upgrade_of_an_index_a_newer_kcache_migrated_says_so(tmp_path):
    """An operator rolling kcache back runs the old one's `db upgrade`: it must say the schema is a
    newer kcache's, not alembic's "Can't locate revision" (which reads like a broken index)."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'i.db'}"
    run("db", "upgrade", "--index", url)
    with sqlite3.connect(tmp_path / "i.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999_from_the_future'")
    result = run("db", "upgrade", "--index", url, "--json", ok=False)
    assert result.exit_code == ExitCode.INDEX
    doc = json.loads(result.output.splitlines()[0])
    assert "9999_from_the_future" in doc["error"] and "use a newer kcache" in doc["error"], doc


@pytest.mark.parametrize("revision", ["@", "heads", "0001@head"])
def test_an_index_at_a_revision_no_migration_names_is_an_index_error(tmp_path, revision):
    """alembic_version holding what is no migration's id (written by hand, or by an index writer): alembic
    itself failed on it with a bare AssertionError, a bug exit (70) from `db upgrade` and from every command
    on that SQLite index; "heads" read as up to date for `db upgrade` while every other command refused it."""
    import sqlite3

    url = f"sqlite:///{tmp_path / 'i.db'}"
    run("db", "upgrade", "--index", url)
    with sqlite3.connect(tmp_path / "i.db") as conn:
        conn.execute("UPDATE alembic_version SET version_num = ?", (revision,))
    for argv in (["db", "upgrade"], ["ls", "--store", str(tmp_path / "store")]):
        result = run(*argv, "--index", url, "--json", ok=False)
        assert result.exit_code == ExitCode.INDEX, result.output
        doc = json.loads(result.output.splitlines()[0])
        assert "names no migration" in doc["error"], doc


# ---- --json, env vars in --help, README tables ---------------------------------------------------

README = Path(__file__).resolve().parents[2] / "README.md"
PACKAGE = Path(__file__).resolve().parents[2] / "kcache"
NO_JSON: dict[tuple[str, ...], str] = {}  # command -> why --json makes no sense there (none today)


@pytest.mark.parametrize("path", [p for p, _ in commands(main)], ids=" ".join)
def test_every_command_has_json(path):
    has = "--json" in run(*path, "--help").output
    assert has or path in NO_JSON, f"kcache {' '.join(path)} has no --json"


@pytest.mark.parametrize(
    "path, command", list(commands(main)), ids=lambda v: " ".join(v) if isinstance(v, tuple) else ""
)
def test_env_vars_show_one_way_in_help(path, command):
    for param in command.params:
        if isinstance(param, click.Option):
            assert "(env " not in (param.help or ""), f"{param.opts} of kcache {' '.join(path)} spells its env var"
            if param.envvar:
                assert param.show_envvar, f"{param.opts} of kcache {' '.join(path)} hides its env var"
    text = run(*path, "--help").output
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar:
            first = param.envvar if isinstance(param.envvar, str) else param.envvar[0]
            assert first in text


def readme_section(after: str) -> str:
    text = README.read_text()
    start = text.index(after)
    end = text.index("\n\n", start)
    return text[start:end]


def test_readme_settings_table_lists_every_kcache_variable():
    in_code = {m for p in PACKAGE.rglob("*.py") for m in re.findall(r"KCACHE_[A-Z0-9_]+", p.read_text())}
    in_readme = set(re.findall(r"KCACHE_[A-Z0-9_]+", readme_section("| setting | flag | environment | default |")))
    assert in_code - in_readme == set(), "add these to README.md's settings table"
    assert in_readme - in_code == set(), "README.md's settings table names variables the code does not read"
    assert len(in_code) >= 15


def test_readme_and_help_list_the_exit_codes():
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", readme_section("| code | meaning |"), re.MULTILINE)
    assert {int(code): meaning.replace("`", "") for code, meaning in rows} == {
        int(code): meaning for code, meaning in EXIT_MEANINGS.items()
    }
    help_text = " ".join(run("--help").output.split())
    for code, meaning in EXIT_MEANINGS.items():
        assert f"{int(code)} {meaning}" in help_text
    assert set(EXIT_MEANINGS) == set(ExitCode)


def test_index_none_only_where_it_works(tmp_path):
    assert "'none'" in run("restore", "--help").output and "'none'" not in run("ls", "--help").output
    refused = run("ls", "--index", "none", ok=False)
    assert refused.exit_code == ExitCode.USAGE and "only `kcache restore` works from refs/" in refused.stderr
    assert run("restore", "--into", str(tmp_path / "r"), "--index", "none", "--json").exit_code == 0


def test_strict_miss_has_its_own_code(tmp_path):
    miss = run("restore", "--into", str(tmp_path / "r"), "--strict", "--model", "unpublished", ok=False)
    assert miss.exit_code == ExitCode.MISS != ExitCode.NOT_FOUND


def test_config_says_where_each_value_came_from(tmp_path, monkeypatch, isolated_home):
    monkeypatch.setenv("KCACHE_MODEL", "my-llm")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://general:9000")
    out = run("config", "--store", f"file://{tmp_path}/s", "--root", str(tmp_path / "r")).output
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert rows["store"] == [f"file://{tmp_path}/s", "flag", "--store"]
    assert rows["model"] == ["my-llm", "env", "KCACHE_MODEL"]
    assert rows["endpoint"] == ["http://general:9000", "env", "AWS_ENDPOINT_URL"]
    assert rows["home"] == [str(isolated_home), "env", "KCACHE_HOME"]
    assert rows["index"] == [f"sqlite:///{isolated_home}/index.db", "default"]
    assert rows["root"] == [str(tmp_path / "r"), "flag", "--root"]
    doc = json.loads(run("config", "--json").output)
    assert {"home", "store", "index", "endpoint", "model", "root", "max-manifest"} <= set(doc)
    assert doc["endpoint"] == {"value": "http://general:9000", "origin": "env AWS_ENDPOINT_URL"}


def test_config_shows_every_setting_of_the_readme_table(tmp_path, monkeypatch):
    """Each KCACHE_ variable README's settings table names is shown with where it came from, and a
    password in one is masked."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = [line for line in readme.splitlines() if line.startswith("| ") and "`KCACHE_" in line]
    named = {name for line in table for name in re.findall(r"`(KCACHE_[A-Z0-9_]+)", line)} - {"KCACHE_EXTRA_"}
    assert len(named) >= 20
    for i, name in enumerate(sorted(named)):
        monkeypatch.setenv(name, f"redis://user:hunter{i}@host:1" if name == "KCACHE_PROXY_REDIS" else str(i + 2))
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path))
    doc = json.loads(run("config", "--json").output)
    origins = {row["origin"] for row in doc.values()}
    assert {f"env {name}" for name in named} <= origins
    assert not [row for row in doc.values() if "hunter" in str(row["value"])]


def test_config_shows_the_manifest_cap_publish_and_restore_use(monkeypatch):
    """A publish refused for its manifest's size points at `kcache config`: the cap is shown there."""
    cap = lambda: json.loads(run("config", "--json").output)["max-manifest"]  # noqa: E731
    assert cap() == {"value": 32 * 1024 * 1024, "origin": "default"}
    monkeypatch.setenv("KCACHE_MAX_MANIFEST_BYTES", "1000")
    assert cap() == {"value": 1000, "origin": "env KCACHE_MAX_MANIFEST_BYTES"}
    monkeypatch.setenv("KCACHE_MAX_MANIFEST_BYTES", "lots")
    bad = run("config", ok=False)
    assert bad.exit_code == 2 and "KCACHE_MAX_MANIFEST_BYTES" in bad.stderr


def test_s3_specific_endpoint_wins_over_the_general_one(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://general:9000")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3:9000")
    doc = json.loads(run("config", "--json").output)
    assert doc["endpoint"] == {"value": "http://s3:9000", "origin": "env AWS_ENDPOINT_URL_S3"}
    flag = json.loads(run("config", "--s3-endpoint-url", "http://flag:1", "--json").output)
    assert flag["endpoint"] == {"value": "http://flag:1", "origin": "flag --s3-endpoint-url"}


def test_keygen_and_serve_json(tmp_path):
    doc = json.loads(run("keygen", "k1", "--dir", str(tmp_path), "--json").output)
    assert doc == {"status": "ok", "name": "k1", "private_key": str(tmp_path / "k1.key"),
                   "public_key": str(tmp_path / "k1.pub")}  # fmt: skip
    assert (tmp_path / "k1.key").stat().st_mode & 0o777 == 0o600


def test_serve_json_names_the_port(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "kcache", "serve", "--root", str(tmp_path), "--port", "0", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        doc = json.loads(proc.stdout.readline())
        assert doc["status"] == "serving" and doc["port"] > 0 and doc["url"] == f"http://127.0.0.1:{doc['port']}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_trusted_keys_from_the_environment_split_at_colons(tmp_path, monkeypatch):
    run("keygen", "old", "--dir", str(tmp_path / "k"))
    run("keygen", "new", "--dir", str(tmp_path / "k"))
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    run("publish", "--from", str(tmp_path / "src"), "--model", "m", "--signing-key", str(tmp_path / "k/new.key"))
    monkeypatch.setenv("KCACHE_TRUSTED_KEYS", f"{tmp_path}/k/old.pub:{tmp_path}/k/new.pub")
    doc = json.loads(
        run("restore", "--into", str(tmp_path / "r"), "--model", "m", "--require-signature", "--json").output
    )
    assert doc["status"] == "hit" and doc["signed_by"] == "new"


def test_empty_elements_of_trusted_keys_are_ignored(tmp_path, monkeypatch):
    # A trailing ':' or '::' (a list joined from variables, one of them empty) names no key: restore
    # must still restore warm with the keys that are named, and verify must not refuse the value.
    run("keygen", "old", "--dir", str(tmp_path / "k"))
    run("keygen", "new", "--dir", str(tmp_path / "k"))
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    run("publish", "--from", str(tmp_path / "src"), "--model", "m", "--signing-key", str(tmp_path / "k/new.key"))
    monkeypatch.setenv("KCACHE_TRUSTED_KEYS", f":{tmp_path}/k/old.pub:: :{tmp_path}/k/new.pub:")
    doc = json.loads(
        run("restore", "--into", str(tmp_path / "r"), "--model", "m", "--require-signature", "--json").stdout
    )
    assert doc["status"] == "hit" and doc["signed_by"] == "new"
    assert json.loads(run("verify", "--json").stdout)["status"] == "ok"


@pytest.mark.parametrize("value", [":", "::", " : "])
def test_trusted_keys_that_name_no_key_do_not_turn_signature_checks_off(tmp_path, monkeypatch, value):
    # Every element empty (the variables it was joined from all expanded to nothing): reading it as
    # "no trusted keys" would restore an unsigned bundle, so it stays an error; restore starts cold.
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    run("publish", "--from", str(tmp_path / "src"), "--model", "m")
    monkeypatch.setenv("KCACHE_TRUSTED_KEYS", value)
    doc = json.loads(run("restore", "--into", str(tmp_path / "r"), "--model", "m", "--json").stdout)
    assert doc["status"] == "error" and "KCACHE_TRUSTED_KEYS" in doc["error"] and "no key" in doc["error"]
    refused = run("verify", "--json", ok=False)
    assert refused.exit_code == ExitCode.USAGE and "no key" in json.loads(refused.stdout)["error"]


def test_trusted_keys_joined_with_commas_are_refused_with_the_separator_named(tmp_path, monkeypatch):
    # A comma-separated list (what many tools take) names one file that does not exist; the error says
    # how to write the list instead of only that no such file exists.
    run("keygen", "old", "--dir", str(tmp_path / "k"))
    run("keygen", "new", "--dir", str(tmp_path / "k"))
    monkeypatch.setenv("KCACHE_TRUSTED_KEYS", f"{tmp_path}/k/old.pub,{tmp_path}/k/new.pub")
    refused = run("verify", "--json", ok=False)
    assert refused.exit_code == ExitCode.USAGE
    assert "separated by ':'" in json.loads(refused.stdout)["error"]
    doc = json.loads(run("restore", "--into", str(tmp_path / "r"), "--model", "m", "--json").stdout)
    assert doc["status"] == "error" and "separated by ':'" in doc["error"]

# ---- a store that does not exist: only publish creates one ---------------------------------------


@pytest.mark.parametrize("command", [["verify"], ["reindex"], ["verify", "--read-data"], ["gc", "--dry-run"]])
def test_readers_refuse_a_named_store_that_does_not_exist(tmp_path, command):
    args = [*command, "--store", f"file://{tmp_path / 'nostore'}", "--index", f"sqlite:///{tmp_path / 'v.db'}"]
    result = run(*args, "--json", ok=False)
    assert result.exit_code == ExitCode.STORE, result.output
    assert "does not exist" in json.loads(result.stdout)["error"]
    assert not (tmp_path / "nostore").exists()


def test_restore_before_the_first_publish_is_a_miss_and_creates_no_store(tmp_path):
    # A pod's first restore may come before any publish made the store: that is a miss, not an error.
    args = ("restore", "--into", str(tmp_path / "r"), "--model", "m", "--store", f"file://{tmp_path / 'nostore'}")
    assert json.loads(run(*args, "--json").stdout)["status"] == "miss"
    assert run(*args, "--strict", ok=False).exit_code == ExitCode.MISS and not (tmp_path / "nostore").exists()


def test_publish_creates_the_store_it_is_given(tmp_path):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    store = tmp_path / "new" / "store"
    run("publish", "--from", str(tmp_path / "src"), "--model", "m", "--store", f"file://{store}")
    assert (store / "kcache-store.json").is_file()
    verified = run("verify", "--store", f"file://{store}", "--json")
    assert json.loads(verified.stdout)["bundles"] == 1


def test_the_default_store_reads_as_empty_before_the_first_publish(isolated_home):
    assert json.loads(run("verify", "--json").stdout)["bundles"] == 0
    assert not (isolated_home / "store").exists()


# ---- prefetch: bundle keys and the signature setting --------------------------------------------


@pytest.mark.parametrize("key", ["zz", "3f0c", "g" * 32, "a" * 33, "a" * 64])
def test_prefetch_refuses_a_bundle_key_that_is_no_key(tmp_path, key):
    result = run("prefetch", "--node-cache", str(tmp_path / "n"), "--bundle-key", key, "--once", "--json", ok=False)
    doc = json.loads(result.stdout)
    assert result.exit_code == doc["exit_code"] == ExitCode.USAGE
    assert doc["error"].startswith(f"--bundle-key {key!r}") and "32 hex digits" in doc["error"]


@pytest.mark.parametrize("value", ["y", "t", "enabled", "2"])
def test_prefetch_reads_require_signature_as_restore_does(tmp_path, monkeypatch, value):
    monkeypatch.setenv("KCACHE_REQUIRE_SIGNATURE", value)
    result = run("prefetch", "--node-cache", str(tmp_path / "n"), "--bundle-key", "a" * 32, "--once", ok=False)
    assert result.exit_code == ExitCode.USAGE and f"KCACHE_REQUIRE_SIGNATURE {value!r}" in result.stderr


@pytest.mark.parametrize("value, refused", [("1", True), ("on", True), ("0", False), ("off", False), ("", False)])
def test_prefetch_takes_the_values_restore_takes(tmp_path, monkeypatch, value, refused):
    monkeypatch.setenv("KCACHE_REQUIRE_SIGNATURE", value)
    result = run("prefetch", "--node-cache", str(tmp_path / "n"), "--bundle-key", "a" * 32, "--once", ok=False)
    assert (result.exit_code == ExitCode.USAGE and "needs at least one --trusted-key" in result.stderr) == refused


def test_require_signature_reads_the_same_in_restore_and_prefetch_help():
    def helps(name):
        return next(p.help for p in main.get_command(None, name).params if p.name == "require_signature")

    restore_help, prefetch_help = helps("restore"), helps("prefetch")
    assert "KCACHE_REQUIRE_SIGNATURE" in restore_help
    assert restore_help[restore_help.index("[env var"):] == prefetch_help[prefetch_help.index("[env var"):]


def test_publish_peer_wait_zero_uploads_at_once_past_another_publishs_lease(tmp_path):
    from kcache.index import Index

    where = ["--store", f"file://{tmp_path / 'store'}", "--index", f"sqlite:///{tmp_path / 'index.db'}"]
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    first = json.loads(run("publish", "--from", str(tmp_path / "src"), "--model", "m", *where, "--json").output)
    index = Index.open(f"sqlite:///{tmp_path / 'index.db'}")
    try:
        assert index.take_lease(first["bundle_key"], "a-replica-still-uploading", 3600) is None
        write_tree(tmp_path / "src", {"inductor/fxgraph/h": b"another graph"})
        args = ("publish", "--from", str(tmp_path / "src"), "--model", "m", *where, "--json")
        second = json.loads(run(*args, "--peer-wait", "0").output)
        assert second["new_blobs"] == 1 and second["bundle_id"] != first["bundle_id"]
        refused = run(*args, "--peer-wait", "soon", ok=False)
        assert refused.exit_code == 2 and "--peer-wait" in refused.output
    finally:
        index.close()


# ---- --json on a failing exit: the error object every command prints --------------------------------


def _store_that_lost_its_pack(tmp_path, home):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    run("publish", "--from", str(tmp_path / "src"), "--model", "m")
    for pack in (home / "store" / "packs").rglob("*"):
        if pack.is_file():
            pack.unlink()


def _assert_error_object(doc: dict, code: int) -> None:
    assert doc["exit_code"] == code and doc["status"] not in ("ok", None), doc
    assert doc["error"] and doc["hint"], doc


def test_reindex_json_that_exits_12_is_an_error_object(tmp_path, isolated_home):
    _store_that_lost_its_pack(tmp_path, isolated_home)
    result = run("reindex", "--index", f"sqlite:///{tmp_path / 'new.db'}", "--json", ok=False)
    assert result.exit_code == ExitCode.PROBLEMS, result.output
    doc = json.loads(result.stdout)
    _assert_error_object(doc, ExitCode.PROBLEMS)
    assert doc["status"] == "damaged" and doc["skipped"]


def test_reindex_json_that_succeeds_says_ok(tmp_path):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    run("publish", "--from", str(tmp_path / "src"), "--model", "m")
    doc = json.loads(run("reindex", "--index", f"sqlite:///{tmp_path / 'new.db'}", "--json").stdout)
    assert doc["status"] == "ok" and doc["bundles"] == 1 and "error" not in doc


def test_verify_json_that_exits_12_is_an_error_object(tmp_path, isolated_home):
    _store_that_lost_its_pack(tmp_path, isolated_home)
    result = run("verify", "--json", ok=False)
    assert result.exit_code == ExitCode.PROBLEMS, result.output
    _assert_error_object(json.loads(result.stdout), ExitCode.PROBLEMS)


def test_restore_strict_miss_json_carries_its_exit_code(tmp_path):
    result = run("restore", "--into", str(tmp_path / "r"), "--model", "m", "--strict", "--json", ok=False)
    assert result.exit_code == ExitCode.MISS
    doc = json.loads(result.stdout)
    assert doc["status"] == "miss" and doc["exit_code"] == ExitCode.MISS and doc["hint"], doc


def test_ready_json_that_exits_11_is_an_error_object(tmp_path):
    result = run("ready", "--root", str(tmp_path), "--json", ok=False)
    assert result.exit_code == ExitCode.NOT_READY
    doc = json.loads(result.stdout)
    _assert_error_object(doc, ExitCode.NOT_READY)
    assert doc["ready"] is False and doc["status"] == "not_ready"
