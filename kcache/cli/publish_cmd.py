"""`kcache publish`: upload this machine's caches (only what the store lacks) as a bundle.

Also home of the publish configuration every publishing command builds the same way
(`publish_options`, `publish_config`): publish, prebake and watch sign, cache hashes and
refuse empty bundles alike.
"""

from __future__ import annotations

import logging
import sqlite3
from dataclasses import asdict, replace
from pathlib import Path

import click

from kcache import binding, refs, sources
from kcache.allocator import fewer_collections, reuse_freed_memory
from kcache.cli import format as fmt
from kcache.cli import progress_bars
from kcache.cli.options import (
    FiniteFloat,
    NonEmptyPath,
    NonEmptyText,
    Wait,
    command_line_workload,
    compute_fingerprint,
    fingerprint_options,
    json_option,
    load_signing_key,
    open_configured_store,
    settings,
    stderr_is_terminal,
    store_options,
)
from kcache.config import Settings
from kcache.hashcache import HashCache
from kcache.publish import PEER_WAIT, PublishConfig, publish, workload_of

log = logging.getLogger(__name__)


def signing_key_option(fn):
    return click.option(
        "--signing-key",
        type=NonEmptyPath(dir_okay=False, path_type=Path),
        envvar="KCACHE_SIGNING_KEY",
        help="Sign the manifest with this key from `kcache keygen`.",
    )(fn)


def allow_empty_option(fn):
    return click.option(
        "--allow-empty",
        is_flag=True,
        help="Publish even when no cache file was found (the empty bundle becomes the newest).",
    )(fn)


def publish_config(cfg: Settings, *, jobs: int = 8, signing_key: Path | None = None, allow_empty: bool = False,
                   peer_wait: float = PEER_WAIT) -> PublishConfig:  # fmt: skip
    """The one publish configuration; its hash cache stays open until the command ends. Refuses
    --index none first: a publisher records its bundle in the index (prebake before its warmup)."""
    binding.require_index(cfg)
    refs.default_ttl()  # a bad KCACHE_REF_TTL fails before the warmup and uploads; refs are written last
    key = load_signing_key(signing_key)
    try:
        cache = HashCache(cfg.home / "hashcache.db")
    except (OSError, sqlite3.Error) as exc:  # a read-only home: slower re-publishes, not a failed one
        log.warning("no hash cache in %s (%s); every file is read again", cfg.home, exc)
        cache = None
    else:
        click.get_current_context().call_on_close(cache.close)
    return PublishConfig(jobs=jobs, signing_key=key, hash_cache=cache, allow_empty=allow_empty, peer_wait=peer_wait)


@click.command("publish")
@click.option("--from", "root", type=NonEmptyPath(file_okay=False, path_type=Path),
              help="Publish the layout of a restore root (ROOT/inductor, ROOT/triton, ...) instead of "
                   "the live cache directories.")  # fmt: skip
@click.option(
    "--layers", metavar="A,B", type=NonEmptyText(),
    help=f"Only these layers (default all: {', '.join(s.name for s in sources.BUILTIN)}).",
)
@click.option("--extra-dir", "extra_dirs", multiple=True, metavar="NAME=PATH",
              help="Also carry a directory of your own; restored to ROOT/extra/NAME.")  # fmt: skip
@click.option("--drop-layers", is_flag=True,
              help="With --from ROOT: publish even without a layer the restore into ROOT laid down (left out by "
                   "--layers, or emptied). Later pods then lose it: restore takes the newest bundle.")  # fmt: skip
@signing_key_option
@allow_empty_option
@click.option("--compile-seconds", type=FiniteFloat(min=0), metavar="S",
              help="Seconds the cold warmup took; `kcache stats` counts this minus restore time as saved.")  # fmt: skip
@click.option("--jobs", type=click.IntRange(1, 256), default=8, show_default=True, help="Parallel hashing and uploads.")
@click.option("--peer-wait", type=Wait(), default=f"{PEER_WAIT:g}s", show_default=True, metavar="DURATION",
              help="Wait this long for a publish of the same bundle key elsewhere (another replica) to finish, "
                   "then upload only what it did not; 0 uploads at once.")  # fmt: skip
@fingerprint_options
@store_options
@json_option
def publish_cmd(root, layers, extra_dirs, drop_layers, signing_key, allow_empty, compile_seconds, jobs, peer_wait,
                model, model_config, facts, extras, store_url, index_url, s3_endpoint_url, as_json):  # fmt: skip
    """Publish the compiled-kernel caches as a bundle for this machine's fingerprint.

    Uploads only blobs the index does not have: re-publishing an unchanged cache uploads
    nothing. Safe to run from many pods at once: pods of one bundle key take turns (--peer-wait),
    so each pack goes up once. Without --model, `--from ROOT` publishes under
    the model (and config, extras) that the restore into ROOT used, with --extra and --fact model.*
    over them; elsewhere a model is required. A --facts-file this machine contradicts is refused.
    A bundle with no files needs --allow-empty.

    Packs are built in TMPDIR before they go up: it needs room for --jobs packs of 32 MiB, or of
    a large file's compressed size each. A cache file that changes while it is packed exits 16
    (nothing stored is wrong; publish again). A publish that failed or was killed part-way leaves
    no bundle that names missing packs; run it again (it uploads only what is still missing).

    \b
    Examples:
      kcache publish --model my-llm                      # live cache dirs after warmup
      kcache publish --from /cache --model my-llm --json # what `restore --into /cache` laid out
    """
    reuse_freed_memory()  # packs stream through MiB buffers: see kcache.allocator
    fewer_collections()  # ~100k live objects, almost no cycles: see kcache.allocator
    fp = workload_of(compute_fingerprint(model, model_config, facts, extras), root,
                     command_line_workload(facts, extras))  # fmt: skip
    names = layers.split(",") if layers else None
    extras = [sources.parse_extra_dir(s) for s in extra_dirs]
    chosen = sources.in_root(root, names, extras) if root else sources.select(names, extras)
    cfg = settings(store_url, index_url, s3_endpoint_url)
    store = open_configured_store(cfg, jobs=jobs, publisher=True)
    show = stderr_is_terminal() and not as_json
    note = (lambda msg: click.echo(f"kcache: {fmt.text(msg)}", err=True)) if show else None  # names files of ROOT
    config = replace(publish_config(cfg, jobs=jobs, signing_key=signing_key, allow_empty=allow_empty,
                                    peer_wait=peer_wait), drop_layers=drop_layers)  # fmt: skip
    index = binding.open_index(cfg, store, write=True)
    try:
        with progress_bars.bars(progress_bars.wanted(as_json)) as report:
            result = publish(store, index, fp, chosen, root=root, config=config, progress=note,
                             compile_seconds=compile_seconds, report=report)  # fmt: skip
    finally:
        index.close()
    if as_json:
        click.echo(fmt.to_json(asdict(result)))
        return
    verb = "published" if result.created else "unchanged (already published)"
    yanked = "; it was yanked before and stays yanked" if result.yanked else ""
    click.echo(
        f"kcache: {verb} bundle {result.bundle_id[:12]} for key {result.bundle_key}: "
        f"{result.files} files, {fmt.size(result.bytes)}; uploaded {result.new_blobs} new blobs "
        f"({fmt.size(result.new_bytes)} raw, {fmt.size(result.uploaded_bytes)} packed) in "
        f"{fmt.seconds(result.seconds)}{yanked}"
    )
