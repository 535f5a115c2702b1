"""`kcache ready`: the exec readiness probe. Reads two small markers; imports nothing heavy."""

from __future__ import annotations

import click

from kcache import metrics, readiness
from kcache.cli import format as fmt
from kcache.cli.errors import ExitCode
from kcache.cli.options import health_url_option, json_option, root_option

__all__ = ["ready_cmd", "root_option"]  # watch and serve import root_option from here


@click.command("ready")
@root_option
@health_url_option
@json_option
def ready_cmd(root, health_url, as_json):
    """Exit 0 when the pod may take traffic, else 11 (not ready) with one line saying why.

    Ready means four signals hold: restore has finished (hit, miss or error: a cold pod must
    still serve), the weights loaded (the server answered warmup's health check), the compiled
    graphs are done (every profile's first run returned) and `kcache warmup` completed with
    status ok. A warmup run with --on-failure ready-cold is ready (cold) once the weights loaded.
    With --health-url, the model server's health endpoint must also answer 2xx (signal "engine").
    --json reports each signal apart. Fast enough for an exec readiness probe.

    \b
    Examples:
      kcache ready --root /kcache
      KCACHE_ROOT=/kcache kcache ready --json
    """
    state = readiness.check(root, health_url)
    restore = fmt.text((state.restore or {}).get("status"))  # a marker anyone in the pod may write
    signals = ", ".join(f"{s.name} {'yes' if s.ok else 'no'}" for s in state.signals)
    if as_json:
        failed = {} if state.ready else {"error": state.reason, "hint": _NOT_READY_HINT,
                                         "exit_code": int(ExitCode.NOT_READY)}  # fmt: skip
        click.echo(fmt.to_json({"status": "ready" if state.ready else "not_ready", **readiness.to_dict(state),
                                "root": str(root), **failed}))  # fmt: skip
    elif state.cold:
        click.echo(f"kcache: ready (cold): restore {restore}, warmup failed; serving without warmup ({signals})")
    elif state.ready:
        seconds = metrics.numeric(state.warmup or {}, "seconds")  # a marker anyone in the pod may write
        took = f" in {fmt.seconds(seconds)}" if seconds is not None else ""
        click.echo(f"kcache: ready: restore {restore}, warmup ok{took}")
    else:
        click.echo(f"kcache: not ready: {fmt.text(state.reason)} (root {root}; {signals})")
    if not state.ready:
        raise click.exceptions.Exit(ExitCode.NOT_READY)


_NOT_READY_HINT = "each signal says what is missing; the markers under --root are written by restore and warmup"
