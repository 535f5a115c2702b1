"""The fleet's queries can use the indexes made for them (PostgreSQL), and publish leaves live rows alone.

Speed itself is scripts/bench_index.py's business. Here each Index call runs once on a small filled
table, its real statements are captured, and PostgreSQL's plan for them, with sequential scans priced
out (on a few hundred rows the planner would rightly prefer one), must name the index meant for it.
"""

from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import insert, text

from kcache.index import BlobLocation, lifecycle
from kcache.index.models import BundleRow, EventRow
from kcache.index.plans import captured, explain
from kcache.index.stats import event_stats

NOW = datetime.now(timezone.utc)
KEY, TOOLCHAIN = "f" * 64, "e" * 64  # hex like real keys: prefix searches take hex digits only
OLD_KEY, OLD_TOOLCHAIN = "d" * 63 + "1", "d" * 63 + "2"  # a retired model's


def key(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture
def filled(pg_index):
    """2000 bundles; KEY and TOOLCHAIN hold only the 3 oldest, where walking all bundles newest first is slow."""
    rare = lambda i: i >= 1997  # noqa: E731
    bundles = [
        dict(id=f"{i:06x}" + "0" * 58, bundle_key=KEY if rare(i) else key(i % 300),
             toolchain_key=TOOLCHAIN if rare(i) else key(i % 5), workload_key="w", model=f"model-{i % 20}",
             facts="{}", layers="inductor", files=1, bytes=1, created_at=NOW - timedelta(minutes=i),
             created_by="test", status="active" if i % 7 else "yanked", compile_seconds=60.0)
        for i in range(2000)
    ]  # fmt: skip
    events = [
        dict(kind="restore" if i % 10 else "publish", status=("hit", "miss", "error")[i % 3], bundle_key=key(i % 40),
             bundle_id=bundles[i % 2000]["id"], files=1, bytes=10, seconds=float(i % 17), reason=None,
             created_at=NOW - timedelta(hours=i % 2000))
        for i in range(4000)
    ]  # fmt: skip
    with pg_index.engine.begin() as conn:
        conn.execute(insert(BundleRow.__table__), bundles)
        conn.execute(insert(EventRow.__table__), events)
        conn.execute(text("ANALYZE bundles"))
        conn.execute(text("ANALYZE events"))
    return pg_index


def plans_of(index, call) -> list[str]:
    with captured(index.engine) as seen:
        call(index)
    assert seen, "the call ran no SQL"
    return [explain(index.engine, s, settings=["enable_seqscan = off"]) for s in seen]


WEEK_AGO = NOW - timedelta(days=7)
QUERIES = {
    "newest bundle": (lambda ix: ix.newest_bundle(KEY), "ix_bundles_key_newest"),
    "toolchain fallback": (lambda ix: ix.newest_for_toolchain(TOOLCHAIN), "ix_bundles_toolchain_newest"),
    "ls": (lambda ix: ix.list_bundles(limit=50), "ix_bundles_created"),
    "ls --model": (lambda ix: ix.list_bundles(model="model-3", limit=50), "ix_bundles_model_created"),
    "ls --key PREFIX": (lambda ix: ix.list_bundles(bundle_key="ffffff", limit=50), "ix_bundles_key_newest"),
    "show PREFIX": (lambda ix: ix.get_bundle("00000a"), "ix_bundles_id_prefix"),
    "stats --since": (lambda ix: event_stats(ix, since=WEEK_AGO), "ix_events_created"),
}


@pytest.mark.parametrize("name", sorted(QUERIES))
def test_query_uses_its_index(filled, name):
    call, index_name = QUERIES[name]
    first = plans_of(filled, call)[0]
    assert index_name in first, first


def test_stats_since_never_scans_events(filled):
    for plan in plans_of(filled, lambda ix: event_stats(ix, since=WEEK_AGO)):
        assert "Seq Scan on events" not in plan, plan
    # Totals range over created_at alone: only the new index serves them without reading it whole.
    assert "ix_events_created" in plans_of(filled, lambda ix: event_stats(ix, since=WEEK_AGO))[0]


def _bundle_rows(prefix: str, n: int, *, key_of, toolchain_of, age: timedelta) -> list[dict]:
    """n bundles, oldest first (the order a fleet appends them in), the newest `age` old."""
    return [
        dict(id=f"{prefix}{i:06x}".ljust(64, "0"), bundle_key=key_of(i), toolchain_key=toolchain_of(i),
             workload_key="w", model="m", facts="{}", layers="inductor", files=1, bytes=1,
             created_at=NOW - age - timedelta(seconds=n - i), created_by="test", status="active", compile_seconds=None)
        for i in range(n)
    ]  # fmt: skip


@pytest.fixture
def retired(pg_index):
    """20k current bundles, and a retired model's 6k older ones on one bundle key and one toolchain.

    Big enough for the planner to cost it like a fleet's index (on a few hundred rows any plan is cheap).
    """
    current = _bundle_rows("c", 20000, key_of=lambda i: key(i % 2000), toolchain_of=lambda i: key(i % 5),
                           age=timedelta(0))  # fmt: skip
    old = _bundle_rows("a", 6000, key_of=lambda i: OLD_KEY, toolchain_of=lambda i: OLD_TOOLCHAIN,
                       age=timedelta(days=60))  # fmt: skip
    with pg_index.engine.begin() as conn:
        conn.execute(insert(BundleRow.__table__), old + current)
    # What autovacuum does to an insert-mostly table soon enough: statistics and the visibility map.
    with pg_index.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("VACUUM ANALYZE bundles"))
    return pg_index


@pytest.mark.parametrize(
    "call, index_name",
    [
        (lambda ix: ix.newest_bundle(OLD_KEY), "ix_bundles_key_newest"),
        (lambda ix: ix.newest_for_toolchain(OLD_TOOLCHAIN), "ix_bundles_toolchain_newest"),
    ],
    ids=["newest bundle", "toolchain fallback"],
)
def test_a_crowded_old_key_is_found_without_walking_newer_bundles(retired, call, index_name):
    """Left to itself, the planner must go straight to the key's newest row: no sort, no rows skipped.

    Asked for the whole row in one ORDER BY ... LIMIT 1, it walked all bundles newest first instead (a
    quarter of them match, so it expected to stop at once) and passed the 20k newer ones.
    """
    with captured(retired.engine) as seen:
        call(retired)
    plan = explain(retired.engine, seen[0], analyze=True)
    assert f"using {index_name} on bundles" in plan, plan
    assert "Sort" not in plan and "Rows Removed by Filter" not in plan, plan


def _row_versions(index, table: str) -> dict[str, str]:
    """PostgreSQL's xmin per row: it changes whenever a row is rewritten, even to the same values."""
    with index.engine.connect() as conn:
        return dict(conn.execute(text(f"SELECT id, xmin::text FROM {table}")).all())


def test_publish_leaves_live_pack_rows_unwritten(pg_index):
    packs = [key(p) for p in range(5)]
    for p in packs:
        pg_index.add_pack(p, 10, [BlobLocation(key(100 + packs.index(p)), p, 0, 1, 1)])
    lifecycle.condemn(pg_index, packs[:1], NOW)
    before = _row_versions(pg_index, "packs")
    assert lifecycle.revive(pg_index, packs) == set()
    pg_index.add_pack(packs[1], 10, [BlobLocation(key(101), packs[1], 0, 1, 1)])  # a pack stored twice
    after = _row_versions(pg_index, "packs")
    assert [p for p in packs if after[p] != before[p]] == packs[:1]  # only the condemned one was written
    assert all(info.condemned_at is None for info in lifecycle.packs(pg_index))
