"""`kcache stats`: hit rate, bytes moved, restore times and compile time saved, from the events."""

from __future__ import annotations

from dataclasses import asdict

import click

from kcache import durations, stats
from kcache.cli import format as fmt
from kcache.cli.options import json_option, opened, settings, store_options
from kcache.errors import NotFound
from kcache.index import lifecycle


@click.command("stats")
@click.option("--since", metavar="DURATION",
              help="Only events of the last DURATION, e.g. 12h, 7d, 2w or 1d12h (default: all).")  # fmt: skip
@click.option("--model", metavar="ID",
              help="Only events for bundle keys of this model's bundles (misses on never-published keys "
                   "cannot be attributed).")  # fmt: skip
@store_options
@json_option
def stats_cmd(since, model, store_url, index_url, s3_endpoint_url, as_json):
    """Report restores, hits, misses, bytes, restore times and compile seconds saved.

    A partial restore (`restore --fallback toolchain|layers`: kernel layers of another bundle) is
    counted apart and is not a hit: the hit rate is full hits over all restores. Restore times and
    compile seconds saved are over full hits.

    Seconds saved per hit = the bundle's cold compile time (`kcache publish --compile-seconds`)
    minus the restore's own time, never below zero; hits on bundles published without it are
    counted as having no estimate.

    \b
    Examples:
      kcache stats --since 7d
      kcache stats --since 24h --model my-llm --json
    """
    window = durations.parse(since, "--since") if since else None
    with opened(settings(store_url, index_url, s3_endpoint_url), store=False, write=False) as (_, index):
        if model is not None and not lifecycle.bundle_keys(index, model):
            # Events count for a model through its bundles' keys: none, and the report would be zeros, as
            # for a model nobody restores (a misspelt --model read so).
            raise NotFound("bundle of model", model)
        result = stats.summarize(index, window=window, model=model)
    if as_json:
        doc = {**asdict(result), "since": result.since.isoformat() if result.since else None,
               "hit_rate": result.hit_rate}  # fmt: skip
        click.echo(fmt.to_json(doc))
        return
    scope = f"since {fmt.when(result.since)} UTC" if result.since else "all recorded events"
    click.echo(f"kcache stats: {scope}" + (f", model {model}" if model else ""))
    rate = f"{result.hit_rate:.1%}" if result.hit_rate is not None else "-"
    click.echo(f"restores       {result.restores}: {result.hits} hits, {result.partials} partial, "
               f"{result.misses} misses, {result.errors} errors; hit rate {rate}"
               + (" (partial restores are not hits)" if result.partials else ""))  # fmt: skip
    partial = f" ({fmt.size(result.partial_bytes)} by partial restores)" if result.partials else ""
    click.echo(f"restored       {fmt.size(result.bytes_restored)}{partial}")
    if result.median_restore_seconds is not None:
        click.echo(f"restore time   median {fmt.seconds(result.median_restore_seconds)}, "
                   f"p95 {fmt.seconds(result.p95_restore_seconds)} (hits)")  # fmt: skip
    click.echo(f"publishes      {result.publishes} ({result.published} new bundles), "
               f"{fmt.size(result.bytes_uploaded)} uploaded")  # fmt: skip
    saved = f"compile saved  {fmt.seconds(result.seconds_saved)} over {result.hits_with_estimate} hits"
    if result.hits_without_estimate:
        saved += (f"; {result.hits_without_estimate} hits had no estimate "
                  "(publish with --compile-seconds)")  # fmt: skip
    click.echo(saved)
