"""`kcache serve`: /healthz, /readyz and /metrics over HTTP, until SIGTERM."""

from __future__ import annotations

import os
import signal
import threading

import click

from kcache.cli import format as fmt
from kcache.cli.options import NonEmptyText, health_url_option, json_option, root_option
from kcache.serve import make_server, serve_until


def host_port_options(*, port_help: str, port_required: bool):
    def apply(fn):
        fn = click.option("--host", default="127.0.0.1", show_default=True, type=NonEmptyText(),
                          callback=_unbracketed,
                          help="Address to bind; 0.0.0.0, or :: for IPv4 and IPv6, lets the kubelet "
                               "reach it. An IPv6 address as a URL writes it ([::1]) is taken too.")(fn)  # fmt: skip
        return click.option("--port", type=click.IntRange(0, 65535), required=port_required, help=port_help)(fn)

    return apply


def _unbracketed(_ctx, _param, host: str) -> str:
    """[::1] as ::1: brackets only set an IPv6 address apart from a URL's port, and the resolver knows no
    name "[::1]"."""
    if host.startswith("[") and host.endswith("]") and ":" in host:
        return host[1:-1]
    return host


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM (the kubelet stopping the pod) and SIGINT set.

    Not set by the handler itself: it runs in the main thread, which inside `stop.wait()` holds the
    event's lock for a moment, and a handler that came then waited on that lock for ever (watch hung
    at SIGTERM). The handler writes a byte to a pipe; a thread of its own reads it and sets the event.
    """
    stop = threading.Event()
    readable, writable = os.pipe()

    def relay() -> None:
        try:
            os.read(readable, 1)
        finally:
            stop.set()

    threading.Thread(target=relay, name="kcache-signals", daemon=True).start()

    def handler(_signum, _frame) -> None:
        try:
            os.write(writable, b"\0")
        except OSError:  # the pipe is full: a byte is already on its way
            pass

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)
    return stop


def url_of(host: str, port: int) -> str:
    """http://HOST:PORT, an IPv6 address in brackets (http://[::]:9400)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def announce_serving(server, host: str, root, as_json: bool) -> None:
    """The line that names the port (0 picks one), as text or one JSON object."""
    url = url_of(host, server.port)
    if as_json:
        click.echo(fmt.to_json({"status": "serving", "url": url, "host": host, "port": server.port, "root": str(root)}))
    else:
        click.echo(f"kcache: serving /healthz /readyz /metrics on {url} for {root}")


@click.command("serve")
@root_option
@host_port_options(port_help="TCP port (0 picks a free one; the line printed at start names it).", port_required=True)
@health_url_option
@json_option
def serve_cmd(root, host, port, health_url, as_json):
    """Serve /healthz, /readyz (200 or 503, JSON reason) and /metrics (Prometheus) for ROOT.

    /readyz follows the same rule as `kcache ready` (--health-url included); /metrics exposes the
    restore outcome, warmup time and status, readiness, and compiles seen after ready
    (`kcache watch`). Stops cleanly on SIGTERM; exits non-zero if the server itself fails.

    \b
    Examples:
      kcache serve --root /kcache --port 9400 --host 0.0.0.0
      curl -s localhost:9400/metrics | grep kcache_
    """
    server = make_server(root, host, port, engine=health_url)
    stop = stop_on_signals()
    announce_serving(server, host, root, as_json)
    serve_until(server, stop)
