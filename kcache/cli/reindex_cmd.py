"""`kcache reindex`: rebuild the SQL index from the store."""

from __future__ import annotations

from dataclasses import asdict

import click

from kcache import binding
from kcache.cli import format as fmt
from kcache.cli.options import handle_errors, json_option, settings, store_options
from kcache.reindex import reindex
from kcache.store import open_store


@click.command("reindex")
@click.option("--jobs", type=click.IntRange(1, 256), default=16, show_default=True, help="Parallel trailer reads.")
@store_options
@json_option
@handle_errors
def reindex_cmd(jobs, store_url, index_url, s3_endpoint_url, as_json):
    """Rebuild the index's packs, blobs and bundles from what the store holds.

    Safe to run on a live index: rows that exist are kept as they are.

    \b
    Example:
      kcache reindex --store s3://caches/prod --index postgresql+psycopg://kcache@db/kcache
    """
    cfg = settings(store_url, index_url, s3_endpoint_url)
    store = open_store(cfg.store_url, endpoint_url=cfg.s3_endpoint_url, jobs=jobs)
    index = binding.open_index(cfg, store, write=True)
    try:
        result = reindex(store, index, jobs=jobs)
    finally:
        index.close()
    if as_json:
        click.echo(fmt.to_json(asdict(result)))
    else:
        click.echo(f"kcache: indexed {result.packs} packs ({result.blobs} blobs) and {result.bundles} bundles "
                   f"({result.new_bundles} new)")  # fmt: skip
        for problem in result.skipped:
            click.echo(f"  skipped {problem}", err=True)
    if result.skipped:
        raise click.exceptions.Exit(1)
