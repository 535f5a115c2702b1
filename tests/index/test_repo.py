"""Index queries, on SQLite and PostgreSQL alike."""

import sys
from dataclasses import fields
from datetime import datetime, timedelta, timezone

import pytest

from kcache.errors import NotFound
from kcache.index import BlobLocation, Bundle, Event


def blob(i: int) -> str:
    return f"{i:064x}"


def bundle(id_: str, key: str = "k1", *, at: datetime | None = None, model: str = "m") -> Bundle:
    return Bundle(id_, key, "tk", "wk", model, {"os": "linux"}, ("inductor",), 1, 10,
                  at or datetime.now(timezone.utc), "host", "active")  # fmt: skip


def test_find_missing_and_locate(index):
    ids = [blob(i) for i in range(1200)]  # more than one IN (...) chunk
    assert index.find_missing(ids) == set(ids)
    index.add_pack("p" * 64, 100, [BlobLocation(b, "p" * 64, i, 1, 2) for i, b in enumerate(ids[:700])])
    assert index.find_missing(ids) == set(ids[700:])
    where = index.locate([ids[5], ids[900]])
    assert where == {ids[5]: BlobLocation(ids[5], "p" * 64, 5, 1, 2)}


def test_first_pack_to_record_a_blob_wins(index):
    index.add_pack("a" * 64, 10, [BlobLocation(blob(1), "a" * 64, 0, 5, 5)])
    index.add_pack("b" * 64, 10, [BlobLocation(blob(1), "b" * 64, 3, 5, 5)])
    assert index.locate([blob(1)])[blob(1)].pack_id == "a" * 64


def test_newest_active_bundle_wins(index):
    now = datetime.now(timezone.utc)
    assert index.add_bundle(bundle("1" * 64, at=now - timedelta(hours=1)))
    assert index.add_bundle(bundle("2" * 64, at=now))
    assert index.add_bundle(bundle("3" * 64, key="other", at=now + timedelta(hours=1)))
    assert index.newest_bundle("k1").id == "2" * 64
    assert index.newest_bundle("nope") is None


def test_same_manifest_twice_is_one_bundle(index):
    assert index.add_bundle(bundle("4" * 64)) is True
    assert index.add_bundle(bundle("4" * 64)) is False
    assert index.count_bundles() == 1


def test_get_bundle_by_prefix(index):
    index.add_bundle(bundle("abcdef" + "0" * 58))
    index.add_bundle(bundle("abcdee" + "0" * 58))
    assert index.get_bundle("abcdef").id.startswith("abcdef")
    with pytest.raises(NotFound):
        index.get_bundle("abcde")  # too short
    with pytest.raises(NotFound):
        index.get_bundle("ffffff")


def test_list_filters_and_orders(index):
    now = datetime.now(timezone.utc)
    index.add_bundle(bundle("1" * 64, at=now - timedelta(minutes=2), model="a"))
    index.add_bundle(bundle("2" * 64, key="2" * 32, at=now - timedelta(minutes=1), model="b"))
    index.add_bundle(bundle("3" * 64, at=now, model="a"))
    assert [b.id[0] for b in index.list_bundles()] == ["3", "2", "1"]
    assert [b.id[0] for b in index.list_bundles(model="a")] == ["3", "1"]
    assert [b.id[0] for b in index.list_bundles(bundle_key="22")] == ["2"]
    loaded = index.list_bundles(limit=1)[0]
    assert loaded.facts == {"os": "linux"} and loaded.layers == ("inductor",)
    assert loaded.created_at.tzinfo is not None


def test_record_event(index):
    index.record_event(Event("restore", "hit", "k", "b" * 64, 3, 100, 0.5))
    from sqlalchemy import text

    with index.engine.connect() as conn:
        assert conn.execute(text("select kind, status, files from events")).all() == [("restore", "hit", 3)]


