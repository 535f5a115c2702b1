"""Concurrent writers on PostgreSQL: rows are locked in one canonical order, and a transaction that
PostgreSQL aborts for a deadlock is run again.

A second connection ("the other publisher") holds row locks in a transaction of its own; the test
waits until the index's insert is blocked on one of them (pg_stat_activity says so), then lets the
other side take its next lock. No timing assumptions: every step waits for a condition.
"""

import threading
import time

import pytest
from sqlalchemy import create_engine, text

from kcache.index import BlobLocation

LOW, HIGH = "0" * 64, "f" * 64
OTHER_PACK, PACK = "a" * 64, "b" * 64


@pytest.fixture
def other(pg_index):
    """A raw connection to the same database, in an open transaction with a pack row of its own."""
    engine = create_engine(pg_index.url, isolation_level="READ COMMITTED")
    conn = engine.connect()
    conn.execute(text("INSERT INTO packs (id, size, created_at) VALUES (:p, 1, now())"), {"p": OTHER_PACK})
    conn.commit()
    yield conn
    conn.rollback()
    conn.close()
    engine.dispose()


def _insert_blob(conn, blob: str) -> None:
    conn.execute(
        text('INSERT INTO blobs (id, pack_id, "offset", length, size) VALUES (:b, :p, 0, 1, 1) ON CONFLICT DO NOTHING'),
        {"b": blob, "p": OTHER_PACK},
    )


def _wait_until_blocked(pg_index, thread, box, timeout: float = 60) -> None:
    """Until some backend of the index's database waits for a row lock while inserting blobs."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO blobs%'"
    )
    deadline = time.monotonic() + timeout
    with pg_index.engine.connect() as probe:
        # pg_stat_activity is a snapshot per transaction: each look is its own transaction.
        while probe.execute(query).scalar() == 0:
            probe.rollback()
            assert thread.is_alive(), f"the publisher ended without blocking: {box}"
            assert time.monotonic() < deadline, "the publisher never blocked on the other transaction's row"
            time.sleep(0.01)  # polling a condition, not waiting for time to pass


def _add_pack_in_thread(pg_index, blobs):
    box = {}

    def run():
        try:
            pg_index.add_pack(PACK, 10, [BlobLocation(b, PACK, i, 1, 1) for i, b in enumerate(blobs)])
            box["ok"] = True
        except Exception as exc:  # handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, box


def test_blob_rows_are_locked_in_blob_id_order_whatever_the_pack_order(pg_index, other):
    # The other publisher holds LOW. Our pack lists HIGH first (its paths sort that way).
    _insert_blob(other, LOW)
    thread, box = _add_pack_in_thread(pg_index, [HIGH, LOW])
    _wait_until_blocked(pg_index, thread, box)
    # In pack order we would hold HIGH now, and this insert would close a deadlock cycle.
    _insert_blob(other, HIGH)
    other.commit()
    thread.join(60)
    assert box == {"ok": True}
    assert set(pg_index.locate([LOW, HIGH])) == {LOW, HIGH}


def test_a_deadlock_victim_is_retried(pg_index, other):
    # The other side takes HIGH first, so even in canonical order the two lock in opposite orders.
    other.execute(text("SET deadlock_timeout = '60s'"))  # the index's backend detects, and is the victim
    _insert_blob(other, HIGH)
    thread, box = _add_pack_in_thread(pg_index, [LOW, HIGH])
    _wait_until_blocked(pg_index, thread, box)
    _insert_blob(other, LOW)  # waits for our LOW until the index's transaction is aborted
    other.commit()
    thread.join(60)
    assert box == {"ok": True}  # the aborted transaction ran again
    where = pg_index.locate([LOW, HIGH])
    assert {w.pack_id for w in where.values()} == {OTHER_PACK}  # first writer wins
    with pg_index.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM packs WHERE id = :p"), {"p": PACK}).scalar() == 1


def test_conflict_past_the_retries_has_its_own_hint():
    from kcache.cli.errors import describe
    from kcache.errors import IndexConflict

    message, hint, code = describe(IndexConflict("postgresql://db/k", "deadlock detected", 5))
    assert "5 attempts" in message and "again" in hint and "db upgrade" not in hint and code == 5


def test_a_kcache_session_wedged_inside_a_transaction_frees_its_key_for_the_next_publish(pg_index):
    """A kcache process that stops mid-transaction (SIGSTOPped, its network gone) while it holds a
    key's commit lock: the server ends that session, and a publish of the key commits. It had
    waited out the statement timeout (120 s) and failed, and every later one too while it held."""
    from sqlalchemy.exc import DBAPIError
    from sqlalchemy.orm import Session
    from test_repo import bundle

    from kcache.index import Index
    from kcache.index.db import make_engine

    wedged_engine = make_engine(pg_index.url)  # the options every kcache session connects with
    wedged = Session(wedged_engine)
    wedged.begin()
    Index(wedged_engine, pg_index.url).lock_key(wedged, "k1")  # then nothing: wedged
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("added", pg_index.add_bundle(bundle("b" * 64))),
                              daemon=True)  # fmt: skip
    try:
        worker.start()
        worker.join(100)  # generous, under the statement timeout the publish would otherwise fail on
        assert box.get("added") is True, "the publish waited on a wedged session's lock"
        with pytest.raises(DBAPIError, match="idle-in-transaction timeout"):  # the server ended it
            wedged.rollback()
    finally:
        wedged.close()
        wedged_engine.dispose()
