"""Usage errors of `kcache restore` start the pod cold too (issue 9.1).

click turns a typo in --jobs or --fallback, an unknown option, or an environment value of the
wrong type into exit 2 before the command runs, and an init container that exits 2 crash-loops.
`RestoreCommand` catches its own usage errors: when --into can be read from the raw arguments it
runs restore's failure path there (kcache.env and an error marker, under ROOT's lock), prints one
line and exits 0, or, with --strict among the arguments, exits with click's usage error. A ROOT
that cannot be written gets nothing but still exits 0, as restore does; without --into the usage
error stands.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from kcache.errors import ConfigError, KcacheError
from kcache.restore import restore_opening

# Seconds the failure path may wait for another restore holding ROOT's lock, at most (see _lock_wait).
_LOCK_WAIT = 30.0


class RestoreCommand(click.Command):
    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        raw = list(args)  # click's parser consumes the list it is given
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            root, strict = into(raw), "--strict" in _options(raw)
            if root is None:
                raise
            _fail_open(root, exc, raw, strict)
            if strict:
                raise
            raise click.exceptions.Exit(0) from None


def into(args: list[str]) -> Path | None:
    """The last --into value in raw arguments (click keeps the last one too), or None."""
    found = _last(args, "--into")
    return Path(found) if found else None


def _last(args: list[str], flag: str) -> str | None:
    """The last value of `flag` (as `flag VALUE` or `flag=VALUE`) in raw arguments, or None."""
    found = None
    options = _options(args)
    for i, arg in enumerate(options):
        if arg == flag and i + 1 < len(options):
            found = options[i + 1]
        elif arg.startswith(flag + "="):
            found = arg.split("=", 1)[1]
    return found


def _options(args: list[str]) -> list[str]:
    return args[: args.index("--")] if "--" in args else args


def _lock_wait(raw: list[str]) -> float:
    """How long the failure path may wait for ROOT's lock: the restore's own budget (the last
    --timeout, else KCACHE_RESTORE_TIMEOUT) when it can be read and is shorter than _LOCK_WAIT."""
    from kcache.cli.restore_cmd import _parse_timeout

    text = _last(raw, "--timeout") or os.environ.get("KCACHE_RESTORE_TIMEOUT")
    if text is None:
        return _LOCK_WAIT
    seconds, bad = _parse_timeout(text)
    return _LOCK_WAIT if bad else min(seconds, _LOCK_WAIT)


def _fail_open(root: Path, usage: click.UsageError, raw: list[str], strict: bool) -> None:
    """Write restore's error marker and kcache.env into `root`, and unless `strict` (click reports
    then) print the usage error as restore prints any failure. A ROOT that cannot be written gets
    nothing, as on restore's own failure path, and the pod still starts cold."""
    from kcache.cli.restore_cmd import _report_error

    started = time.perf_counter()
    error = ConfigError("the arguments of", "kcache restore", usage.format_message())

    def open_inputs():
        raise error

    try:
        restore_opening(open_inputs, root, timeout=_lock_wait(raw))
    except KcacheError:  # ours; or ROOT unusable (RootError) or held by a restore that writes its own marker
        pass
    if not strict:
        _report_error(error, False, "--json" in _options(raw), time.perf_counter() - started, root.absolute())
