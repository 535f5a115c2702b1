"""The `kcache` command: click commands only. Each parses, calls the library, formats."""

from __future__ import annotations

import gc
import importlib
import logging
import os
from collections.abc import Iterator, MutableMapping

import click

from kcache import buildinfo
from kcache.cli import lingering
from kcache.cli.errors import epilog
from kcache.cli.options import KcacheGroup
from kcache.config import redact_text
from kcache.untrusted import OneLineFormatter


def _show_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(buildinfo.version_line())
        ctx.exit()


# name -> (module under kcache.cli, attribute). A command's module is imported when that command is
# looked up, not when `kcache` starts: `kcache restore` in an init container does not pay for the
# proxy's, the server's or warmup's imports (issue 11: restore <= 0.3 s with the CLI's start).
COMMANDS = {
    "fingerprint": ("fingerprint_cmd", "fingerprint_cmd"), "publish": ("publish_cmd", "publish_cmd"),
    "restore": ("restore_cmd", "restore_cmd"), "ls": ("bundles_cmd", "ls_cmd"), "show": ("bundles_cmd", "show_cmd"),
    "reindex": ("reindex_cmd", "reindex_cmd"), "keygen": ("keygen_cmd", "keygen_cmd"), "db": ("db_cmd", "db_group"),
    "ready": ("ready_cmd", "ready_cmd"), "serve": ("serve_cmd", "serve_cmd"), "watch": ("watch_cmd", "watch_cmd"),
    "warmup": ("warmup_cmd", "warmup_cmd"), "prebake": ("warmup_cmd", "prebake_cmd"),
    "explain": ("explain_cmd", "explain_cmd"), "stats": ("stats_cmd", "stats_cmd"), "yank": ("operate_cmd", "yank_cmd"),
    "verify": ("operate_cmd", "verify_cmd"), "gc": ("operate_cmd", "gc_cmd"), "config": ("config_cmd", "config_cmd"),
    "refresh": ("refresh_cmd", "refresh_cmd"), "proxy": ("proxy_cmd", "proxy_cmd"),
    "prefetch": ("prefetch_cmd", "prefetch_cmd"),
}  # fmt: skip


class LazyCommands(MutableMapping):
    """The group's commands: every name is known up front, each command is imported on first use."""

    def __init__(self, table: dict[str, tuple[str, str]]) -> None:
        self._table = dict(table)
        self._loaded: dict[str, click.Command] = {}

    def __getitem__(self, name: str) -> click.Command:
        if name not in self._loaded:
            module, attr = self._table[name]  # KeyError for an unknown name, as a dict would
            command = getattr(importlib.import_module(f"kcache.cli.{module}"), attr)
            _show_envvars(command)
            _take_verbose(command)
            self._loaded[name] = command
        return self._loaded[name]

    def __setitem__(self, name: str, command: click.Command) -> None:
        self._table.pop(name, None)
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        if self._table.pop(name, None) is None:
            del self._loaded[name]
        else:
            self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._table) | set(self._loaded)))

    def __len__(self) -> int:
        return len(set(self._table) | set(self._loaded))


@click.group(cls=KcacheGroup, epilog=epilog(), commands=LazyCommands(COMMANDS),
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})  # fmt: skip
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_show_version,
              help="Show the version and the commit it was built from, then exit.")  # fmt: skip
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-vv for debug).")
def main(verbose: int) -> None:
    """kcache: warm starts for GPU inference services.

    Publish compiled-kernel caches (Inductor, Triton, CUDA, vLLM) after warmup; restore the bundle
    that matches a pod's fingerprint before the model loads.

    Defaults: store file://$KCACHE_HOME/store, index sqlite:///$KCACHE_HOME/index.db,
    KCACHE_HOME=~/.cache/kcache; `kcache config` shows what is in effect and why. Errors print one
    line and a hint (a traceback only with KCACHE_DEBUG=1).
    """
    level = logging.WARNING - 10 * verbose if verbose else logging.WARNING
    if os.environ.get("KCACHE_DEBUG") == "1":
        level = logging.DEBUG
    handler = logging.StreamHandler()  # messages may quote text from the store or the network
    handler.setFormatter(RedactingFormatter("kcache: %(levelname)s: %(message)s"))
    logging.basicConfig(level=max(level, logging.DEBUG), handlers=[handler])


class RedactingFormatter(OneLineFormatter):
    """Log lines quote URLs (store, index, endpoint): their passwords stay out of pod logs, and text
    from the store stays on one line."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def _show_envvars(command: click.Command) -> None:
    # Every option an environment variable can set shows it the one way click does, "[env var: X]",
    # including options declared in command modules without show_envvar.
    for sub in command.commands.values() if isinstance(command, click.Group) else ():
        _show_envvars(sub)
    for param in command.params:
        if isinstance(param, click.Option) and param.envvar:
            param.show_envvar = True


def _more_logging(_ctx: click.Context, _param, count: int) -> None:
    if count:  # the group's callback set logging up already: it runs before a command's arguments parse
        root = logging.getLogger()
        root.setLevel(max(logging.DEBUG, min(root.level, logging.WARNING - 10 * count)))


def _take_verbose(command: click.Command) -> None:
    """-v after a command's name means what it means before it. Refused there, it was a usage error,
    which restore answers by starting cold."""
    for sub in command.commands.values() if isinstance(command, click.Group) else ():
        _take_verbose(sub)
    if not any("-v" in param.opts for param in command.params):
        verbose = click.Option(["-v", "--verbose"], count=True, expose_value=False, callback=_more_logging,
                               help="More logging on stderr (-vv for debug).")  # fmt: skip
        command.params.append(verbose)


def run() -> None:
    """The `kcache` script and `python -m kcache`: the command, then a cheap end of the process.

    The interpreter's last collections walk every object still alive, and a command leaves many (boto3's
    modules, a manifest's entries): 0.05-0.06 s of a 1.2 s restore and of each short command. Frozen
    objects are skipped by those collections, and a process that is ending has nothing left to collect.
    Only the process's own entry freezes: a caller of `main` (tests, an embedding program) keeps its
    collector as it was. A command that runs threads it may leave behind bounds the wait for them here
    (kcache.cli.lingering).
    """
    try:
        main(prog_name="kcache")
    except SystemExit as exc:  # click ends every command with it
        lingering.settle(exc.code)
        raise
    finally:
        gc.freeze()
