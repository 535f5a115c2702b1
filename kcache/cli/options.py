"""Options shared by several commands, opening store and index, and the error boundary around all of them."""

from __future__ import annotations

import functools
import math
import os
import re
import signal
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import click
from click.core import ParameterSource

from kcache import config, cpus, durations, fingerprint, readiness, sizes
from kcache.cli import format as fmt
from kcache.cli.errors import ExitCode, describe
from kcache.errors import ConfigError


def fingerprint_options(fn=None, *, many_models: bool = False):
    """--model, --model-config, --fact, --extra: what describes the workload and overrides facts.
    `many_models`: --model may repeat (prefetch), each one a workload of its own."""
    if fn is None:
        return functools.partial(fingerprint_options, many_models=many_models)
    more = " Repeatable." if many_models else ""
    options = (
        click.option("--model", metavar="ID", envvar="KCACHE_MODEL", multiple=many_models,
                   help=f"Model identity, e.g. meta-llama/Llama-3.1-8B@rev.{more}"),
        click.option("--model-config", type=NonEmptyPath(dir_okay=False, path_type=Path),
                     help="The model's config.json; its content becomes part of the workload key."),
        click.option("--facts-file", type=NonEmptyPath(dir_okay=False, path_type=Path), expose_value=False,
                   callback=_remember_facts_file, envvar="KCACHE_FACTS_FILE",
                   help="Facts of the machine that runs the model (`kcache fingerprint --json` there); "
                        "nothing is probed."),
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


def store_options(fn=None, *, index_none: bool = False):
    """--store, --index, --s3-endpoint-url. `index_none`: the command works from the store's refs/
    alone (restore), so --index none is offered; everywhere else it is refused (`open_index`)."""
    if fn is None:
        return functools.partial(store_options, index_none=index_none)
    none = ", or 'none' to find bundles through the store's refs/" if index_none else ""
    options = (
        click.option("--store", "store_url", metavar="URL", envvar=config.ENV["store"], type=NonEmptyText(),
                   help="file:///path or s3://bucket/prefix (default $KCACHE_HOME/store)."),
        click.option("--index", "index_url", metavar="URL", envvar=config.ENV["index"], type=NonEmptyText(),
                   help=f"SQLAlchemy URL of the index{none} (default sqlite:///$KCACHE_HOME/index.db)."),
        click.option("--s3-endpoint-url", metavar="URL", envvar=list(config.ENV["endpoint"]), type=NonEmptyText(),
                   help="S3-compatible endpoint; AWS_ENDPOINT_URL_S3 wins over AWS_ENDPOINT_URL, and "
                        "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS=true leaves both unused, as in boto3."),
    )  # fmt: skip
    return _apply(fn, options)


def root_option(fn):
    return click.option(
        "--root", required=True, envvar="KCACHE_ROOT", type=NonEmptyPath(file_okay=False, path_type=Path),
        help="The restore root (`kcache restore --into`) holding the markers.",
    )(fn)  # fmt: skip


def load_signing_key(path):
    """The private key to sign with, or None when signing is off."""
    if not path:
        return None
    from kcache.signing import load_signing_key as load

    return load(path)


TRUSTED_KEYS_ENV = "KCACHE_TRUSTED_KEYS"


def trusted_key_option(help: str):  # noqa: A002 - click's name
    """--trusted-key (repeatable; KCACHE_TRUSTED_KEYS, ':'-separated), the same for every command that checks
    signatures, so that restore, prefetch, verify and reindex read the variable alike."""
    return click.option("--trusted-key", "trusted_keys", multiple=True, envvar=TRUSTED_KEYS_ENV,
                        type=TrustedKeyPath(dir_okay=False, path_type=Path), help=help)  # fmt: skip


def load_trusted_keys(paths) -> tuple:
    """Public keys from --trusted-key flags (or KCACHE_TRUSTED_KEYS, which TrustedKeyPath splits at ':')."""
    if not paths:
        return ()
    from kcache.signing import load_trusted_keys as load

    return load(paths)


REQUIRE_SIGNATURE_ENV = "KCACHE_REQUIRE_SIGNATURE"


def require_signature_option(what: str):
    """--require-signature, with `what` it refuses. The environment is read by `env_flag`, not by
    click, whose booleans also take "y" or "t": restore and prefetch must read it alike."""
    env = f"[env var: {REQUIRE_SIGNATURE_ENV}=1 (1/true/yes/on; 0/false/no/off)]"
    return click.option("--require-signature", is_flag=True, help=f"{what}  {env}")


def env_flag(name: str) -> tuple[bool, ConfigError | None]:
    """(value, None), or (True, the error) for a value that is no boolean: a garbled request for
    signatures must never read as "off" (restore starts cold on it, prefetch refuses it)."""
    text = os.environ.get(name, "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return False, None
    if text in ("1", "true", "yes", "on"):
        return True, None
    return True, ConfigError(name, text, "expected 1/true/yes/on or 0/false/no/off")


def read_jobs_option(fn):
    """--jobs for commands that read packs (restore, verify, reindex): unset, two per usable CPU."""
    return click.option("--jobs", type=click.IntRange(1, 256), callback=_default_read_jobs,
                        help=f"Parallel pack reads [default: {cpus.READS_PER_CPU} per CPU this process may use "
                        f"(affinity and CPU limit), {cpus.MIN_READS} to {cpus.MAX_READS}].")(fn)  # fmt: skip


HEALTH_URL_HELP = (
    "Also require the model server's health endpoint to answer 2xx (e.g. "
    "http://127.0.0.1:8000/health). Without it a model container that restarted reads as "
    "ready from its first start's markers while it still loads."
)


def health_url_option(fn=None, *, help: str = HEALTH_URL_HELP):  # noqa: A002 - click's name
    """--health-url for the readiness checks (ready, serve, watch): an EngineHealth, or None.
    `@health_url_option`, or `@health_url_option(help=...)` where the option means something narrower."""

    def decorate(fn):
        return click.option("--health-url", metavar="URL", callback=_engine_health, type=NonEmptyText(),
                            help=help)(fn)  # fmt: skip

    return decorate(fn) if fn is not None else decorate


def _engine_health(_ctx, _param, value: str | None):
    return None if value is None else readiness.EngineHealth(value)


def _default_read_jobs(_ctx, _param, value: int | None) -> int:
    return value or cpus.read_jobs()


def json_option(fn=None, *, listing: str | None = None):
    """--json; `listing` names what a command that prints a JSON array lists, one object each."""
    if fn is None:
        return lambda f: json_option(f, listing=listing)
    error = "status, error, hint, exit_code"
    what = (f"one JSON array for scripts, an object a {listing} (an error: one object, {error})" if listing
            else f"one JSON object for scripts (an error too: {error})")  # fmt: skip
    return click.option("--json", "as_json", is_flag=True, callback=_remember_json, help=f"Print {what}.")(fn)


def _remember_json(ctx: click.Context, _param, value):
    # The error boundary runs outside the command; it learns the output format through the context.
    ctx.meta["kcache.json"] = value
    return value


def compute_fingerprint(model, model_config, facts, extras) -> fingerprint.Fingerprint:
    facts_file = click.get_current_context().meta.get("kcache.facts_file")
    return fingerprint.collect(
        model=model,
        model_config=model_config,
        extra=fingerprint.parse_assignments(extras, "--extra"),
        overrides=fingerprint.parse_assignments(facts, "--fact"),
        facts_file=facts_file,
    )


def command_line_workload(facts, extras) -> dict[str, str]:
    """The workload facts --extra and --fact named, which win over a restore root's record.

    --model and --model-config are not here: either names the model, and then no record is read.
    """
    given = {f"extra.{k}": v for k, v in fingerprint.parse_assignments(extras, "--extra").items()}
    overrides = fingerprint.parse_assignments(facts, "--fact")
    given.update({k: v for k, v in overrides.items() if fingerprint.is_workload_fact(k)})
    return given


def open_configured_store(cfg: config.Settings, *, jobs: int = 16, publisher: bool = False,
                          before_publish: bool = False):  # fmt: skip
    """The store `cfg` names. A file:// store that does not exist is created only by a `publisher`;
    an operator's command (verify, reindex, gc, ...) gets a StoreError, so that a typo in --store
    does not read as an empty store. It reads as empty, and stays uncreated, for the pod-side
    readers that run `before_publish` (restore, prefetch: a miss then, not an error). The default
    store under KCACHE_HOME, kcache's own, reads as empty too, and the commands that write create it
    (the store id a writer binds its index to: yank, refresh and reindex as well as publish; gc first
    needs the default index, which only a publish makes)."""
    from kcache.store import open_store

    config.check_endpoint(cfg)
    return open_store(cfg.store_url, endpoint_url=cfg.s3_endpoint_url, endpoint_configured=cfg.endpoint_configured,
                      jobs=jobs, create=publisher or before_publish or not cfg.store_explicit)  # fmt: skip


@contextmanager
def opened(cfg: config.Settings, *, store: bool = True, index: bool = True, jobs: int = 16,
           write: bool = True, create: bool = False) -> Iterator[tuple]:  # fmt: skip
    """(store, index) for one command, either None when not asked for; the index is closed at the end.

    The index is checked against the store it describes (kcache.binding); a writer binds an
    unbound one. An index file that was named and does not exist is created only with `create`
    (reindex); any other command gets an IndexDbError, so that a typo in --index does not read
    as an empty index. A reader (`write=False`) never creates an index file."""
    from kcache import binding

    if index:
        binding.require_index(cfg)  # before the store is opened (or, for publish, created)
    the_store = open_configured_store(cfg, jobs=jobs) if store else None
    the_index = binding.open_index(cfg, the_store, write=write, create=create) if index else None
    try:
        yield the_store, the_index
    finally:
        if the_index is not None:
            the_index.close()


# Which command parameter sets which setting, for `origin`.
SETTING_PARAMS = {"store": "store_url", "index": "index_url", "endpoint": "s3_endpoint_url"}


def settings(store_url, index_url, s3_endpoint_url, origins: Mapping[str, str] | None = None) -> config.Settings:
    """The settings the command's flags and the environment give. Off click's thread (where no command
    is current), pass the `setting_origins()` read on it, or messages name a flag the user never gave."""
    origins = setting_origins() if origins is None else origins
    return config.resolve(store_url, index_url, s3_endpoint_url, origins=origins)


def setting_origins() -> dict[str, str]:
    """Where the running command's store, index and endpoint came from (`origin`), by setting."""
    return {name: where for name, param in SETTING_PARAMS.items() if (where := origin(param))}


def origin(param_name: str) -> str | None:
    """Where a parameter of the running command came from: `flag --x`, `env VAR`, or None (not given)."""
    ctx = click.get_current_context(silent=True)
    param = next((p for p in ctx.command.params if p.name == param_name), None) if ctx else None
    if param is None:
        return None
    source = ctx.get_parameter_source(param_name)
    if source is ParameterSource.COMMANDLINE:
        return f"flag {param.opts[0]}"
    if source is ParameterSource.ENVIRONMENT:
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
        return next((f"env {name}" for name in names if os.environ.get(name)), "env")
    return None


def report(exc: BaseException, as_json: bool) -> click.exceptions.Exit:
    """Print one error (a JSON object on stdout under --json, always a line and a hint on stderr);
    return the Exit to raise with the table's code."""
    message, hint, code = describe(exc)
    if as_json:
        click.echo(fmt.to_json({"status": "error", "error": message, "hint": hint, "exit_code": int(code)}))
    click.echo(f"kcache: error: {fmt.text(message)}", err=True)  # may quote the store, the index, a server
    click.echo(f"  hint: {hint}", err=True)
    return click.exceptions.Exit(code)


def debugging() -> bool:
    return os.environ.get("KCACHE_DEBUG") == "1"


class KcacheGroup(click.Group):
    """The one error boundary: whatever a command raises leaves through the table in cli/errors.py."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta.setdefault("kcache.argv", list(args))  # --json, for errors raised before it is parsed
        try:  # `kcache --help` and `--version` print here, before any command is invoked
            return super().parse_args(ctx, args)
        except BrokenPipeError:  # click's own answer to it is exit 1
            raise _reader_gone() from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except KeyboardInterrupt as exc:  # ^C, or SIGTERM where a command turned it into one (128 + signal)
            code = 128 + getattr(exc, "signum", ExitCode.INTERRUPTED - 128)
            if wants_json(ctx):  # a script reads one object, whatever happened
                click.echo(fmt.to_json({"status": "error", "error": f"interrupted ({_signal_name(code - 128)})",
                                        "hint": "run it again", "exit_code": code}))  # fmt: skip
            click.echo("kcache: interrupted", err=True)
            raise click.exceptions.Exit(code) from None
        except BrokenPipeError:  # `kcache stats | head`: the reader has what it wanted; no bug to report
            raise _reader_gone() from None
        except click.ClickException as exc:  # a usage error: click prints it, unless --json asks for JSON
            if not wants_json(ctx):
                raise
            click.echo(fmt.to_json({"status": "error", "error": exc.format_message(), "hint": "see --help",
                                    "exit_code": exc.exit_code}))  # fmt: skip
            exc.show()
            raise click.exceptions.Exit(exc.exit_code) from None
        except Exception as exc:
            if debugging():
                raise
            raise report(exc, wants_json(ctx)) from None


def _reader_gone() -> click.exceptions.Exit:
    """Exit 141, as shells report SIGPIPE, once stdout's reader closed it."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
    return click.exceptions.Exit(ExitCode.BROKEN_PIPE)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def wants_json(ctx: click.Context) -> bool:
    return bool(ctx.meta.get("kcache.json")) or "--json" in ctx.meta.get("kcache.argv", ())


def stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def node_cache_option(fn=None, *, required: bool = False):
    """--node-cache DIR (KCACHE_NODE_CACHE): the node-local pack cache restore reads and prefetch fills.

    Only prefetch, which needs it, refuses a file or an unreadable directory at DIR as a usage error;
    restore checks it itself and reads from the store without the node cache (kcache.cli.restore_cmd):
    a pod's user that may not read the DaemonSet's directory is restored, only without its packs."""
    if fn is None:
        return lambda f: node_cache_option(f, required=required)
    return click.option(
        "--node-cache", type=NonEmptyPath(file_okay=not required, readable=required, path_type=Path),
        envvar="KCACHE_NODE_CACHE", required=required, metavar="DIR",
        help="Node-local pack cache (a hostPath shared by the pods of a node): packs are read from it "
             "first, verified, and fetched into it on a miss (see `kcache prefetch`).",
    )(fn)  # fmt: skip


class _Parsed(click.ParamType):
    """A flag value read by one of kcache's parsers; its ConfigError becomes click's usage error."""

    def parse(self, text: str, flag: str):
        raise NotImplementedError

    def convert(self, value, param, ctx):
        if not isinstance(value, str):  # a default given as a number, or converted already
            return value
        try:
            return self.parse(value, param.opts[0] if param else self.name)
        except ConfigError as exc:
            self.fail(f"{value!r}: {exc.why} ({self.example})", param, ctx)


class Duration(_Parsed):
    """`90`, `90s`, `10m`, `1h` -> seconds (kcache.durations' rules; a bare number is seconds), at least
    `at_least` seconds."""

    name, example = "duration", "e.g. 30s, 10m or 1h"

    def __init__(self, at_least: float = 0.0):
        self.at_least = at_least

    def parse(self, text: str, flag: str) -> float:
        seconds = durations.parse(text, flag, bare_seconds=True, positive=True).total_seconds()
        if seconds < self.at_least:
            raise ConfigError(flag, text, f"is shorter than {self.at_least * 1000:g}ms")
        return seconds


class Wait(Duration):
    """A Duration that may be zero: "do not wait"."""

    def parse(self, text: str, flag: str) -> float:
        return durations.parse(text, flag, bare_seconds=True).total_seconds()


class Size(_Parsed):
    """`1073741824`, `512Mi`, `50Gi` -> bytes (kcache.sizes' rules)."""

    name, example = "size", "e.g. 512Mi or 50Gi"

    def parse(self, text: str, flag: str) -> int:
        try:
            return sizes.parse(text, flag)
        except OverflowError:  # a fraction with hundreds of digits: float() says inf
            raise ConfigError(flag, text, "is not a size kcache can count") from None


class NonEmptyPath(click.Path):
    """click.Path that refuses "": Path("") is ".", so an empty --into (or a variable expanded to
    nothing) would mean the current directory, and restore replaces the layer directories of its root.
    An environment variable set to "" never gets here: click reads it as unset."""

    def convert(self, value, param, ctx):
        if isinstance(value, (str, bytes)) and not value:
            self.fail("'' is an empty path; name the directory or file ('.' for the current one)", param, ctx)
        return super().convert(value, param, ctx)


class TrustedKeyPath(NonEmptyPath):
    """A .pub path; KCACHE_TRUSTED_KEYS is split at ':' and its empty elements are dropped: a list joined
    from variables (`$OLD:$NEW`, one of them unset) or with a trailing ':' names the keys it names. A value
    of nothing but separators names no key at all, and stays an error: read as "no trusted keys", it would
    turn signature checks off (restore then starts cold, as on any bad value)."""

    def split_envvar_value(self, rv: str):
        named = [part for part in rv.split(os.pathsep) if part.strip()]
        return named or [rv]

    def convert(self, value, param, ctx):
        if isinstance(value, str) and value and not any(part.strip() for part in value.split(os.pathsep)):
            self.fail(f"{value!r} names no key file; give ':'-separated .pub paths, or leave it unset to "
                      "check no signatures", param, ctx)  # fmt: skip
        if isinstance(value, str) and "," in value and not os.path.lexists(value):
            self.fail(f"{value!r}: no such file; several key files are separated by ':', not ','", param, ctx)
        return super().convert(value, param, ctx)


class NonEmptyText(click.ParamType):
    """Text that refuses "": an empty --store, --index or --host (a variable expanded to nothing)
    would otherwise mean the default, a publish into the pod's own disk or a server listening on
    every interface. As for NonEmptyPath, an environment variable set to "" reads as unset."""

    name = "text"

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail(f"{value!r} is empty; leave the flag out for the default", param, ctx)
        return value


class FiniteFloat(click.FloatRange):
    """A number of seconds, at least `min`: inf, nan and more than a century (what kcache.durations
    takes) are usage errors. click's FloatRange lets nan through every bound, and inf or 1e300 reach
    timedelta and sleeps as an OverflowError, or as a wait without end."""

    def __init__(self, min: float | None = None, *, min_open: bool = False):
        super().__init__(min, None, min_open=min_open)

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        if number > durations.MAX_SECONDS:
            self.fail(f"{value!r} is longer than {durations.MAX_YEARS} years", param, ctx)
        return super().convert(number, param, ctx)


# The most rows a --limit asks of the index (SQLite's LIMIT takes a 64-bit integer, click's IntRange
# any integer): far more bundles than one listing shows anyone.
MAX_LIMIT = 1_000_000


def bundle_id_prefix(text: str, what: str = "BUNDLE") -> str:
    """A bundle id or a prefix of one as given (`kcache ls` prints 12 digits), lower-cased: hex in
    either case names the same bundle; anything but 6 to 64 hex digits is a usage error, not "no bundle"."""
    lowered = text.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{6,64}", lowered):
        raise ConfigError(what, text, "expected a bundle id or a prefix of it: 6 to 64 hex digits, as `kcache ls` "
                                      "prints")  # fmt: skip
    return lowered


def bundle_key_prefix(text: str, what: str = "--key") -> str:
    """A bundle key or a prefix of one, lower-cased; anything but 1 to 32 hex digits is a usage error."""
    lowered = text.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{1,32}", lowered):
        raise ConfigError(what, text, "expected a bundle key or a prefix of it: up to 32 hex digits")
    return lowered
