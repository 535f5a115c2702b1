"""`kcache reindex`: rebuild the SQL index from the store."""

from __future__ import annotations

from dataclasses import asdict

import click

from kcache.cli import format as fmt
from kcache.cli.errors import ExitCode
from kcache.cli.options import (
    json_option,
    load_trusted_keys,
    opened,
    read_jobs_option,
    settings,
    store_options,
    trusted_key_option,
)
from kcache.reindex import reindex


@click.command("reindex")
@read_jobs_option
@click.option("--trust-trailers", is_flag=True,
              help="Index the blobs each pack's trailer lists without reading and hashing them (fast, "
                   "for a store only trusted publishers can write).")  # fmt: skip
@trusted_key_option("A .pub from `kcache keygen`; repeatable (env: ':'-separated). Only bundles one of them signed "
                   "are indexed, and only refs one of them signed date them.")  # fmt: skip
@store_options
@json_option
def reindex_cmd(jobs, trust_trailers, trusted_keys, store_url, index_url, s3_endpoint_url, as_json):
    """Rebuild the index's packs, blobs and bundles from what the store holds.

    Every blob a pack's trailer lists is read and hashed first, and only those that match their
    ids are indexed: publish reuses indexed blobs instead of uploading them, so a forged trailer
    must not get in. That reads the whole store; --trust-trailers reads only the trailers.
    With the pods' --trusted-key, only bundles a trusted key signed are indexed: otherwise
    whoever can write the store can add bundles (the newest ones, for pods and for gc).
    A manifest restore could not lay out (a pack it names is missing or short, it is not where
    restore reads it, its keys are not its facts') or whose row the index cannot hold is skipped.
    Safe to run on a live index, while publishes commit, and again after it was cut off: rows that
    exist are kept as they are (a yank in the store still wins; a row that does not read back, which
    every other command refuses, is rewritten from its manifest and listed), and a manifest written moments ago
    for a key a publish holds the lease of is left to that publish's commit (listed). Run it to the end before `kcache
    gc`: to gc, a manifest without a row is an orphan. Exits 12 when objects had to be skipped,
    listing each.

    \b
    Examples:
      kcache reindex --store s3://caches/prod --index postgresql+psycopg://kcache@db/kcache
      kcache reindex --trusted-key /secrets/prod-2026.pub --json   # only what the pods would trust
    """
    with opened(settings(store_url, index_url, s3_endpoint_url), jobs=jobs, create=True) as (store, index):
        result = reindex(
            store, index, jobs=jobs, trust_trailers=trust_trailers, trusted=load_trusted_keys(trusted_keys)
        )
    if as_json:  # exit 12 prints the error object every command prints, with the report
        failed = {"error": f"{len(result.skipped)} objects could not be indexed (listed in skipped)",
                  "hint": _SKIPPED_HINT, "exit_code": int(ExitCode.PROBLEMS)} if result.skipped else {}  # fmt: skip
        click.echo(fmt.to_json({"status": "damaged" if result.skipped else "ok", **asdict(result), **failed}))
    else:
        click.echo(f"kcache: indexed {result.packs} packs ({result.blobs} blobs) and {result.bundles} bundles "
                   f"({result.new_bundles} new)")  # fmt: skip
        for bundle_id in result.repaired:
            click.echo(f"  rewrote the row of bundle {bundle_id[:12]} from its manifest: it did not read back")
        for bundle_id in result.publishing:
            click.echo(f"  left bundle {bundle_id[:12]} to the publish of its key that is running (its lease is "
                       "held); run reindex again if that publish never commits it", err=True)  # fmt: skip
        for problem in result.skipped:
            click.echo(f"  skipped {fmt.text(problem)}", err=True)
        if result.skipped:
            click.echo(f"  hint: {_SKIPPED_HINT}", err=True)
    if result.skipped:
        raise click.exceptions.Exit(ExitCode.PROBLEMS)


_SKIPPED_HINT = ("each skipped object is listed: re-publish the bundles it names (`kcache verify` checks the "
                 "store), then reindex again")
