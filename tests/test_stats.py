"""Stats over recorded events, on SQLite and PostgreSQL, through the library and the CLI."""

import json
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from sqlalchemy import update
from trees import write_tree

from kcache import durations, fingerprint, sources, stats
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.errors import ConfigError
from kcache.index import Event
from kcache.index.models import EventRow
from kcache.publish import publish


@pytest.mark.parametrize(
    "text, seconds",
    [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("2w", 1209600), ("1d12h", 129600), ("1.5h", 5400)],
)
def test_parse_duration(text, seconds):
    assert durations.parse(text, "--since") == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "7", "d", "7 days", "-1d", "1d 2h", "7y"])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError, match="duration"):
        durations.parse(text, "--since")


@pytest.fixture
def history(tmp_path, store, index, fp):
    """Two published bundles (one with a compile-time estimate) and a week and a half of restores."""
    write_tree(tmp_path / "a", {"inductor/fxgraph/g": b"graph a"})
    write_tree(tmp_path / "b", {"inductor/fxgraph/g": b"graph b"})
    a = publish(store, index, fp, sources.select(), root=tmp_path / "a", env={}, compile_seconds=30.0)
    other = fingerprint.compute({**fp.facts, "model.id": "other-model"})
    b = publish(store, index, other, sources.select(), root=tmp_path / "b", env={})
    assert index.get_bundle(a.bundle_id).compile_seconds == 30.0
    assert index.get_bundle(b.bundle_id).compile_seconds is None
    for event in (
        Event("restore", "hit", a.bundle_key, a.bundle_id, 1, 100, 2.0),  # saves 28 s
        Event("restore", "hit", a.bundle_key, a.bundle_id, 1, 100, 40.0),  # slower than compiling: saves 0
        Event("restore", "hit", b.bundle_key, b.bundle_id, 1, 50, 1.0),  # no estimate
        Event("restore", "miss", a.bundle_key, None, 0, 0, 0.01),
        Event("restore", "error", a.bundle_key, None, 0, 0, 0.5, "store unreachable"),
        Event("restore", "hit", a.bundle_key, a.bundle_id, 1, 100, 3.0, "old"),  # saves 27 s, 10 days ago
    ):
        index.record_event(event)
    with index.engine.begin() as conn:
        old = datetime.now(timezone.utc) - timedelta(days=10)
        conn.execute(update(EventRow).where(EventRow.reason == "old").values(created_at=old))
    return a, b


def test_all_events(index, history):
    a, b = history
    s = stats.summarize(index)
    assert (s.restores, s.hits, s.misses, s.errors) == (6, 4, 1, 1)
    assert s.hit_rate == pytest.approx(4 / 6)
    assert s.bytes_restored == 350
    assert s.median_restore_seconds == pytest.approx(2.5)  # of 1, 2, 3, 40
    assert s.p95_restore_seconds == pytest.approx(40.0)
    assert (s.publishes, s.published) == (2, 2)
    assert s.bytes_uploaded > 0
    assert s.seconds_saved == pytest.approx(28.0 + 0.0 + 27.0)
    assert (s.hits_with_estimate, s.hits_without_estimate) == (3, 1)


def test_since_leaves_out_older_events(index, history):
    s = stats.summarize(index, window=timedelta(days=7))
    assert (s.restores, s.hits) == (5, 3)
    assert s.median_restore_seconds == pytest.approx(2.0)  # of 1, 2, 40
    assert s.seconds_saved == pytest.approx(28.0)
    assert (s.hits_with_estimate, s.hits_without_estimate) == (2, 1)
    assert s.publishes == 2
    assert s.since is not None and s.since < datetime.now(timezone.utc) - timedelta(days=6)


def test_model_counts_only_that_models_bundle_keys(index, history):
    s = stats.summarize(index, model="test-model")
    assert (s.restores, s.hits, s.misses, s.errors, s.publishes) == (5, 3, 1, 1, 1)
    assert s.hits_without_estimate == 0


