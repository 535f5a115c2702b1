"""`kcache publish`: upload this machine's caches (only what the store lacks) as a bundle."""

from __future__ import annotations

import logging
from dataclasses import asdict
from pathlib import Path

import click

from kcache import sources
from kcache.cli import format as fmt
from kcache.cli import progress_bars
from kcache.cli.options import (
    compute_fingerprint,
    fingerprint_options,
    handle_errors,
    json_option,
    load_signing_key,
    open_index,
    settings,
    stderr_is_terminal,
    store_options,
)
from kcache.hashcache import HashCache
from kcache.publish import publish
from kcache.store import open_store

log = logging.getLogger(__name__)


@click.command("publish")
@click.option("--from", "root", type=click.Path(file_okay=False, path_type=Path),
              help="Publish the layout of a restore root (ROOT/inductor, ROOT/triton, ...) instead of "
                   "the live cache directories.")  # fmt: skip
@click.option(
    "--layers", metavar="A,B", help=f"Only these layers (default all: {', '.join(s.name for s in sources.BUILTIN)})."
)
@click.option("--extra-dir", "extra_dirs", multiple=True, metavar="NAME=PATH",
              help="Also carry a directory of your own; restored to ROOT/extra/NAME.")  # fmt: skip
@click.option("--signing-key", type=click.Path(dir_okay=False, path_type=Path), envvar="KCACHE_SIGNING_KEY",
              help="Sign the manifest with this key from `kcache keygen`.")  # fmt: skip
@click.option("--compile-seconds", type=click.FloatRange(min=0), metavar="S",
              help="Seconds the cold warmup took; `kcache stats` counts this minus restore time as saved.")  # fmt: skip
@click.option("--jobs", type=click.IntRange(1, 256), default=8, show_default=True, help="Parallel hashing and uploads.")
@fingerprint_options
@store_options
@json_option
@handle_errors
def publish_cmd(root, layers, extra_dirs, signing_key, compile_seconds, jobs, model, model_config, facts, extras,
                store_url, index_url, s3_endpoint_url, as_json):  # fmt: skip
    """Publish the compiled-kernel caches as a bundle for this machine's fingerprint.

    Uploads only blobs the index does not have: re-publishing an unchanged cache uploads
    nothing. Safe to run from many pods at once.

    \b
    Examples:
      kcache publish --model my-llm                      # live cache dirs after warmup
      kcache publish --from /cache --model my-llm --json # what `restore --into /cache` laid out
    """
    fp = compute_fingerprint(model, model_config, facts, extras)
    names = layers.split(",") if layers else None
    extras = [sources.parse_extra_dir(s) for s in extra_dirs]
    chosen = sources.in_root(root, names, extras) if root else sources.select(names, extras)
    key = load_signing_key(signing_key)
    cfg = settings(store_url, index_url, s3_endpoint_url)
    store = open_store(cfg.store_url, endpoint_url=cfg.s3_endpoint_url, jobs=jobs)
    index = open_index(cfg.index_url)
    hashes = HashCache(cfg.home / "hashcache.db")
    try:
        note = (lambda msg: click.echo(f"kcache: {msg}", err=True)) if stderr_is_terminal() and not as_json else None
        with progress_bars.bars(progress_bars.wanted(as_json)) as report:
            result = publish(store, index, fp, chosen, root=root, jobs=jobs, progress=note, signing_key=key,
                             compile_seconds=compile_seconds, hash_cache=hashes, report=report)  # fmt: skip
    finally:
        index.close()
        hashes.close()
    if as_json:
        click.echo(fmt.to_json(asdict(result)))
        return
    verb = "published" if result.created else "unchanged (already published)"
    click.echo(
        f"kcache: {verb} bundle {result.bundle_id[:12]} for key {result.bundle_key}: "
        f"{result.files} files, {fmt.size(result.bytes)}; uploaded {result.new_blobs} new blobs "
        f"({fmt.size(result.new_bytes)} raw, {fmt.size(result.uploaded_bytes)} packed) in {fmt.seconds(result.seconds)}"
    )
