"""Options shared by several commands, and the error boundary every command runs inside."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import click

from kcache import config, fingerprint
from kcache.cli.errors import describe
from kcache.errors import KcacheError


def fingerprint_options(fn):
    """--model, --model-config, --fact, --extra: what describes the workload and overrides facts."""
    options = (
        click.option("--model", metavar="ID", envvar="KCACHE_MODEL",
                     help="Model identity, e.g. meta-llama/Llama-3.1-8B@rev (env KCACHE_MODEL)."),
        click.option("--model-config", type=click.Path(dir_okay=False, path_type=Path),
                     help="The model's config.json; its content becomes part of the workload key."),
        click.option("--facts-file", type=click.Path(dir_okay=False, path_type=Path), expose_value=False,
                     callback=_remember_facts_file, envvar="KCACHE_FACTS_FILE",
                     help="Facts of the machine that runs the model (`kcache fingerprint --json` there); "
                          "nothing is probed (env KCACHE_FACTS_FILE)."),
        click.option("--fact", "facts", multiple=True, metavar="NAME=VALUE",
                     help="Override a probed fact (e.g. --fact gpu.sm=sm_90), to describe another machine."),
        click.option("--extra", "extras", multiple=True, metavar="K=V",
                     help="A workload fact of your own (e.g. --extra tp=2); becomes extra.K."),
    )  # fmt: skip
    return _apply(fn, options)


def _remember_facts_file(ctx: click.Context, _param, value):
    # Not a parameter of each command: every command that fingerprints gets it through the context.
    ctx.meta["kcache.facts_file"] = value
    return value


def _apply(fn, options):
    for option in reversed(options):  # decorators apply bottom-up; keep --help in reading order
        fn = option(fn)
    return fn


def store_options(fn):
    options = (
        click.option("--store", "store_url", metavar="URL",
                     help="file:///path or s3://bucket/prefix (env KCACHE_STORE; default $KCACHE_HOME/store)."),
        click.option("--index", "index_url", metavar="URL",
                     help="SQLAlchemy URL of the index, or 'none' (env KCACHE_INDEX; default $KCACHE_HOME/index.db)."),
        click.option("--s3-endpoint-url", metavar="URL", help="S3-compatible endpoint (env AWS_ENDPOINT_URL)."),
    )  # fmt: skip
    return _apply(fn, options)


def load_signing_key(path):
    """The private key to sign with, or None when signing is off."""
    if not path:
        return None
    from kcache.signing import load_signing_key as load

    return load(path)


def load_trusted_keys(paths) -> tuple:
    """Public keys from --trusted-key flags, else KCACHE_TRUSTED_KEYS (':'-separated paths)."""
    if not paths:
        paths = [p for p in os.environ.get("KCACHE_TRUSTED_KEYS", "").split(":") if p]
    if not paths:
        return ()
    from kcache.signing import load_trusted_keys as load

    return load(paths)


def json_option(fn):
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object for scripts.")(fn)


def compute_fingerprint(model, model_config, facts, extras) -> fingerprint.Fingerprint:
    facts_file = click.get_current_context().meta.get("kcache.facts_file")
    return fingerprint.collect(
        model=model,
        model_config=model_config,
        extra=fingerprint.parse_assignments(extras, "--extra"),
        overrides=fingerprint.parse_assignments(facts, "--fact"),
        facts_file=facts_file,
    )


def open_index(url: str):
    """The SQL index. Imported here, not at the top: SQLAlchemy costs ~0.3 s that
    `kcache fingerprint` and a refs-only restore never need to pay."""
    from kcache.index import Index

    return Index.open(url)


def settings(store_url, index_url, s3_endpoint_url) -> config.Settings:
    return config.resolve(store_url, index_url, s3_endpoint_url)


def fail(exc: BaseException) -> click.exceptions.Exit:
    """Print a one-line error and hint; return the Exit to raise with the table's code."""
    message, hint, code = describe(exc)
    click.echo(f"kcache: error: {message}", err=True)
    click.echo(f"  hint: {hint}", err=True)
    return click.exceptions.Exit(code)


def handle_errors(fn):
    """Map KcacheError to a one-line message and exit code; tracebacks only with KCACHE_DEBUG=1."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except KcacheError as exc:
            if os.environ.get("KCACHE_DEBUG") == "1":
                raise
            raise fail(exc) from None

    return wrapper


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()
