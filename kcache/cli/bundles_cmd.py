"""`kcache ls` and `kcache show`: what the index holds."""

from __future__ import annotations

import click

from kcache import manifest as manifests
from kcache.cli import format as fmt
from kcache.cli.options import (
    MAX_LIMIT,
    bundle_id_prefix,
    bundle_key_prefix,
    json_option,
    opened,
    settings,
    store_options,
)


@click.command("ls")
@click.option("--key", metavar="KEY", help="Only bundles whose bundle key starts with KEY (hex, either case).")
@click.option("--model", metavar="ID", help="Only bundles of this model id.")
@click.option("--limit", type=click.IntRange(1, MAX_LIMIT), default=50, show_default=True,
              help="At most this many bundles.")  # fmt: skip
@store_options
@json_option(listing="bundle")
def ls_cmd(key, model, limit, store_url, index_url, s3_endpoint_url, as_json):
    """List bundles, newest first.

    \b
    Examples:
      kcache ls
      kcache ls --model my-llm --json
    """
    cfg = settings(store_url, index_url, s3_endpoint_url)
    key = bundle_key_prefix(key) if key else None
    with opened(cfg, store=False, write=False) as (_, index):
        bundles = index.list_bundles(bundle_key=key, model=model, limit=limit)
    if as_json:
        click.echo(fmt.to_json([fmt.bundle_json(b) for b in bundles]))
        return
    if not bundles and (model or key):
        named = " and ".join(([f"model {model!r}"] if model else []) + ([f"bundle key {key}..."] if key else []))
        click.echo(f"no bundles of {named}: `kcache ls` lists every model's")
    elif not bundles:
        click.echo("no bundles yet: run `kcache publish` after a warmup")
        return
    rows = [(b.id[:12], b.bundle_key, b.model or "-", b.files, fmt.size(b.bytes), fmt.when(b.created_at), b.status)
            for b in bundles]  # fmt: skip
    click.echo(fmt.table(["bundle", "bundle key", "model", "files", "size", "created (UTC)", "status"], rows))


@click.command("show")
@click.argument("bundle")
@click.option("--files", "list_files", is_flag=True, help="Also list every file with its size and mode.")
@store_options
@json_option
def show_cmd(bundle, list_files, store_url, index_url, s3_endpoint_url, as_json):
    """Show one bundle: keys, facts, layers and (with --files) its files.

    BUNDLE is a bundle id or an unambiguous prefix of it (as `kcache ls` prints).

    \b
    Example:
      kcache show 3f2a9c01bd47 --files
    """
    cfg = settings(store_url, index_url, s3_endpoint_url)
    bundle = bundle_id_prefix(bundle)
    with opened(cfg, store=list_files, write=False) as (store, index):
        found = index.get_bundle(bundle)
        entries: tuple[manifests.Entry, ...] = ()
        if list_files:
            entries = manifests.fetch(store, found.id).entries
    if as_json:
        doc = fmt.bundle_json(found)
        if list_files:
            doc["entries"] = [{"path": e.path, "mode": e.mode, "size": e.size, "blob": e.blob} for e in entries]
        click.echo(fmt.to_json(doc))
        return
    click.echo(f"bundle         {found.id}")
    click.echo(f"bundle key     {fmt.text(found.bundle_key)}")
    click.echo(f"toolchain key  {fmt.text(found.toolchain_key)}")
    click.echo(f"workload key   {fmt.text(found.workload_key)}")
    click.echo(f"model          {fmt.text(found.model or '-')}")
    click.echo(f"layers         {fmt.text(', '.join(found.layers) or '-')}")
    click.echo(f"files          {found.files} ({fmt.size(found.bytes)})")
    click.echo(f"created        {fmt.when(found.created_at)} UTC by {fmt.text(found.created_by)}")
    click.echo(f"status         {fmt.text(found.status)}")
    click.echo()
    click.echo(fmt.table(["fact", "value"], sorted(found.facts.items())))
    if list_files:
        click.echo()
        click.echo(fmt.table(["mode", "size", "path"], [(f"{e.mode:o}", e.size, e.path) for e in entries]))
