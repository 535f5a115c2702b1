"""`kcache restore`: the init container's step. Fail-open unless --strict."""

from __future__ import annotations

import os
import re
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import click

from kcache import config, durations, envfile
from kcache.allocator import reuse_freed_memory
from kcache.catalog import open_for_restore
from kcache.cli import format as fmt
from kcache.cli import progress_bars
from kcache.cli.errors import ExitCode, describe
from kcache.cli.options import (
    REQUIRE_SIGNATURE_ENV,
    NonEmptyPath,
    compute_fingerprint,
    env_flag,
    fingerprint_options,
    json_option,
    load_trusted_keys,
    node_cache_option,
    read_jobs_option,
    require_signature_option,
    setting_origins,
    settings,
    store_options,
    trusted_key_option,
)
from kcache.cli.restore_usage import RestoreCommand
from kcache.errors import ConfigError
from kcache.fingerprint import Fingerprint
from kcache.restore import Opened, restore_opening
from kcache.store import open_store
from kcache.untrusted import one_line

DEFAULT_TIMEOUT = 300.0
_BUNDLE_ID = re.compile(r"[0-9a-f]{64}\Z")  # a manifest's SHA-256
# A budget beyond a day is a typo (or "forever", which an init container must never be).
MAX_TIMEOUT = 86400.0


@click.command("restore", cls=RestoreCommand)
@click.option("--into", "root", required=True, type=NonEmptyPath(path_type=Path),
              help="Restore root, e.g. an emptyDir shared with the model container.")  # fmt: skip
@click.option("--timeout", "timeout_text", metavar="DURATION", default=str(int(DEFAULT_TIMEOUT)), show_default=True,
              envvar="KCACHE_RESTORE_TIMEOUT",
              help="Time budget for the whole restore: seconds (300) or a duration (90s, 5m); "
                   "then start cold.")  # fmt: skip
@click.option("--bundle", "bundle_id", metavar="ID",
              help="Pin this bundle (full id) instead of the newest; it must still match the fingerprint.")  # fmt: skip
@trusted_key_option("A .pub from `kcache keygen`; repeatable (env: ':'-separated).")  # fmt: skip
@require_signature_option("Refuse bundles not signed by a trusted key.")  # env read in the budget: no crash-loop
@click.option("--fallback", type=click.Choice(["toolchain", "layers"]),
              help="On a miss, restore the kernel layers (inductor, triton, cuda) of the newest bundle built "
                   "on this toolchain for another workload (needs the index: through refs/ it stays a miss); "
                   "'layers': each reusable layer from the newest bundle whose layer key matches "
                   "(kcache/layerkeys.py), through the index or refs/.")  # fmt: skip
@click.option("--run-as", "run_as", metavar="USER", envvar="KCACHE_RUN_AS",
              help="User the model container runs as (torch names the precompiled header's directory for it); "
                   "default: the user publish recorded, else this one.")  # fmt: skip
@click.option("--strict", is_flag=True, help="Exit non-zero on a miss (10; 15 when the facts file contradicts this "
              "machine) or an error instead of starting cold.")