def test_no_events_is_zeros_not_errors(index):
    s = stats.summarize(index, window=timedelta(hours=1))
    assert (s.restores, s.hits, s.publishes, s.seconds_saved) == (0, 0, 0, 0.0)
    assert s.hit_rate is None and s.median_restore_seconds is None and s.p95_restore_seconds is None


def run(*args, code=0):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result


def test_cli_stats_json_and_text(index, history):
    doc = json.loads(run("stats", "--index", index.url, "--since", "7d", "--json").output)
    assert (doc["restores"], doc["hits"], doc["misses"], doc["errors"]) == (5, 3, 1, 1)
    assert doc["seconds_saved"] == pytest.approx(28.0) and doc["hits_without_estimate"] == 1
    assert doc["hit_rate"] == pytest.approx(0.6) and doc["since"]
    text = run("stats", "--index", index.url).output
    assert "hit rate 66.7%" in text and "compile saved  55.00 s over 3 hits; 1 hits had no estimate" in text


def test_cli_stats_rejects_a_bad_duration(tmp_path):
    result = run("stats", "--index", f"sqlite:///{tmp_path / 'i.db'}", "--since", "a week", code=2)
    assert "--since 'a week'" in result.stderr and "Traceback" not in result.output


def test_cli_publish_records_compile_seconds(tmp_path):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    out = json.loads(run("publish", "--from", str(tmp_path / "src"), "--model", "m", "--compile-seconds", "12.5",
                         "--json").output)  # fmt: skip
    shown = json.loads(run("show", out["bundle_id"], "--json").output)
    assert shown["compile_seconds"] == 12.5


def test_an_index_at_0001_upgrades_and_old_bundles_have_no_estimate(tmp_path, fp):
    from kcache.index import Index
    from kcache.index.db import HEAD, current_revision, make_engine, upgrade

    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = make_engine(url)
    upgrade(engine, "0001")
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "INSERT INTO bundles (id, bundle_key, toolchain_key, workload_key, model, facts, layers, files, bytes,"
            " created_at, created_by, status) VALUES ('b1b1b1', 'k', 't', 'w', 'm', '{}', 'inductor', 1, 2,"
            " '2025-01-01 00:00:00.000000', 'host', 'active')"
        )
    engine.dispose()
    index = Index.open(url)  # SQLite upgrades itself on first use
    try:
        assert current_revision(index.engine) == HEAD
        assert index.get_bundle("b1b1b1").compile_seconds is None
    finally:
        index.close()


@pytest.mark.parametrize("column, value", [("seconds", "'abc'"), ("seconds", "x'00'"), ("bytes", "'9e999'")])
def test_a_wrong_typed_event_value_is_an_index_error_not_a_bug(sqlite_index, column, value):
    """SQLite keeps text in a REAL column: stats summed a seconds of 'abc' and crashed as a bug (exit 70)."""
    from kcache.cli.errors import ExitCode

    for seconds in (1.0, 2.0, 3.0):
        sqlite_index.record_event(Event("restore", "hit", "k" * 32, "b" * 64, 1, 100, seconds))
    with sqlite_index.engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE events SET {column} = {value}")
    result = run("stats", "--index", sqlite_index.url, code=ExitCode.INDEX)
    assert "Traceback" not in result.output and column in result.stderr


def test_a_model_the_index_has_no_bundle_of_is_named_not_counted_as_zeros(index, history):
    """`stats --model` with a misspelt model printed a report of zeros, as for a model nobody restored, and
    `ls --model` said "no bundles yet": a typo read as a fleet that never restores. Both say it now."""
    result = run("stats", "--index", index.url, "--model", "test-modle", code=ExitCode.NOT_FOUND)
    assert "test-modle" in result.output and "kcache ls" in result.output
    assert json.loads(run("stats", "--index", index.url, "--model", "test-model", "--json").output)["restores"] == 5
    listed = run("ls", "--index", index.url, "--model", "test-modle")
    assert "no bundles of model 'test-modle'" in listed.output and "yet" not in listed.output
    assert json.loads(run("ls", "--index", index.url, "--model", "test-modle", "--json").output) == []
