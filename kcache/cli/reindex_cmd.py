"""`kcache reindex`: rebuild the SQL index from the store."""

from __future__ import annotations

from dataclasses import asdict

import click

from kcache.cli import format as fmt
from kcache.cli.errors import ExitCode
from kcache.cli.options import json_option, opened, settings, store_options
from kcache.reindex import reindex


@click.command("reindex")
@click.option("--jobs", type=click.IntRange(1, 256), default=16, show_default=True, help="Parallel trailer reads.")
@store_options
@json_option
def reindex_cmd(jobs, store_url, index_url, s3_endpoint_url, as_json):
    """Rebuild the index's packs, blobs and bundles from what the store holds.

    Safe to run on a live index: rows that exist are kept as they are. Exits 12 when objects had
    to be skipped, listing each.

    \b
    Example:
      kcache reindex --store s3://caches/prod --index postgresql+psycopg://kcache@db/kcache
    """
    with opened(settings(store_url, index_url, s3_endpoint_url), jobs=jobs) as (store, index):
        result = reindex(store, index, jobs=jobs)
    if as_json:
        click.echo(fmt.to_json(asdict(result)))
    else:
        click.echo(f"kcache: indexed {result.packs} packs ({result.blobs} blobs) and {result.bundles} bundles "
                   f"({result.new_bundles} new)")  # fmt: skip
        for problem in result.skipped:
            click.echo(f"  skipped {fmt.text(problem)}", err=True)
    if result.skipped:
        raise click.exceptions.Exit(ExitCode.PROBLEMS)