@read_jobs_option
@node_cache_option
@fingerprint_options
@store_options(index_none=True)
@json_option
def restore_cmd(root, timeout_text, bundle_id, trusted_keys, require_signature, fallback, run_as, strict, jobs,
                node_cache,
                model, model_config, facts, extras, store_url, index_url, s3_endpoint_url, as_json):  # fmt: skip
    """Lay the bundle that matches this machine into ROOT and write ROOT/kcache.env.

    On a miss, ROOT still gets empty layer directories and kcache.env, so the cold pod's compile
    lands where `kcache publish --from ROOT` will find it. Any failure (a typo in a flag included)
    prints one line, writes kcache.env and an error marker for `kcache ready`, and exits 0 (the pod
    starts cold) unless --strict. Never imports torch.

    With --index none (or no index named and no local one), the bundle is found through the
    store's refs/, so the pod needs only read access to the bucket.

    \b
    Examples:
      kcache restore --into /cache --model my-llm && . /cache/kcache.env
      kcache restore --into /cache --strict --timeout 60 --json
    """
    started = time.perf_counter()
    reuse_freed_memory()  # before the first MiB buffer: see kcache.allocator
    timeout, bad_timeout = _parse_timeout(timeout_text)
    required, bad_flag = env_flag(REQUIRE_SIGNATURE_ENV)
    bundle_id, bad_bundle = _parse_bundle_id(bundle_id)
    ctx = click.get_current_context()
    origins = setting_origins()  # read here: the store opens on a thread where no click command is current
    opened: list[Opened] = []
    computed: list[Fingerprint] = []  # once open_inputs has it: an error's marker and JSON name its key

    def open_inputs() -> Opened:
        # Runs in restore's worker thread, inside the budget: a typo here is an error marker and a
        # cold start like any other failure, not a usage error that crash-loops the init container.
        for bad in (bad_timeout, bad_flag, bad_bundle):
            if bad is not None:
                raise bad
        # The store and the index open while the fingerprint is computed: botocore's import and
        # client (0.2-0.3 s) overlap NVML's start on a GPU node (~0.1 s). A fingerprint that fails
        # still fails first, and keeps its place in the error marker.
        opening = _opening(lambda: _open_store_and_index(settings(store_url, index_url, s3_endpoint_url, origins),
                                                         jobs, node_cache, timeout))  # fmt: skip
        try:
            with ctx.scope(cleanup=False):  # the fingerprint options live on click's context
                fp = compute_fingerprint(model, model_config, facts, extras)
            computed.append(fp)
            trusted = load_trusted_keys(trusted_keys)
        except BaseException:
            _abandon(opening)
            raise
        store, index = opening.result()
        opened.append(Opened(store, index, fp, trusted))
        return opened[-1]

    try:
        with progress_bars.bars(progress_bars.wanted(as_json)) as report:
            result = restore_opening(open_inputs, root, jobs=jobs, timeout=timeout, bundle_id=bundle_id,
                                     require_signature=require_signature or required, fallback=fallback,
                                     run_as=run_as, report=report,
                                     computed=lambda: computed[0] if computed else None)  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - an init container must never crash-loop on a kcache bug
        if os.environ.get("KCACHE_DEBUG") == "1":
            raise
        _report_error(exc, strict, as_json, time.perf_counter() - started, Path(root).absolute(),
                      computed[0].bundle_key if computed else None)  # fmt: skip
        return
    finally:
        for inputs in opened:
            _close_quietly(inputs.index)
    payload = {
        "status": result.status, "bundle_key": result.bundle_key, "bundle_id": result.bundle_id,
        "files": result.files, "bytes": result.bytes, "seconds": round(result.seconds, 4),
        "reason": result.reason, "root": str(result.root), "env_file": str(result.env_file),
        "layers": list(result.layers),
        "signed_by": result.signed_by, "donors": dict(result.donors),
    }  # fmt: skip
    failing = _strict_exit(opened) if strict and result.status == "miss" else None
    if as_json:
        if failing is not None:  # the error object every command prints, in the shape of a miss
            payload |= {"error": f"miss: {one_line(result.reason)}", "hint": _STRICT_MISS_HINT,
                        "exit_code": int(failing)}  # fmt: skip
        click.echo(fmt.to_json(payload))
    elif result.donors:
        click.echo(f"kcache: partial hit: {result.reason} ({result.files} files) into {result.root}; "
                   f"source {result.env_file}")  # fmt: skip
    elif result.status in ("hit", "partial"):
        what = "partial hit: restored the kernel layers of" if result.status == "partial" else "hit: restored"
        click.echo(f"kcache: {what} bundle {result.bundle_id[:12]} ({result.files} files, "
                   f"{fmt.size(result.bytes)}) into {result.root} in {fmt.seconds(result.seconds)}; "
                   f"source {result.env_file}")  # fmt: skip
    else:
        click.echo(f"kcache: miss: {one_line(result.reason)} (key {result.bundle_key}); starting cold. "
                   f"Source {result.env_file}, then `kcache publish --from {result.root}` after warmup.")  # fmt: skip
    if failing is not None:
        raise click.exceptions.Exit(failing)


_STRICT_MISS_HINT = ("no bundle matches this machine (`kcache explain` says which fact differs); without --strict "
                     "the pod starts cold and publishes one")


def _strict_exit(opened: list[Opened]) -> ExitCode:
    """A --strict miss's exit: 15 when the facts file (or a --fact) contradicts this machine, else 10."""
    return ExitCode.FACTS_DISAGREE if opened and opened[0].fingerprint.mismatches else ExitCode.MISS


