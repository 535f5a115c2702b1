"""`kcache watch`: count (and publish) cache files compiled after the pod became ready."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import click

from kcache import binding
from kcache.cli import format as fmt
from kcache.cli.errors import ExitCode
from kcache.cli.options import (
    Duration,
    command_line_workload,
    compute_fingerprint,
    fingerprint_options,
    health_url_option,
    json_option,
    open_configured_store,
    settings,
    store_options,
)
from kcache.cli.publish_cmd import publish_config, signing_key_option
from kcache.cli.ready_cmd import root_option
from kcache.cli.serve_cmd import host_port_options, stop_on_signals, url_of
from kcache.config import Settings, redact_text
from kcache.publish import PublishConfig, publish, workload_of
from kcache.serve import make_server, start_in_thread
from kcache.watch import Publisher, Step, Watcher


def _publisher(root: Path, fingerprint_args, cfg: Settings, config: PublishConfig) -> Publisher:
    """Publishes ROOT's layers as a bundle for this pod's fingerprint; the index is opened per publish.

    Without a model the workload comes from ROOT's restore record, read at each publish: the
    sidecar may start before the restore has written it.
    """
    fp = compute_fingerprint(*fingerprint_args)
    given = command_line_workload(*fingerprint_args[2:])
    store = open_configured_store(cfg, publisher=True)

    def publish_delta(layers):
        index = binding.open_index(cfg, store, write=True)
        try:
            # Other replicas' publishes of the key since this pod's restore hold kernels it never
            # compiled: carried, not dropped (the newest bundle holds what every replica added).
            return publish(store, index, workload_of(fp, root, given), layers, root=root,
                           config=replace(config, carry_newest=True))  # fmt: skip
        finally:
            index.close()

    return publish_delta


@click.command("watch")
@root_option
@click.option("--interval", type=Duration(), default="30s", show_default=True, metavar="DURATION",
              help="How often to scan the cache directories.")  # fmt: skip
@click.option("--publish-every", type=Duration(), metavar="DURATION",
              help="Publish new cache files at most this often (e.g. 10m); uploads only new blobs.")  # fmt: skip
@click.option("--once", is_flag=True, help="Scan once (taking the baseline if the pod just became ready) and exit.")
@click.option("--stop-timeout", type=Duration(), default="20s", show_default=True, metavar="DURATION",
              help="On SIGTERM, how long the scan or publish under way and the last publish may take before "
                   "they are abandoned and watch exits; keep it under terminationGracePeriodSeconds.")  # fmt: skip
@host_port_options(port_help="Also serve /healthz, /readyz and /metrics on this port (as `kcache serve`).",
                   port_required=False)  # fmt: skip
@health_url_option(help="With --port: /readyz and /metrics also require the model server's health endpoint to "
                   "answer 2xx (e.g. http://127.0.0.1:8000/health). The watcher's own wait for readiness "
                   "reads the markers only.")  # fmt: skip
@signing_key_option
@fingerprint_options
@store_options
@json_option
def watch_cmd(root, interval, publish_every, once, stop_timeout, host, port, health_url, signing_key, model,
              model_config, facts, extras, store_url, index_url, s3_endpoint_url, as_json):  # fmt: skip
    """Notice cache files that appear after the pod became ready: shapes warmup did not cover.

    Waits for readiness (as `kcache ready`), records the cache files present then, and on each
    scan logs every new file with its layer and counts them in ROOT/.kcache-watch.json, which
    /metrics exposes. With --publish-every, publishes the delta (the store keeps only new blobs)
    under the same fingerprint flags as `kcache restore`, and once more on SIGTERM. --health-url
    applies to the --port server only (its /readyz and /metrics, as `kcache serve`).

    \b
    Examples:
      kcache watch --root /kcache --publish-every 10m --model my-llm --port 9400 --host 0.0.0.0
      kcache watch --root /kcache --once --json
    """
    publisher, watching = None, []
    if publish_every is not None:
        cfg = settings(store_url, index_url, s3_endpoint_url)
        # Every publish, not only the last, stops waiting for a lease within --stop-timeout of a stop.
        config = replace(publish_config(cfg, signing_key=signing_key),
                         lease_deadline=lambda: watching[0].lease_deadline() if watching else None)  # fmt: skip
        publisher = _publisher(root, (model, model_config, facts, extras), cfg, config)
    watcher = Watcher(root, publisher=publisher, publish_every=publish_every)
    watching.append(watcher)
    if once:
        _report(watcher.step(publish_now=True), as_json)
        return
    server = make_server(root, host, port, engine=health_url) if port is not None else None
    stop = stop_on_signals()
    if server is not None:
        start_in_thread(server, stopped=stop)  # a probe port that dies ends the sidecar, not just the thread
    _announce(root, interval, publish_every if publisher else None, server, host, as_json)
    try:
        finished = watcher.run(stop, interval, grace=stop_timeout)
    finally:
        if server is not None:
            server.shutdown()
            server.server_close()
    if server is not None:
        server.raise_if_failed()
    if not finished:
        message = (f"the last publish did not finish within {fmt.seconds(stop_timeout)} (--stop-timeout); "
                   "abandoned (a publish cut short leaves no partial bundle)")  # fmt: skip
        if as_json:  # the error object every other failure prints
            click.echo(fmt.to_json({"status": "error", "error": message, "hint": _ABANDONED_HINT,
                                    "exit_code": int(ExitCode.PUBLISH)}))  # fmt: skip
        click.echo(f"kcache: {message}", err=True)
        # A publish still waiting on the store holds worker threads that Python's exit would join.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(ExitCode.PUBLISH)
    if watcher.final_error:  # what the pod compiled after ready is lost for the pool: say so in the exit code
        raise _publish_failed(watcher.final_error, as_json)


_ABANDONED_HINT = "check that the store answers, or raise --stop-timeout (under the pod's grace period)"


def _publish_failed(error: str, as_json: bool, doc: dict | None = None) -> click.exceptions.Exit:
    """Exit 14, as the error object of --json (with `doc`'s fields where a report is printed anyway)."""
    message = f"publish failed: {redact_text(error)}"
    hint = "the files stay under ROOT: the next publish (this pod's, or the next pod's) retries; check the store"
    if as_json:
        click.echo(fmt.to_json({**(doc or {}), "status": "error", "error": message, "hint": hint,
                                "exit_code": int(ExitCode.PUBLISH)}))  # fmt: skip
    click.echo(f"kcache: {fmt.text(message)}", err=True)
    click.echo(f"  hint: {hint}", err=True)
    return click.exceptions.Exit(ExitCode.PUBLISH)


def _announce(root: Path, interval: float, publish_every: float | None, server, host: str, as_json: bool) -> None:
    """The start lines (the first names the port when there is one), or one JSON object."""
    url = url_of(host, server.port) if server is not None else None
    if as_json:
        click.echo(fmt.to_json({"status": "watching", "root": str(root), "interval": interval,
                                "publish_every": publish_every, "url": url, "host": host if server else None,
                                "port": server.port if server else None}))  # fmt: skip
        return
    if url is not None:
        click.echo(f"kcache: serving /healthz /readyz /metrics on {url} for {root}")
    click.echo(f"kcache: watching {root} every {fmt.seconds(interval)}"
               + (f", publishing every {fmt.seconds(publish_every)}" if publish_every else ""))  # fmt: skip


def _report(step: Step, as_json: bool) -> None:
    doc = {
        "ready": step.ready, "reason": step.reason,
        "new_files": [{"layer": f.layer, "path": f.rel, "size": f.size} for f in step.new],
        "published": step.published.bundle_id if step.published else None,
        "publish_error": step.publish_error or None,
    }  # fmt: skip
    if step.publish_error:
        if not as_json:
            _print_step(step)
        raise _publish_failed(step.publish_error, as_json, doc)
    if as_json:
        click.echo(fmt.to_json(doc))
    else:
        _print_step(step)


def _print_step(step: Step) -> None:
    if not step.ready:
        click.echo(f"kcache: not ready yet ({fmt.text(step.reason)}); nothing to watch")
        return
    click.echo(f"kcache: {len(step.new)} cache files appeared after ready")
    for f in step.new:
        click.echo(f"  {f.layer}  {fmt.text(f.rel)}  {fmt.size(f.size)}")
    if step.published:
        click.echo(f"kcache: published bundle {step.published.bundle_id[:12]} "
                   f"({step.published.new_blobs} new blobs)")  # fmt: skip
