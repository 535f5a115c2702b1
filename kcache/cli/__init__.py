"""The `kcache` command: click commands only. Each parses, calls the library, formats."""

from __future__ import annotations

import logging
import os

import click

from kcache import buildinfo
from kcache.cli.bundles_cmd import ls_cmd, show_cmd
from kcache.cli.config_cmd import config_cmd
from kcache.cli.db_cmd import db_group
from kcache.cli.errors import epilog
from kcache.cli.explain_cmd import explain_cmd
from kcache.cli.fingerprint_cmd import fingerprint_cmd
from kcache.cli.keygen_cmd import keygen_cmd
from kcache.cli.operate_cmd import gc_cmd, verify_cmd, yank_cmd
from kcache.cli.options import KcacheGroup
from kcache.cli.prefetch_cmd import prefetch_cmd
from kcache.cli.proxy_cmd import proxy_cmd
from kcache.cli.publish_cmd import publish_cmd
from kcache.cli.ready_cmd import ready_cmd
from kcache.cli.refresh_cmd import refresh_cmd
from kcache.cli.reindex_cmd import reindex_cmd
from kcache.cli.restore_cmd import restore_cmd
from kcache.cli.serve_cmd import serve_cmd
from kcache.cli.stats_cmd import stats_cmd
from kcache.cli.warmup_cmd import prebake_cmd, warmup_cmd
from kcache.cli.watch_cmd import watch_cmd
from kcache.config import redact_text
from kcache.untrusted import OneLineFormatter


def _show_version(ctx: click.Context, _param, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(buildinfo.version_line())
        ctx.exit()


@click.group(cls=KcacheGroup, epilog=epilog(),
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


for command in (fingerprint_cmd, publish_cmd, restore_cmd, ls_cmd, show_cmd, reindex_cmd, keygen_cmd, db_group,
                ready_cmd, serve_cmd, watch_cmd, warmup_cmd, prebake_cmd, explain_cmd, stats_cmd,
                yank_cmd, verify_cmd, gc_cmd, config_cmd, refresh_cmd, proxy_cmd, prefetch_cmd):  # fmt: skip
    main.add_command(command)
_show_envvars(main)