def _open_store_and_index(cfg: config.Settings, jobs: int, node_cache: Path | None, timeout: float):
    config.check_endpoint(cfg)
    # A pod may restore before the first publish made the store: a miss, not an error (restore
    # writes nothing to the store, so it never creates one; cli.options.open_configured_store).
    store = open_store(cfg.store_url, endpoint_url=cfg.s3_endpoint_url, endpoint_configured=cfg.endpoint_configured,
                       jobs=jobs, create=True)
    if node_cache is not None:
        store = _through_node_cache(store, node_cache, timeout)
    return store, open_for_restore(cfg, store)


def _opening(open_both) -> Future:
    """`open_both()` on a daemon thread of its own (a hung index must not hold the process at exit);
    its (store, index), or its error, in the Future."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(open_both())
        except BaseException as exc:  # noqa: BLE001 - handed to result()'s caller
            future.set_exception(exc)

    threading.Thread(target=run, name="kcache-open", daemon=True).start()
    return future


def _abandon(opening: Future) -> None:
    """The fingerprint failed: the index `opening` gives, now or later, is closed as it arrives."""
    opening.add_done_callback(lambda done: done.exception() is None and _close_quietly(done.result()[1]))


def _through_node_cache(store, directory: Path, timeout: float):
    """`store` behind the node cache at `directory`, or alone when the node cache is misconfigured (a
    typo in its cap, a file at its path, a path the pod may not reach): it can only save fetches, so it
    must not cost the warm start."""
    try:
        try:
            usable = not directory.exists() or directory.is_dir()
        except OSError as exc:  # EACCES: below another user's private directory (a 0700 hostPath)
            raise ConfigError("--node-cache", str(directory), f"cannot be reached: {exc.strerror or exc}") from None
        if not usable:
            raise ConfigError("--node-cache", str(directory), "is not a directory")
        from kcache.store.nodecache import NodeCacheStore  # only with --node-cache: ~4 ms of every other start

        # Waiting on another pod's download may take half the budget, no more.
        return NodeCacheStore(store, directory, wait=timeout / 2)
    except ConfigError as exc:
        click.echo(f"kcache: warning: node cache not used, packs come from the store: {one_line(exc)}", err=True)
        return store


def _parse_timeout(text: str) -> tuple[float, ConfigError | None]:
    """(seconds, None), or (the default, the error) for a value that is no usable budget."""
    try:
        seconds = durations.parse(text, "--timeout", bare_seconds=True, positive=True).total_seconds()
    except ConfigError as exc:
        return DEFAULT_TIMEOUT, exc
    except OverflowError:
        seconds = float("inf")
    if seconds > MAX_TIMEOUT:
        return DEFAULT_TIMEOUT, ConfigError("--timeout", text, f"is longer than a day ({MAX_TIMEOUT:g} s)")
    return seconds, None


def _parse_bundle_id(text: str | None) -> tuple[str | None, ConfigError | None]:
    """(the id, None), or (None, the error) for a value that is no full bundle id: a prefix (what
    `kcache ls` prints) would be looked up as an object the store lost."""
    if text is None:
        return None, None
    if not _BUNDLE_ID.match(text.lower()):
        return None, ConfigError("--bundle", text, "needs a full bundle id, 64 hex digits (`kcache ls --json` "
                                 "prints them as bundle_id)")  # fmt: skip
    return text.lower(), None


def _close_quietly(index) -> None:
    try:
        index.close()
    except Exception as exc:  # noqa: BLE001 - the restore's outcome is already decided
        click.echo(f"kcache: warning: closing the index failed: {one_line(exc)}", err=True)


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # ENAMETOOLONG: a ROOT past what the kernel takes, which is why restore failed
        return False


def _report_error(exc: Exception, strict: bool, as_json: bool, seconds: float, root: Path,
                  bundle_key: str | None = None) -> None:  # fmt: skip
    message, hint, code = describe(exc)
    message = one_line(message)  # may quote text from the store or the network
    if as_json:  # the shape of a hit or a miss, with what is known; env_file only where restore wrote one
        env_file = root / envfile.NAME
        click.echo(fmt.to_json({"status": "error", "bundle_key": bundle_key, "bundle_id": None, "files": 0,
                                "bytes": 0, "seconds": round(seconds, 4), "reason": message, "root": str(root),
                                "env_file": str(env_file) if _is_file(env_file) else None, "layers": [],
                                "signed_by": None, "donors": {}, "error": message, "hint": hint,
                                "exit_code": int(code) if strict else 0}))  # fmt: skip
    action = "failing (--strict)" if strict else "starting cold"
    click.echo(f"kcache: restore failed, {action}: {message}", err=True)
    click.echo(f"  hint: {hint}", err=True)
    if strict:
        raise click.exceptions.Exit(code)
