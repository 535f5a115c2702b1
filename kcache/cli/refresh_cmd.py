"""`kcache refresh`: re-sign refs/ from the index, so pods that require signatures keep following them."""

from __future__ import annotations

import click

from kcache import durations, fingerprint
from kcache.cli import format as fmt
from kcache.cli.errors import describe
from kcache.cli.options import NonEmptyPath, json_option, load_signing_key, opened, settings, store_options
from kcache.errors import ConfigError, KcacheError, NotFound


@click.command("refresh")
@click.argument("bundle_keys", nargs=-1, metavar="[BUNDLE_KEY]...")
@click.option("--model", metavar="ID", help="Only the bundle keys of this model's bundles (not with BUNDLE_KEY).")
@click.option("--signing-key", type=NonEmptyPath(dir_okay=False), envvar="KCACHE_SIGNING_KEY", required=True,
              help="The key from `kcache keygen` that pods trust.")  # fmt: skip
@click.option("--ttl", metavar="DURATION", envvar="KCACHE_REF_TTL",
              help="How long re-signed refs stay valid, e.g. 12h or 7d (default 1d).")  # fmt: skip
@store_options
@json_option
def refresh_cmd(bundle_keys, model, signing_key, ttl, store_url, index_url, s3_endpoint_url, as_json):
    """Rewrite and re-sign refs/<bundle-key> from the index: newest active bundle, yanks, a new expiry.

    A pod restoring through refs with --require-signature refuses a ref past its expiry, which is
    what stops a replayed old ref. Run this more often than the TTL (a CronJob), and after
    repairing the index; signed publishes refresh a ref only once it is past half its lifetime.
    Without BUNDLE_KEY (or --model), every bundle key in the index is refreshed; a BUNDLE_KEY the
    index has never seen is an error (exit 3), not a ref removed, and so is a --model it has no bundle of.
    A key that cannot be refreshed (a damaged row) is named and the others are still re-signed; the
    command then exits with that error's code.

    \b
    Examples:
      kcache refresh --signing-key /secrets/prod-2026.key
      kcache refresh --model my-llm --ttl 1d
    """
    from kcache import refs

    keys = _bundle_keys(bundle_keys, model)
    key = load_signing_key(signing_key)
    from_env = click.get_current_context().get_parameter_source("ttl") == click.core.ParameterSource.ENVIRONMENT
    lifetime = durations.parse(ttl, "KCACHE_REF_TTL" if from_env else "--ttl", positive=True) if ttl else None
    # Through opened(): refs are signed from the index, so it must be the index of this very store.
    with opened(settings(store_url, index_url, s3_endpoint_url)) as (store, index):
        unknown = [k for k in keys if not index.knows_key(k)]
        if unknown:  # refreshing it would remove a ref that someone else's index may have written
            raise NotFound("bundle key in the index", unknown[0])
        failed: dict[str, KcacheError] = {}  # one key that fails must not leave the others to expire
        done = refs.refresh_all(store, index, bundle_keys=keys, model=model, signer=key, ttl=lifetime, failed=failed)
    if model is not None and not done and not failed:  # a typo in a CronJob would re-sign nothing, daily
        raise NotFound("model in the index", model)
    rows = [{"bundle_key": k, "bundle_id": r.manifest if r else None, "generation": r.generation if r else None,
             "expires": r.expires.isoformat() if r and r.expires else None} for k, r in done.items()]  # fmt: skip
    errors = [{"bundle_key": k, "error": describe(exc)[0]} for k, exc in failed.items()]
    first = next(iter(failed.values()), None)
    if as_json:
        message, hint, code = describe(first) if first is not None else ("", "", 0)
        error = {"error": f"{len(failed)} refs not refreshed, e.g. {next(iter(failed))}: {message}", "hint": hint,
                 "exit_code": int(code)} if first is not None else {}  # fmt: skip
        click.echo(fmt.to_json({"status": "error" if first is not None else "ok", **error, "refs": rows,
                                "failed": errors}))  # fmt: skip
    else:
        click.echo(f"kcache: re-signed {sum(1 for r in done.values() if r)} refs with key {key.name!r}")
        for row in rows:
            what = "removed (no active bundle)"
            if row["bundle_id"]:  # a key whose every bundle is yanked has no ref left, so no id to show
                what = f"-> {row['bundle_id'][:12]}, generation {row['generation']}, expires {row['expires']}"
            click.echo(f"  {fmt.text(row['bundle_key'])} {what}")
        for row in errors:
            click.echo(f"  {fmt.text(row['bundle_key'])} not refreshed: {fmt.text(row['error'])}", err=True)
    if first is not None:  # after every other key: exit with the first failure's code (stderr says it)
        if as_json:
            raise click.exceptions.Exit(describe(first)[2])
        raise first


def _bundle_keys(given: tuple[str, ...], model: str | None) -> tuple[str, ...]:
    """The keys named, lower-cased (hex in either case is the same key), each checked to be one."""
    if given and model is not None:
        raise ConfigError("--model", model, "selects bundle keys itself; give either BUNDLE_KEY or --model")
    keys = tuple(dict.fromkeys(k.lower() for k in given))
    for k in keys:
        if not fingerprint.is_bundle_key(k):
            raise ConfigError("BUNDLE_KEY", k, "is not a bundle key: 32 hex digits, as `kcache fingerprint` prints")
    return keys
