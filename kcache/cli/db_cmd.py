"""`kcache db upgrade`: apply the index's migrations."""

from __future__ import annotations

import click

from kcache.cli.options import handle_errors, settings


@click.group("db")
def db_group():
    """Manage the SQL index's schema."""


@db_group.command("upgrade")
@click.option("--index", "index_url", metavar="URL", help="SQLAlchemy URL (env KCACHE_INDEX).")
@handle_errors
def upgrade_cmd(index_url):
    """Apply every pending migration to the index (SQLite upgrades itself; PostgreSQL needs this).

    \b
    Example:
      kcache db upgrade --index postgresql+psycopg://kcache@db/kcache
    """
    from kcache.index.db import make_engine, upgrade

    url = settings(None, index_url, None).index_url
    engine = make_engine(url)
    try:
        before, after = upgrade(engine)
    finally:
        engine.dispose()
    if before == after:
        click.echo(f"index {url} is up to date (revision {after})")
    else:
        click.echo(f"index {url} upgraded from {before or 'empty'} to {after}")
