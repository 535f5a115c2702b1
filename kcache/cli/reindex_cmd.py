"""`kcache reindex`: rebuild the SQL index from the store."""

from __future__ import annotations

from dataclasses import asdict

import click

from kcache.cli import format as fmt
from kcache.cli.errors import ExitCode
from kcache.cli.options import json_option, opened, settings, store_options
from kcache.reindex import reindex


@click.command("reindex")
@click.option("--jobs", type=click.IntRange(1, 256), default=16, show_default=True, help="Parallel pack reads.")
@click.option("--trust-trailers", is_flag=True,
              help="Index the blobs each pack's trailer lists without reading and hashing them (fast, "
                   "for a store only trusted publishers can write).")  # fmt: skip
@store_options
@json_option
def reindex_cmd(jobs, trust_trailers, store_url, index_url, s3_endpoint_url, as_json):
    """Rebuild the index's packs, blobs and bundles from what the store holds.

    Every blob a pack's trailer lists is read and hashed first, and only those that match their
    ids are indexed: publish reuses indexed blobs instead of uploading them, so a forged trailer
    must not get in. That reads the whole store; --trust-trailers reads only the trailers.
    Safe to run on a live index: rows that exist are kept as they are. Exits 12 when objects had
    to be skipped, listing each.

    \b
    Example:
      kcache reindex --store s3://caches/prod --index postgresql+psycopg://kcache@db/kcache
    """
    with opened(settings(store_url, index_url, s3_endpoint_url), jobs=jobs) as (store, index):
        result = reindex(store, index, jobs=jobs, trust_trailers=trust_trailers)
    if as_json:
        click.echo(fmt.to_json(asdict(result)))
    else:
        click.echo(f"kcache: indexed {result.packs} packs ({result.blobs} blobs) and {result.bundles} bundles "
                   f"({result.new_bundles} new)")  # fmt: skip
        for problem in result.skipped:
            click.echo(f"  skipped {fmt.text(problem)}", err=True)
    if result.skipped:
        raise click.exceptions.Exit(ExitCode.PROBLEMS)
