"""`kcache db upgrade`: apply the index's migrations."""

from __future__ import annotations

import click

from kcache import config
from kcache.cli import format as fmt
from kcache.cli.options import NonEmptyText, json_option, settings


@click.group("db")
def db_group():
    """Manage the SQL index's schema."""


@db_group.command("upgrade")
@click.option("--index", "index_url", metavar="URL", envvar=config.ENV["index"], type=NonEmptyText(),
            help="SQLAlchemy URL of the index (default sqlite:///$KCACHE_HOME/index.db).")  # fmt: skip
@json_option
def upgrade_cmd(index_url, as_json):
    """Apply every pending migration to the index (SQLite upgrades itself; PostgreSQL needs this).

    \b
    Example:
      kcache db upgrade --index postgresql+psycopg://kcache@db/kcache
    """
    from kcache import binding
    from kcache.index.db import upgrade_url

    cfg = settings(None, index_url, None)
    binding.require_index(cfg)
    url = cfg.index_url
    before, after = upgrade_url(url)
    shown = config.redact_url(url)
    if as_json:
        click.echo(fmt.to_json({"status": "ok", "index": shown, "before": before, "after": after,
                                "upgraded": before != after}))  # fmt: skip
    elif before == after:
        click.echo(f"index {shown} is up to date (revision {after})")
    else:
        click.echo(f"index {shown} upgraded from {before or 'empty'} to {after}")
