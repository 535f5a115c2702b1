"""`kcache prefetch`: keep the packs of named models in a node cache (a DaemonSet, one per GPU node)."""

from __future__ import annotations

import time

import click

from kcache import choice, fingerprint
from kcache.allocator import reuse_freed_memory
from kcache.catalog import open_for_restore
from kcache.cli import format as fmt
from kcache.cli import progress_bars
from kcache.cli.errors import describe
from kcache.cli.options import (
    REQUIRE_SIGNATURE_ENV,
    Duration,
    Size,
    compute_fingerprint,
    env_flag,
    fingerprint_options,
    json_option,
    load_trusted_keys,
    node_cache_option,
    open_configured_store,
    require_signature_option,
    settings,
    store_options,
    trusted_key_option,
)
from kcache.cli.serve_cmd import stop_on_signals
from kcache.errors import ConfigError, KcacheError
from kcache.prefetch import Lookups, Prefetched, Target, bundle_key_target, prefetch
from kcache.store.nodecache import MAX_BYTES_ENV, NodeCacheStore


@click.command("prefetch")
@node_cache_option(required=True)
@click.option("--bundle-key", "bundle_keys", multiple=True, metavar="KEY",
              help="Prefetch the newest bundle of this key (`kcache fingerprint` prints it); repeatable.")  # fmt: skip
@click.option("--max-bytes", type=Size(), envvar=MAX_BYTES_ENV, metavar="SIZE",
              help="Cap on the node cache (e.g. 50Gi); least recently used packs go first. Default 32Gi. "
                   "Targets are fitted in their order: one that does not fit beside those before it is "
                   "reported over_cap and not fetched.")  # fmt: skip
@click.option("--once", is_flag=True,
              help="One round, then exit (non-zero if a target failed; 7 if one was over_cap).")  # fmt: skip
@click.option("--every", type=Duration(), default="10m", show_default=True, metavar="DURATION",
              help="Without --once: time between rounds, to follow new bundles.")  # fmt: skip
@click.option("--jobs", type=click.IntRange(1, 64), default=4, show_default=True, help="Packs fetched at once.")
@click.option("--lookup-timeout", type=Duration(), default="5m", show_default=True, metavar="DURATION",
              help="Longest a round waits to choose a target's bundle (index, ref, manifest); past it the target "
                   "fails this round, and its look-up is not started again while it still runs.")  # fmt: skip
@trusted_key_option("A .pub from `kcache keygen`; repeatable (env: ':'-separated).")  # fmt: skip
@require_signature_option("Prefetch only bundles signed by a trusted key (as restore takes them).")
@fingerprint_options(many_models=True)
@store_options(index_none=True)
@json_option
def prefetch_cmd(node_cache, bundle_keys, max_bytes, once, every, jobs, lookup_timeout, trusted_keys,
                 require_signature, model, model_config, facts, extras, store_url, index_url, s3_endpoint_url,
                 as_json):  # fmt: skip
    """Keep the packs of the newest bundle of each --model (or --bundle-key) in the node cache DIR.

    Run it as a DaemonSet on the GPU nodes with a hostPath DIR, and give `kcache restore` the same
    --node-cache: a pod starting on the node then reads its packs from local disk, and 8 pods
    starting at once fetch each pack from the store once between them. The fingerprint flags are
    restore's (--model repeats; --model-config needs a single --model), so prefetch picks the
    bundle restore will pick. Every round re-reads which bundle is newest, fetches only the packs
    the node lacks, verifies each against its SHA-256 id, and evicts least recently used packs
    over --max-bytes. A target whose packs do not fit under --max-bytes beside those of the
    targets before it is reported over_cap ("status": "over_cap" in --json, whose "status" is then
    "error") and not fetched; with --once, kcache exits 7.

    \b
    Examples:
      kcache prefetch --node-cache /var/cache/kcache --model meta-llama/Llama-3.1-8B-Instruct \\
        --extra tp=1 --facts-file /etc/kcache-facts/facts.json --max-bytes 50Gi --every 10m
      kcache prefetch --node-cache /tmp/kc --bundle-key 3f0c... --once --json
    """
    reuse_freed_memory()  # packs stream through MiB buffers: see kcache.allocator
    targets = _targets(model, model_config, facts, extras, bundle_keys)
    required, garbled = env_flag(REQUIRE_SIGNATURE_ENV)
    if garbled is not None:  # never "off" by accident
        raise garbled
    policy = choice.Policy(load_trusted_keys(trusted_keys), require_signature or required)
    if policy.required and not policy.trusted:
        raise ConfigError("--require-signature", "on", "needs at least one --trusted-key (or KCACHE_TRUSTED_KEYS)")
    cfg = settings(store_url, index_url, s3_endpoint_url)
    store = open_configured_store(cfg, jobs=jobs, before_publish=True)  # a DaemonSet may start before any publish
    cache = NodeCacheStore(store, node_cache, max_bytes=max_bytes)
    stop = None if once else stop_on_signals()
    lookups = Lookups()  # for the process's life: a look-up that outlives its round is not started again
    while True:
        started = time.perf_counter()
        try:
            with progress_bars.bars(progress_bars.wanted(as_json)) as report:  # drawn on a terminal only
                results = _round(cfg, store, cache, targets, policy, jobs, stop, report, lookup_timeout, lookups)
        except KcacheError as exc:
            if once:
                raise
            _report_failed_round(exc, as_json)  # a DaemonSet keeps going: the index may be back next round
        else:
            failed = next((r for r in results if r.error is not None), None)
            _report(results, cache, time.perf_counter() - started, as_json, failed, once)
            if once and failed is not None:
                raise click.exceptions.Exit(describe(failed.error)[2])
        if once or stop.wait(every):
            return


