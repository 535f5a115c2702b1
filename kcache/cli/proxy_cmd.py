"""`kcache proxy`: the caching reverse proxy in front of the model server, until SIGTERM."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import click

from kcache.cli import format as fmt
from kcache.cli.options import (
    Duration,
    NonEmptyPath,
    Wait,
    compute_fingerprint,
    fingerprint_options,
    json_option,
)
from kcache.cli.serve_cmd import host_port_options, url_of
from kcache.config import redact_url
from kcache.errors import ConfigError

MAX_ENTRY_BYTES = 512 * 1024 * 1024  # the largest string Redis stores
MAX_REQUEST_BYTES = 64 << 20  # parsing one costs ~2 GiB and seconds in which no other client is served
MAX_PREFIX_ENTRIES = 10_000_000  # about a GiB of remembered prefix hashes
METRICS_PORT = 9401  # next to the kcache watch/serve sidecar's 9400 in the same pod


@click.command("proxy")
@click.option(
    "--upstream",
    required=True,
    metavar="URL",
    envvar="KCACHE_PROXY_UPSTREAM",
    help="The engine's OpenAI-compatible server, e.g. http://127.0.0.1:8000.",
)
@click.option(
    "--redis",
    "redis_url",
    required=True,
    metavar="URL",
    envvar="KCACHE_PROXY_REDIS",
    help="redis://[:password@]host:6379/db.",
)
@click.option(
    "--entry-key-file",
    type=NonEmptyPath(dir_okay=False, path_type=Path),
    envvar="KCACHE_PROXY_ENTRY_KEY_FILE",
    help="A file holding the secret (at least 32 bytes, e.g. `openssl rand -hex 32`; a Kubernetes Secret mounted "
    "as a file) that authenticates each answer in Redis: whoever can write Redis cannot forge one. Every replica "
    "that shares the cache needs the same. Without it, a random key of this process's own: its answers serve "
    "only itself.",
)
@click.option(
    "--root",
    type=NonEmptyPath(file_okay=False, path_type=Path),
    envvar="KCACHE_ROOT",
    help="The restore root: its .kcache-state.json names the fingerprint (when it names none, the proxy "
    "serves with its cache off). Without it, the fingerprint flags below compute it as `kcache restore` does.",
)
@fingerprint_options
@host_port_options(
    port_help="TCP port to listen on for clients (0 picks a free one; the line printed at start names it).",
    port_required=True,
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=METRICS_PORT,
    show_default=True,
    help="TCP port of GET /metrics, on --host too, apart from the clients' port: the counters tell whether a "
    "prompt was seen before, which no client may learn of another's. Route only --port to clients.",
)
@click.option(
    "--shutdown-timeout",
    type=Duration(),
    default="20s",
    show_default=True,
    metavar="DURATION",
    help="On SIGTERM, how long requests in flight may take to finish before they are cut off and the proxy "
    "exits; keep it under the pod's terminationGracePeriodSeconds.",
)
@click.option(
    "--ttl",
    type=Duration(),
    default="1h",
    show_default=True,
    metavar="DURATION",
    help="How long an answer stays in Redis (Redis's maxmemory policy may evict it sooner).",
)
@click.option(
    "--max-entry-bytes",
    type=click.IntRange(1, MAX_ENTRY_BYTES),
    default=1 << 20,
    show_default=True,
    help="Answers larger than this are forwarded but not cached.",
)
@click.option(
    "--max-request-bytes",
    type=click.IntRange(1, MAX_REQUEST_BYTES),
    default=4 << 20,
    show_default=True,
    help="Request bodies larger than this are streamed to the engine uncached, never parsed: parsing one takes "
    "up to ~30 times its size in memory, and holds up every other client meanwhile.",
)
@click.option(
    "--redis-timeout",
    type=Duration(at_least=0.001),
    default="250ms",
    show_default=True,
    metavar="DURATION",
    help="The most a request waits on Redis before it is forwarded uncached (event-loop queueing counts).",
)
@click.option(
    "--redis-retry-after",
    type=Wait(),
    default="2s",
    show_default=True,
    metavar="DURATION",
    help="After a Redis failure, skip Redis this long (a dead Redis then costs one timeout, not one each).",
)
@click.option(
    "--redis-connections",
    type=click.IntRange(1, 10_000),
    default=64,
    show_default=True,
    help="The most connections to Redis at once; a request that finds none free within --redis-timeout is "
    "forwarded uncached (counted as Redis error kind 'busy').",
)
@click.option("--key-prefix", default="kcache:proxy:", show_default=True, help="Prefix of every Redis key.")
@click.option("--no-cache", is_flag=True, help="Forward every request uncached (counted as bypass reason 'disabled').")
@click.option(
    "--cache-sampled",
    is_flag=True,
    help="Also cache requests that sample (temperature > 0 without a seed, n > 1): all get one answer.",
)
@click.option(
    "--prefix-entries",
    type=click.IntRange(1, MAX_PREFIX_ENTRIES),
    default=100_000,
    show_default=True,
    help="Prompt prefixes remembered for the prefix-reuse measurement.",
)
@click.option(
    "--tenant-header",
    "tenant_headers",
    multiple=True,
    metavar="NAME",
    envvar="KCACHE_PROXY_TENANT_HEADERS",
    help="One more request header whose value names the tenant, e.g. a gateway's X-Goog-Api-Key (Authorization, "
    "X-Api-Key, Api-Key and Cookie always do; a request with one of them twice is not cached). "
    "Repeatable (env: space-separated).",
)
@json_option
def proxy_cmd(upstream, redis_url, entry_key_file, root, model, model_config, facts, extras, host, port,
              metrics_port, shutdown_timeout, ttl, max_entry_bytes, max_request_bytes, redis_timeout,
              redis_retry_after, redis_connections, key_prefix, no_cache, cache_sampled, prefix_entries,
              tenant_headers, as_json):  # fmt: skip
    """Answer repeated OpenAI-compatible requests from Redis, keyed by what the pod runs.

    POST /v1/completions and /v1/chat/completions are looked up by (fingerprint, tenant = hash of
    the credential headers: Authorization, X-Api-Key, Api-Key, Cookie and each --tenant-header, path,
    request body without non-semantic fields); by default only
    deterministic requests are cached: n = 1 and temperature 0 or an integer seed (not -1). Everything else
    is forwarded untouched. `stream: true` answers are recorded while they stream and replayed as
    the same events. Redis down or slow: requests go to the engine, counted on /metrics. A request
    with `X-Kcache-Bypass: 1` or `Cache-Control: no-cache` skips the cache. GET /metrics on
    --metrics-port (not the clients' port): hits, misses, bypasses by reason, bytes, added
    latency, prefix reuse. Each answer in Redis is
    authenticated under --entry-key-file's secret (and the tenant's credential). See docs/proxy.md.

    \b
    Examples:
      kcache proxy --root /kcache --upstream http://127.0.0.1:8000 \\
          --redis redis://redis:6379/0 --entry-key-file /etc/kcache-proxy/entry-key \\
          --port 8080 --host 0.0.0.0 --ttl 6h
      curl -s localhost:8080/v1/chat/completions -H 'Content-Type: application/json' \\
          -d '{"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}'
      curl -s localhost:9401/metrics | grep kcache_proxy_requests_total
    """
    from kcache.proxy import entry, key
    from kcache.proxy.server import ProxyConfig, serve

    _check_upstream(upstream)
    for name in tenant_headers:
        if not key.is_header_name(name):
            raise ConfigError("--tenant-header", name, "not an HTTP header name (no space, no colon)")
    if root is not None and (model or model_config or facts or extras):
        raise ConfigError("--root", str(root), "give either --root or the fingerprint flags, not both")
    if root is not None:
        fingerprint = _fingerprint_or_none(root)
    else:
        fingerprint = compute_fingerprint(model, model_config, facts, extras).bundle_key
    secret = entry.read_secret(entry_key_file) if entry_key_file is not None else None
    config = ProxyConfig(upstream=upstream, redis_url=redis_url, fingerprint=fingerprint, ttl=ttl,
                         max_entry_bytes=max_entry_bytes, max_request_bytes=max_request_bytes,
                         redis_timeout=redis_timeout, retry_after=redis_retry_after, key_prefix=key_prefix,
                         redis_connections=redis_connections,
                         enabled=not no_cache, cache_sampled=cache_sampled, prefix_entries=prefix_entries,
                         tenant_headers=tenant_headers, entry_secret=secret,
                         shutdown_timeout=shutdown_timeout)  # fmt: skip
    if secret is None:
        click.echo("kcache: warning: no --entry-key-file: answers in Redis are authenticated with a random key of "
                   "this process's own, so only this process reads them back", err=True)  # fmt: skip

    def ready(bound: int, metrics_bound: int) -> None:
        url, metrics_url = url_of(host, bound), url_of(host, metrics_bound) + "/metrics"
        if as_json:  # the start line, for scripts that need the port
            click.echo(fmt.to_json({"status": "serving", "url": url, "host": host, "port": bound,
                                    "metrics_url": metrics_url,
                                    "upstream": redact_url(upstream), "redis": redact_url(redis_url),
                                    "fingerprint": fingerprint}))  # fmt: skip
            return
        click.echo(f"kcache: proxy on {url} -> {redact_url(upstream)}, cache {redact_url(redis_url)}, "
                   f"fingerprint {fingerprint or 'unknown (caching off)'}, metrics on {metrics_url}")  # fmt: skip

    asyncio.run(_until_signal(config, host, port, metrics_port, ready, serve))


def _fingerprint_or_none(root: Path) -> str | None:
    """The restore root's fingerprint, or None with a warning: a restore that failed before computing it
    (or a marker missing or unreadable) must not keep the pod from serving, so the proxy then forwards
    every request uncached (bypass reason no_fingerprint) instead of exiting into a crash loop."""
    from kcache.proxy import key

    try:
        return key.fingerprint_from_root(root)
    except ConfigError as exc:
        click.echo(f"kcache: warning: {exc}; caching is off, every request is forwarded (bypass reason "
                   "no_fingerprint)", err=True)  # fmt: skip
        return None


def _check_upstream(upstream: str) -> None:
    """An http(s) URL with a host and a valid port: anything else would fail every request later."""
    from kcache.http_client import split_url

    try:
        split_url(upstream)
    except ConfigError as exc:
        raise ConfigError("--upstream", redact_url(upstream), exc.why) from None


async def _until_signal(config, host, port, metrics_port, ready, serve) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # the kubelet stopping the pod
        loop.add_signal_handler(sig, stop.set)
    await serve(config, host, port, metrics_port, ready, stop)
