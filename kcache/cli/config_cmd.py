"""`kcache config`: the settings in effect and where each came from (flag, env or default)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from kcache import limits
from kcache.cli import format as fmt
from kcache.cli.options import NonEmptyPath, json_option, origin, settings, store_options
from kcache.config import DEFAULT, redact_text, redact_url

# Settings read from the environment by the commands that use them (their flags, where they have
# one, are theirs: pass them to that command). Shown as set, passwords in URLs as ***; not checked
# here, the command that reads one says what is wrong with it.
ENVIRONMENT_ONLY = (
    ("s3-max-attempts", "KCACHE_S3_MAX_ATTEMPTS", "6"),
    ("s3-connect-timeout", "KCACHE_S3_CONNECT_TIMEOUT", "5"),
    ("s3-read-timeout", "KCACHE_S3_READ_TIMEOUT", "60"),
    ("index-read-timeout", "KCACHE_INDEX_READ_TIMEOUT", "150"),
    ("facts-file", "KCACHE_FACTS_FILE", None),
    ("run-as", "KCACHE_RUN_AS", None),
    ("restore-timeout", "KCACHE_RESTORE_TIMEOUT", "300"),
    ("signing-key", "KCACHE_SIGNING_KEY", None),
    ("trusted-keys", "KCACHE_TRUSTED_KEYS", None),
    ("require-signature", "KCACHE_REQUIRE_SIGNATURE", "off"),
    ("ref-ttl", "KCACHE_REF_TTL", "1d"),
    ("node-cache", "KCACHE_NODE_CACHE", None),
    ("node-cache-max-bytes", "KCACHE_NODE_CACHE_MAX_BYTES", "32Gi"),
    ("warmup-profiles", "KCACHE_WARMUP_PROFILES", None),
    ("warmup-on-failure", "KCACHE_WARMUP_ON_FAILURE", "unready"),
    ("proxy-upstream", "KCACHE_PROXY_UPSTREAM", None),
    ("proxy-redis", "KCACHE_PROXY_REDIS", None),
    ("proxy-entry-key-file", "KCACHE_PROXY_ENTRY_KEY_FILE", None),
    ("proxy-tenant-headers", "KCACHE_PROXY_TENANT_HEADERS", None),
    ("megacache", "KCACHE_MEGACACHE", None),
    ("commit", "KCACHE_COMMIT", None),
    ("debug", "KCACHE_DEBUG", "off"),
)


@click.command("config")
@store_options(index_none=True)
@click.option("--model", metavar="ID", envvar="KCACHE_MODEL", help="Model identity restore and publish would use.")
@click.option("--root", type=NonEmptyPath(file_okay=False, path_type=Path), envvar="KCACHE_ROOT",
            help="Restore root that ready, serve, watch and warmup would use.")  # fmt: skip
@json_option
def config_cmd(store_url, index_url, s3_endpoint_url, model, root, as_json):
    """Show every setting in effect (README's table) and where each came from: flag, environment or default.

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
    for name, env, default in ENVIRONMENT_ONLY:
        given = os.environ.get(env, "").strip()
        rows[name] = (redact_text(given), f"env {env}") if given else (default, DEFAULT)
    if as_json:
        click.echo(fmt.to_json({name: {"value": value, "origin": where} for name, (value, where) in rows.items()}))
        return
    table = [(name, "-" if value is None else value, where) for name, (value, where) in rows.items()]
    click.echo(fmt.table(["setting", "value", "from"], table))