def _round(cfg, store, cache, targets, policy, jobs, stop, report=None, lookup_timeout=None,
           lookups=None) -> tuple[Prefetched, ...]:  # fmt: skip
    index = open_for_restore(cfg, store)  # per round: a long-lived DaemonSet must outlive an index restart
    try:
        return prefetch(store, index, cache, targets, policy, jobs=jobs, stop=stop, report=report,
                        lookup_timeout=lookup_timeout, lookups=lookups)  # fmt: skip
    finally:
        index.close()


def _report_failed_round(exc: KcacheError, as_json: bool) -> None:
    message, hint, _code = describe(exc)
    if as_json:
        click.echo(fmt.to_json({"status": "error", "error": message, "hint": hint, "targets": []}))
    click.echo(f"kcache: prefetch round failed, trying again later: {message}", err=True)
    click.echo(f"  hint: {hint}", err=True)


def _targets(models, model_config, facts, extras, bundle_keys) -> tuple[Target, ...]:
    if model_config is not None and len(models) > 1:
        raise ConfigError("--model-config", str(model_config), "describes one model; give a single --model with it")
    if not models and not bundle_keys and model_config is None:
        raise ConfigError("--model", "", "name at least one --model or --bundle-key to prefetch")
    for key in bundle_keys:
        if not fingerprint.is_bundle_key(key):
            raise ConfigError("--bundle-key", key, "is not a bundle key: 32 hex digits, as `kcache fingerprint` prints")
    names = list(models) or ([None] if model_config is not None else [])
    targets = []
    if names:  # the machine probed once (its warnings said once), every other model keyed from the first's facts
        first = compute_fingerprint(names[0], model_config, facts, extras)
        pinned = "model.id" in fingerprint.parse_assignments(facts, "--fact")  # one model.id for all, as given
        targets = [Target(names[0] or str(model_config), first)]
        targets += [Target(name, first if pinned else fingerprint.with_model(first, name)) for name in names[1:]]
    return tuple(targets) + tuple(bundle_key_target(key) for key in bundle_keys)


def _report(results: tuple[Prefetched, ...], cache: NodeCacheStore, seconds: float, as_json: bool,
            failed: Prefetched | None = None, once: bool = False) -> None:  # fmt: skip
    """The round's report. With --json, a round with a failed target is also the error object every
    command prints (error, hint; exit_code with --once, which exits with it), named by its first failure.
    A node cache that cannot be counted (a peer made DIR unsearchable) is said in the report: raised,
    it had ended the DaemonSet's loop, which goes on past a failed round."""
    try:
        usage, unusable = cache.usage(), None
    except KcacheError as exc:
        usage, unusable = None, describe(exc)[0]
    counted = {"packs": usage.packs, "bytes": usage.bytes} if usage else {"packs": None, "bytes": None,
                                                                            "error": unusable}  # fmt: skip
    if as_json:
        error = {}
        if failed is not None:
            message, hint, code = describe(failed.error)
            error = {"error": f"{failed.target}: {message}", "hint": hint, **({"exit_code": int(code)} if once else {})}
        click.echo(fmt.to_json({
            "status": "error" if failed is not None else "ok",
            **error,
            "seconds": round(seconds, 4),
            "targets": [{"target": r.target, "bundle_key": r.bundle_key, "status": r.status,
                         "bundle_id": r.bundle_id, "packs": r.packs, "fetched": r.fetched, "bytes": r.bytes,
                         "fetched_bytes": r.fetched_bytes, "reason": r.reason} for r in results],
            "node_cache": {"dir": str(cache.directory), **counted, "max_bytes": cache.max_bytes},
        }))  # fmt: skip
        return
    for r in results:
        if r.status == "stopped" and r.bundle_id is None:
            click.echo(f"kcache: {r.target}: {r.reason}")
        elif r.status in ("cached", "stopped"):
            click.echo(f"kcache: {r.target}: bundle {r.bundle_id[:12]}, {r.packs} packs ({fmt.size(r.bytes)}) "
                       f"cached, {r.fetched} fetched ({fmt.size(r.fetched_bytes)})"
                       + ("; stopped early" if r.status == "stopped" else ""))  # fmt: skip
        elif r.status == "miss":
            click.echo(f"kcache: {r.target}: nothing to prefetch: {r.reason}")
        elif r.status == "over_cap":
            click.echo(f"kcache: {r.target}: over the node cache's cap (--max-bytes): {r.reason}", err=True)
        else:
            click.echo(f"kcache: {r.target}: prefetch failed: {r.reason}", err=True)
    if usage is None:
        click.echo(f"kcache: node cache {cache.directory}: cannot be counted: {unusable}", err=True)
        return
    click.echo(f"kcache: node cache {cache.directory}: {usage.packs} packs, {fmt.size(usage.bytes)} of "
               f"{fmt.size(usage.max_bytes)} in {fmt.seconds(seconds)}")  # fmt: skip
