"""The SQL the index really runs, and the database's plan for it (for the index benchmark and plan tests).

`captured(engine)` records each statement an Index call sends, with its parameters, exactly as the
driver receives them; `explain(engine, statement)` asks the database how it runs that statement.
Plans of the real statements, not of hand-written look-alikes, are what show whether an index is used.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine, event


@dataclass(frozen=True)
class Statement:
    sql: str
    params: Any  # a dict (PostgreSQL's pyformat) or a tuple (SQLite's qmark), as the driver got it


@contextmanager
def captured(engine: Engine) -> Iterator[list[Statement]]:
    """Collect every single-row-set statement run on `engine` inside the block (executemany is skipped)."""
    seen: list[Statement] = []

    def hook(_conn, _cursor, statement, parameters, _context, executemany) -> None:
        if not executemany:
            seen.append(Statement(statement, parameters))

    event.listen(engine, "before_cursor_execute", hook)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", hook)


def explain(engine: Engine, statement: Statement, *, analyze: bool = False, settings: Sequence[str] = ()) -> str:
    """The plan as text. With `analyze` the statement runs (PostgreSQL only) inside a transaction rolled back.

    `settings` are PostgreSQL `SET LOCAL` assignments such as "enable_seqscan = off", which let a test on
    a small table ask whether an index *can* serve a query, where the planner would rightly scan instead.
    """
    postgres = engine.dialect.name == "postgresql"
    if postgres:
        prefix = "EXPLAIN (ANALYZE, BUFFERS) " if analyze else "EXPLAIN "
    else:
        prefix = "EXPLAIN QUERY PLAN "
    with engine.connect() as conn, conn.begin() as tx:
        for setting in settings if postgres else ():
            conn.exec_driver_sql(f"SET LOCAL {setting}")
        rows = conn.exec_driver_sql(prefix + statement.sql, statement.params).all()
        tx.rollback()
    # PostgreSQL gives one text column per line; SQLite gives (id, parent, notused, detail).
    return "\n".join(str(row[0]) if postgres else str(row[-1]) for row in rows)