def test_newest_is_by_the_index_clock_not_the_publisher_clock(index):
    now = datetime.now(timezone.utc)
    assert index.add_bundle(bundle("1" * 64, at=now + timedelta(days=365)))  # a node a year ahead
    assert index.add_bundle(bundle("2" * 64, at=now - timedelta(hours=1)))  # a slow node, published later
    assert index.newest_bundle("k1").id == "2" * 64
    assert [b.id[0] for b in index.list_bundles()] == ["2", "1"]
    stamped = index.get_bundle("1" * 64).created_at
    assert stamped < now + timedelta(days=1)  # the claim of next year is not kept


def test_reindex_keeps_the_history_it_rebuilds(index):
    then = datetime(2025, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
    index.add_bundle(bundle("5" * 64, at=then), keep_time=True)
    assert index.get_bundle("5" * 64).created_at == then


@pytest.mark.parametrize("prefix", ["%%%%%%", "______", "abc%ef", "ABCDEF", "abcdef%"])
def test_id_prefixes_are_hex_and_never_wildcards(index, prefix):
    index.add_bundle(bundle("abcdef" + "0" * 58))
    with pytest.raises(NotFound):
        index.get_bundle(prefix)
    with pytest.raises(NotFound):
        index.list_bundles(bundle_key=prefix)


def test_long_model_ids_and_many_layers_fit(index):
    many = tuple(f"extra:layer-{i:03d}" for i in range(60))  # 900+ characters of layer names
    long_model = "org/" + "m" * 1000
    assert index.add_bundle(Bundle("6" * 64, "k", "tk", "wk", long_model, {}, many, 1, 1,
                                   datetime.now(timezone.utc), "host", "active"))  # fmt: skip
    loaded = index.get_bundle("6" * 64)
    assert loaded.model == long_model and loaded.layers == many


@pytest.mark.parametrize("facts", ["not json", "[1, 2]", '{"os": 3}'])
def test_a_row_whose_facts_do_not_parse_is_an_index_error_naming_it(index, facts):
    """An index writer's (or a broken migration's) row must not crash every command with a traceback."""
    from sqlalchemy import update

    from kcache.errors import IndexDbError
    from kcache.index.models import BundleRow

    index.add_bundle(bundle("1" * 64))
    index.transaction(lambda s: s.execute(update(BundleRow).values(facts=facts)))
    for read in (lambda: index.newest_bundle("k1"), lambda: index.get_bundle("1" * 64), index.list_bundles):
        with pytest.raises(IndexDbError, match="111111111111"):
            read()


def test_restores_lookup_refuses_a_row_too_big_to_load(index, monkeypatch):
    """Restore needs a row's id; a row whose facts run to gigabytes must not take the init container's memory."""
    from sqlalchemy import update

    from kcache.errors import IndexDbError
    from kcache.index import repo
    from kcache.index.models import BundleRow

    monkeypatch.setattr(repo, "MAX_ROW_TEXT", 1000)
    index.add_bundle(bundle("1" * 64))
    huge = "{" + ",".join(f'"f{i}": "x"' for i in range(200)) + "}"
    index.transaction(lambda s: s.execute(update(BundleRow).values(facts=huge)))
    with pytest.raises(IndexDbError, match="more text than a row may have"):
        index.newest_bundle("k1")


@pytest.mark.parametrize("column", ["created_by", "model", "layers", "facts"])
def test_no_lookup_a_restore_makes_loads_an_oversized_row(index, monkeypatch, column):
    """Only facts and layers were bounded, and only in the newest-bundle lookup: a writer of the index
    planting 200 MB in created_by took restore to 446 MiB (SQLite enforces no VARCHAR length), and a
    pinned bundle's row was loaded whole."""
    from sqlalchemy import update

    from kcache.errors import IndexDbError
    from kcache.index import repo
    from kcache.index.models import BundleRow

    monkeypatch.setattr(repo, "MAX_ROW_TEXT", 100)
    monkeypatch.setattr(repo, "MAX_SHORT_TEXT", 100)
    index.add_bundle(bundle("1" * 64))
    value = '{"a": "' + "x" * 200 + '"}' if column == "facts" else "x" * 200  # within PostgreSQL's own bounds
    index.transaction(lambda s: s.execute(update(BundleRow).values({column: value})))
    for read in (lambda: index.newest_bundle("k1"), lambda: index.get_bundle("1" * 64)):
        with pytest.raises(IndexDbError, match="111111111111"):
            read()


def test_the_store_binding_is_read_only_when_small(index, monkeypatch):
    from sqlalchemy import update

    from kcache.errors import IndexDbError
    from kcache.index import repo
    from kcache.index.models import StoreBindingRow

    monkeypatch.setattr(repo, "MAX_SHORT_TEXT", 100)
    index.bind_store("s" * 32, "file:///store")
    assert index.bound_store() == ("s" * 32, "file:///store")
    index.transaction(lambda s: s.execute(update(StoreBindingRow).values(store_url="file:///" + "x" * 200)))
    with pytest.raises(IndexDbError, match="store"):
        index.bound_store()


def before_second_statement(index, change):
    """Run `change(writer)` on another connection, committed, just before the index's second statement
    (what a pod publishing or a gc does meanwhile); the statements the index ran, once it is removed."""
    from sqlalchemy import create_engine, event

    other = create_engine(index.engine.url)
    statements: list[str] = []

    def meanwhile(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)
        if len(statements) == 2:
            with other.begin() as writer:
                change(writer)

    event.listen(index.engine, "before_cursor_execute", meanwhile)
    return statements, lambda: (event.remove(index.engine, "before_cursor_execute", meanwhile), other.dispose())


@pytest.mark.parametrize("older", [False, True])
def test_a_bundle_committed_between_the_lookups_statements_is_no_oversized_row(index, older):
    """Eight pods publishing one key at once: a bundle committed while the newest-bundle lookup ran its
    second statement was reported as a row too big to load (READ COMMITTED: each statement sees new
    rows), and the publisher that asked failed."""
    from kcache.index.models import BundleRow

    now = datetime.now(timezone.utc)
    if older:
        index.add_bundle(bundle("1" * 64, at=now - timedelta(hours=1)))
    newer = dict(id="9" * 64, bundle_key="k1", toolchain_key="tk", workload_key="wk", model="m",
                 facts='{"os": "linux"}', layers="inductor", files=1, bytes=10, created_at=now, created_by="host",
                 status="active")  # fmt: skip
    statements, done = before_second_statement(index, lambda w: w.execute(BundleRow.__table__.insert(), [newer]))
    try:
        found = index.newest_bundle("k1")
    finally:
        done()
    assert statements, "the lookup ran no SQL"
    assert (found.id if found else None) in (["1" * 64, "9" * 64] if older else [None, "9" * 64])


def test_a_newest_bundle_deleted_while_it_is_loaded_gives_the_next_newest(index):
    """gc may delete the newest bundle between naming it and loading its row: the lookup asks again."""
    from sqlalchemy import delete

    from kcache.index.models import BundleRow

    now = datetime.now(timezone.utc)
    index.add_bundle(bundle("1" * 64, at=now - timedelta(hours=1)))
    index.add_bundle(bundle("2" * 64, at=now))
    _, done = before_second_statement(index, lambda w: w.execute(delete(BundleRow).where(BundleRow.id == "2" * 64)))
    try:
        found = index.newest_bundle("k1")
    finally:
        done()
    assert found is not None and found.id in ("1" * 64, "2" * 64)  # never "no bundle" while one is left


def test_a_newest_bundle_yanked_while_it_is_loaded_is_not_the_answer(index):
    """A yank may commit between naming the newest active bundle and loading its row (PostgreSQL, READ
    COMMITTED): the lookup gave back the bundle it then read as yanked, as the newest active one, and a
    publisher's ref refresh racing the yank wrote a ref naming it. It asks again, for the bundle the yank
    falls back to."""
    from sqlalchemy import update

    from kcache.index.models import BundleRow

    now = datetime.now(timezone.utc)
    index.add_bundle(bundle("1" * 64, at=now - timedelta(hours=1)))
    index.add_bundle(bundle("2" * 64, at=now))
    yank = update(BundleRow).where(BundleRow.id == "2" * 64).values(status="yanked")
    statements, done = before_second_statement(index, lambda w: w.execute(yank))
    try:
        found = index.newest_bundle("k1")
    finally:
        done()
    assert len(statements) >= 2, "the yank never ran between the lookup's statements"
    assert found is not None and (found.id, found.status) == ("1" * 64, "active")


# SQLite keeps whatever a writer stores in any column (PostgreSQL refuses it): text where a count is.
@pytest.mark.parametrize("column, value", [("files", "'many'"), ("bytes", "'x'"), ("bytes", "-1"), ("files", "1.5"),
                                           ("compile_seconds", "'x'"), ("compile_seconds", "x'00'"),
                                           ("created_by", "x'41'"), ("model", "x'41'")])  # fmt: skip
def test_a_wrong_typed_value_is_an_index_error_naming_its_row_and_column(sqlite_index, column, value):
    """ls formatted a bytes of 'x' and crashed as a bug (exit 70); every read path must refuse the row."""
    from kcache.errors import IndexDbError
    from kcache.index import lifecycle

    index = sqlite_index
    index.add_bundle(bundle("1" * 64))
    with index.engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE bundles SET {column} = {value}")
    reads = [lambda: index.newest_bundle("k1"), lambda: index.get_bundle("1" * 64), index.list_bundles,
             lambda: lifecycle.bundle(index, "1" * 64)]  # fmt: skip
    if column in {field.name for field in fields(lifecycle.BundleHead)}:  # gc's and verify's listing
        reads.append(lambda: lifecycle.bundle_heads(index))
    for read in reads:
        with pytest.raises(IndexDbError, match=f"111111111111.*{column}"):
            read()


@pytest.mark.skipif(sys.version_info < (3, 11), reason="sqlite3's setlimit is Python 3.11's (docs/design.md)")
def test_a_sqlite_value_past_the_length_limit_is_never_read_whole(tmp_path, monkeypatch):
    """SQLite's length() stops at a NUL: "\\0" + 200 MB in created_by measured 0 and was loaded whole
    (432 MiB), and length() itself read the whole value. Each SQLite connection caps a value's length."""
    import sqlite3

    from kcache.errors import IndexDbError
    from kcache.index import Index, db

    monkeypatch.setattr(db, "SQLITE_MAX_VALUE", 4096)
    path = tmp_path / "i.db"
    index = Index.open(f"sqlite:///{path}")
    index.add_bundle(bundle("1" * 64))
    raw = sqlite3.connect(path)  # a writer of the index, without kcache's limit
    raw.execute("UPDATE bundles SET created_by = ?", ("\0" + "x" * 100_000,))
    raw.commit()
    raw.close()
    for read in (lambda: index.newest_bundle("k1"), lambda: index.get_bundle("1" * 64)):
        with pytest.raises(IndexDbError):
            read()
    index.close()


def test_an_index_error_quotes_no_more_than_a_line_of_what_it_read(tmp_path):
    """A padded created_at was quoted whole in the error (then redacted at a cost growing with the
    square of its length: a restore held for minutes past its budget)."""
    import sqlite3

    from kcache.errors import IndexDbError
    from kcache.index import Index

    path = tmp_path / "i.db"
    index = Index.open(f"sqlite:///{path}")
    index.add_bundle(bundle("1" * 64))
    raw = sqlite3.connect(path)
    raw.execute("UPDATE bundles SET created_at = ?", ("2026-01-01" + "a" * 5_000,))
    raw.commit()
    raw.close()
    with pytest.raises(IndexDbError) as caught:
        index.newest_bundle("k1")
    assert len(str(caught.value)) < 2000
    index.close()
