"""`kcache config`: the settings in effect and where each came from (flag, env or default)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from kcache import limits
from kcache.cli import format as fmt
from kcache.cli.options import json_option, origin, settings, store_options
from kcache.config import DEFAULT, redact_url


@click.command("config")
@store_options(index_none=True)
@click.option("--model", metavar="ID", envvar="KCACHE_MODEL", help="Model identity restore and publish would use.")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), envvar="KCACHE_ROOT",
            help="Restore root that ready, serve, watch and warmup would use.")  # fmt: skip
@json_option
def config_cmd(store_url, index_url, s3_endpoint_url, model, root, as_json):
    """Show the effective home, store, index, S3 endpoint, model, root and manifest cap, and where each came from.

    Pass the same flags as the command you are debugging; passwords in URLs are shown as ***.

    \b
    Examples:
      kcache config
      KCACHE_STORE=s3://caches/prod kcache config --json
    """
    cfg = settings(store_url, index_url, s3_endpoint_url)
    rows = {
        "home": (str(cfg.home), cfg.origin("home")),
        "store": (redact_url(cfg.store_url), cfg.origin("store")),
        "index": (redact_url(cfg.index_url), cfg.origin("index")),
        "endpoint": (redact_url(cfg.s3_endpoint_url) if cfg.s3_endpoint_url else None, cfg.origin("endpoint")),
        "model": (model, origin("model") or DEFAULT),
        "root": (str(root) if root else None, origin("root") or DEFAULT),
        # Bytes; publish refuses a bigger manifest and restore will not read one.
        "max-manifest": (limits.max_manifest_bytes(),
                         f"env {limits.MANIFEST_ENV}" if os.environ.get(limits.MANIFEST_ENV, "").strip() else DEFAULT),
    }
    if as_json:
        click.echo(fmt.to_json({name: {"value": value, "origin": where} for name, (value, where) in rows.items()}))
        return
    table = [(name, "-" if value is None else value, where) for name, (value, where) in rows.items()]
    click.echo(fmt.table(["setting", "value", "from"], table))
