"""`kcache warmup` (send every profile's shape before users do) and `kcache prebake` (+ publish)."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict
from datetime import datetime, timedelta, timezone
from pathlib import Path

import click

from kcache import binding, readiness, warmup
from kcache import profiles as profile_files
from kcache.cli import format as fmt
from kcache.cli import lingering
from kcache.cli.errors import ExitCode
from kcache.cli.options import (
    Duration,
    NonEmptyPath,
    Wait,
    compute_fingerprint,
    fingerprint_options,
    json_option,
    open_configured_store,
    settings,
    stderr_is_terminal,
    store_options,
)
from kcache.cli.publish_cmd import allow_empty_option, publish_config
from kcache.config import redact_doc, redact_text
from kcache.errors import ConfigError, KcacheError, RootError
from kcache.prebake import EXIT_GRACE, ChildWarmup, ServerWarmup, prebake
from kcache.restore import sigterm_interrupts
from kcache.untrusted import one_line

log = logging.getLogger(__name__)

# How long past --budget a running marker stays valid (the report and the last marker are written then).
_RUNNING_GRACE = timedelta(seconds=60)

PROFILES_HELP = """\b
Profiles file (YAML or TOML):
  profiles:                      [[profiles]]
    - name: chat                 name = "chat"
      batch_size: 1              batch_size = 1
      input_tokens: 512          input_tokens = 512
      output_tokens: 64          output_tokens = 64
      repeats: 3                 repeats = 3      # optional, default 1
"""


def target_options(fn):
    defaults = ", ".join(f"{p.name} {p.batch_size}x{p.input_tokens}->{p.output_tokens} x{p.repeats}"
                         for p in profile_files.DEFAULTS)  # fmt: skip
    options = (
        click.option("--entrypoint", metavar="MODULE:FUNCTION",
                     help="Call FUNCTION(batch_size, input_tokens, output_tokens) in-process per run."),
        click.option("--url", metavar="URL",
                     help="An OpenAI-compatible server (vLLM, SGLang, TGI), e.g. http://127.0.0.1:8000."),
        click.option("--profiles", "profiles_file", type=NonEmptyPath(dir_okay=False, path_type=Path),
                     envvar="KCACHE_WARMUP_PROFILES",
                     help=f"YAML/TOML profiles file (default: {defaults})."),
        click.option("--parallel", type=click.IntRange(1, 64), default=1, show_default=True,
                     help="Profiles run at once (singles still finish before batches)."),
        click.option("--request-timeout", type=Duration(), default=300.0, show_default=True, metavar="DURATION",
                     help="How long one HTTP request may take in all: connect, headers and body (--url); "
                          "seconds (300) or a duration (5m)."),
        click.option("--wait-timeout", type=Wait(), default=600.0, show_default=True, metavar="DURATION",
                     help="How long to wait for the server's /health (or /v1/models) to answer 2xx (--url)."),
        click.option("--served-model", metavar="NAME",
                     help="The `model` field of requests (--url; default: the first of /v1/models)."),
        click.option("--retries", type=click.IntRange(0, 100), default=3, show_default=True,
                     help="Retries of a request that failed transiently (connection error, timeout, 408, 429, "
                          "502-504), with backoff (--url)."),
        click.option("--budget", type=Wait(), default=0, show_default=True, metavar="DURATION",
                     help="How long the whole warmup may take, the wait included; requests and retries stop "
                          "when it is spent (--url), or prebake kills its --entrypoint warmup process; warmup "
                          "--entrypoint is not stopped, but readiness counts it failed from then on "
                          "(0: no limit)."),
    )  # fmt: skip
    for option in reversed(options):
        fn = option(fn)
    return fn


def _profiles(path: Path | None) -> tuple[profile_files.Profile, ...]:
    return profile_files.load(path) if path else profile_files.DEFAULTS


def _check_target(entrypoint: str | None, url: str | None) -> None:
    if bool(entrypoint) == bool(url):
        raise ConfigError("target", entrypoint or url or "", "pass exactly one of --entrypoint and --url")


def _http(url, request_timeout, wait_timeout, served_model, retries, budget) -> warmup.HttpTarget:
    return warmup.HttpTarget(url, request_timeout=request_timeout, wait_timeout=wait_timeout, served_model=served_model,
                             retries=retries, budget=budget or None)  # fmt: skip


def _note():
    return (lambda msg: click.echo(f"kcache: {fmt.text(msg)}", err=True)) if stderr_is_terminal() else None


@click.command("warmup", epilog=PROFILES_HELP)
@target_options
@click.option("--root", type=NonEmptyPath(file_okay=False, path_type=Path), envvar="KCACHE_ROOT",
              help="Write the readiness marker ROOT/.kcache-warmup.json. "
                   "Without it no marker is written.")  # fmt: skip
@click.option("--on-failure", type=click.Choice(readiness.ON_FAILURE), default="unready", show_default=True,
              envvar="KCACHE_WARMUP_ON_FAILURE",
              help="What a failed warmup means for readiness: stay unready, or ready-cold (ready once the "
                   "server answered, with kcache_ready_cold 1) so a rollout never stalls on one hiccup.")  # fmt: skip
@json_option
def warmup_cmd(entrypoint, url, profiles_file, parallel, request_timeout, wait_timeout, served_model, retries, budget,
               root, on_failure, as_json):  # fmt: skip
    """Send every warmup profile's shape once, singles first, then batches by size.

    Reports each profile's first latency (the compile) and steady-state median. Exits 13 if any
    profile failed or the server never became healthy; the marker then says "failed", and the pod
    stays unready unless --on-failure ready-cold. While warmup runs, the marker says "running" and
    which readiness signals (weights loaded, graphs compiled) hold already. SIGTERM or SIGINT stops
    it at once (exit 143 or 130, also as a container's PID 1) with a failed marker. With
    --entrypoint, a process that imported torch also saves torch's Mega-Cache to
    $KCACHE_MEGACACHE when that is set (ROOT/kcache.env sets it). A marker that cannot be written
    (ROOT full or read-only) does not stop the warmup: the report still comes, and the exit code is
    the root error's.

    \b
    Examples:
      kcache warmup --url http://127.0.0.1:8000 --root /cache
      kcache warmup --entrypoint myservice.warm:run --profiles profiles.yaml --json
    """
    # A running marker outlives a killed warmup: with a budget it expires (see readiness._lapsed). An
    # --entrypoint runs in this process and is not stopped when the budget is spent, but a hung one no
    # longer keeps the pod unready for good: past the budget its marker counts as a failed warmup.
    expires = datetime.now(timezone.utc) + timedelta(seconds=budget) + _RUNNING_GRACE if budget else None
    after = readiness.restore_stamp(root) if root else None  # the restore this warmup follows
    before = frozenset(threading.enumerate())
    # A thread the entrypoint leaves running (not a daemon) held Python's exit for ever, after the report
    # and the marker: `warmup; exec watch` never reached watch. It gets what prebake gives its child.
    lingering.bound(before, EXIT_GRACE)
    last: list[warmup.WarmupReport] = []  # the last "running" report: what held when a signal came

    unwritable: list[RootError] = []  # the marker's last failure: readiness's signal, not the warmup's result

    def checkpoint(partial: warmup.WarmupReport) -> None:
        last[:] = [partial]
        if root:
            _write_marker(root, partial, on_failure, unwritable, expires_at=expires, after_restore=after)

    try:
        # kcache may be the container's PID 1, which the kernel sends no signal it has no handler for:
        # without one, the kubelet's SIGTERM was ignored and the pod held for its whole grace period.
        with sigterm_interrupts():
            _check_target(entrypoint, url)
            chosen = _profiles(profiles_file)
            if entrypoint:
                with stdout_to_stderr():  # the entrypoint is the user's code: only kcache's report is stdout
                    target = warmup.load_entrypoint(entrypoint)
                    report = warmup.run(target, chosen, parallel=parallel, progress=_note(),
                                        probe=warmup.torch_counters, checkpoint=checkpoint)  # fmt: skip
                    report = warmup.save_megacache(report)
            else:
                report = warmup.run(_http(url, request_timeout, wait_timeout, served_model, retries, budget), chosen,
                                    parallel=parallel, progress=_note(), checkpoint=checkpoint)  # fmt: skip
    except KeyboardInterrupt as exc:  # SIGTERM (Terminated) or SIGINT: exits 143 or 130 (KcacheGroup)
        # Runs still under way (a request with minutes of deadline left) are not waited for.
        lingering.bound(before, 0.0)
        if root:  # a "running" marker nobody rewrites kept readiness waiting (for ever without --budget)
            _mark_failed(root, warmup.interrupted(entrypoint or url or "", last[-1] if last else None, exc),
                         on_failure, after)  # fmt: skip
        raise
    except Exception as exc:
        if root:  # readiness waits for a marker: one that never comes kept the pod unready whatever --on-failure
            failed = warmup.WarmupReport("failed", entrypoint or url or "", 0.0, (),
                                         error=one_line(str(exc)) or type(exc).__name__)  # fmt: skip
            _mark_failed(root, failed, on_failure, after)
        raise
    unwritable.clear()  # the last word on the marker is this one's
    marker = _write_marker(root, report, on_failure, unwritable, after_restore=after) if root else None
    if as_json:
        failure = _failure(report) if report.status != "ok" else {}
        failure.update({"marker_error": str(unwritable[-1]), "exit_code": int(ExitCode.ROOT)} if unwritable else {})
        doc = fmt.to_json({**_report_json(report), "marker": str(marker) if marker else None, **failure})
        # On a line of its own, in one write: the entrypoint's threads may still write to stdout, and text
        # without a line break (progress dots) made the report's line no JSON, and `kcache prebake`, which
        # reads it, called a warmup that succeeded failed. A leading line break is blank space to JSON.
        click.echo(f"\n{doc}" if entrypoint else doc)
    else:
        _print_report(report)
        click.echo(f"kcache: marker {marker}" if marker else "kcache: no readiness marker (no --root)")
    if unwritable:  # after the report (`kcache prebake` reads it, and publishes what the warmup compiled),
        if not as_json:  # which holds the error under --json: one document on stdout
            click.echo(f"kcache: error: {fmt.text(str(unwritable[-1]))}", err=True)
        raise click.exceptions.Exit(ExitCode.ROOT)
    if report.status != "ok":
        raise click.exceptions.Exit(ExitCode.WARMUP)


def _write_marker(root: Path, report: warmup.WarmupReport, on_failure: str, failures: list[RootError],
                  **kwargs) -> Path | None:  # fmt: skip
    """The marker written, or None with its error in `failures` (warned once): a full or read-only ROOT
    ended the warmup at its first checkpoint, with no report, and prebake published nothing it compiled."""
    try:
        return warmup.write_marker(root, report, on_failure, **kwargs)
    except RootError as exc:  # where the marker goes cannot be written
        if not failures:
            log.warning("%s; the warmup goes on, readiness cannot follow it", exc)
        failures[:] = [exc]
        return None


def _mark_failed(root: Path, failed: warmup.WarmupReport, on_failure: str, after) -> None:
    """A failed marker for a warmup that ended before its report (a profiles file that does not load, an
    entrypoint that does not import, a URL that is none, a signal); one that cannot be written is left out."""
    try:
        warmup.write_marker(root, failed, on_failure, after_restore=after)
    except KcacheError as write_error:
        log.warning("cannot write the warmup marker: %s", write_error)


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """While the block runs, whatever it writes to stdout goes to stderr: print() through sys.stdout,
    and C code (torch's, a compiler's) and child processes through file descriptor 1. `--json`
    promises one object on stdout, and `kcache prebake` reads that object from its child."""
    stdout = sys.stdout
    stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no fd 1 at all: nothing can reach it
        saved = None
    else:
        sys.stderr.flush()
        os.dup2(2, 1)
    try:
        with redirect_stdout(sys.stderr):  # sys.stdout need not be fd 1 (a test runner's capture)
            yield
    finally:
        stdout.flush()  # what the block wrote to the stream itself (sys.__stdout__) is stderr's too
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _report_json(report: warmup.WarmupReport) -> dict:
    # The target URL, and errors quoting it, may carry a password (http://user:pass@host).
    return redact_doc(json.loads(fmt.to_json(warmup.to_dict(report))))


def _failure(report: warmup.WarmupReport) -> dict:
    """What a failed warmup's --json object adds, as every command's error object has it: the first
    failure's text, a hint and the exit code (its `status` stays the report's "failed")."""
    first = report.error or next((f"profile {r.profile.name}: {r.error}" for r in report.failed), "")
    hint = "the warmup marker records it; kcache ready and /readyz follow --on-failure"
    return redact_doc({"error": first or "warmup failed", "hint": hint, "exit_code": int(ExitCode.WARMUP)})


def _print_report(report: warmup.WarmupReport) -> None:
    rows = [
        (r.profile.name, f"{r.profile.batch_size}x{r.profile.input_tokens}->{r.profile.output_tokens}",
         f"{len(r.latencies)}/{r.profile.repeats}", _secs(r.first), _secs(r.steady),
         "ok" if r.ok else f"FAILED: {redact_text(r.error)}")
        for r in report.results
    ]  # fmt: skip
    if rows:
        click.echo(fmt.table(("profile", "shape", "runs", "first", "steady", "result"), rows))
    if report.counters:
        c = report.counters
        click.echo(f"torch caches: fx graph {c['fxgraph_hit']} hit / {c['fxgraph_miss']} miss, "
                   f"aot autograd {c['aotautograd_hit']} hit / {c['aotautograd_miss']} miss")  # fmt: skip
    verdict = "ok" if report.status == "ok" else "FAILED"
    click.echo(f"kcache: warmup of {fmt.text(redact_text(report.target))}: {verdict}, {len(report.results)} profiles "
               f"in {fmt.seconds(report.seconds)}")  # fmt: skip
    if report.error:
        click.echo(f"kcache: error: {fmt.text(redact_text(report.error))}", err=True)
    for r in report.failed:
        click.echo(f"kcache: profile {fmt.text(r.profile.name)} failed: {fmt.text(redact_text(r.error))}", err=True)


def _secs(value: float | None) -> str:
    return "-" if value is None else fmt.seconds(value)


@click.command("prebake", epilog=PROFILES_HELP)
@target_options
@click.option("--root", required=True, type=NonEmptyPath(file_okay=False, path_type=Path), envvar="KCACHE_ROOT",
              help="Work directory: restored into, warmed up against, published from.")  # fmt: skip
@click.option("--signing-key", type=NonEmptyPath(dir_okay=False, path_type=Path), envvar="KCACHE_SIGNING_KEY",
              help="Sign the manifest with this key from `kcache keygen`.")  # fmt: skip
@click.option("--jobs", type=click.IntRange(1, 256), default=8, show_default=True, help="Parallel transfers.")
@allow_empty_option
@fingerprint_options
@store_options
@json_option
def prebake_cmd(entrypoint, url, profiles_file, parallel, request_timeout, wait_timeout, served_model, retries, budget,
                root,
                signing_key, jobs, allow_empty, model, model_config, facts, extras,
                store_url, index_url, s3_endpoint_url, as_json):  # fmt: skip
    """Warm up, then publish: the build-pipeline step that ships warm caches.

    With --entrypoint: restore into ROOT (a miss just lays it out), run the warmup in a child
    process with ROOT/kcache.env applied, then publish ROOT. With --url: the server must already
    run with ROOT's environment (`kcache restore --into ROOT`, then `. ROOT/kcache.env` before
    starting it); prebake warms it up and publishes ROOT. Nothing is published if a profile fails.
    With --signing-key, only a bundle that key signed is restored (another warms up cold), and a ROOT
    that holds another bundle's files (--url, or a kept ROOT) is refused (exit 9): publish would sign them.
    Use --fact to publish from a CPU-only builder under the production machine's fingerprint.

    \b
    Examples:
      kcache prebake --root /build/cache --entrypoint myservice.warm:run --model my-llm
      kcache prebake --root /cache --url http://127.0.0.1:8000 --model my-llm --fact gpu.sm=sm_90
    """
    _check_target(entrypoint, url)
    if entrypoint:
        if profiles_file:
            _profiles(profiles_file)  # fail here, before the restore, on a bad file
        warmer = ChildWarmup(entrypoint, profiles_file, parallel, timeout=budget or None)
    else:
        warmer = ServerWarmup(_http(url, request_timeout, wait_timeout, served_model, retries, budget),
                              _profiles(profiles_file), parallel)  # fmt: skip
    fp = compute_fingerprint(model, model_config, facts, extras)
    cfg = settings(store_url, index_url, s3_endpoint_url)
    store = open_configured_store(cfg, jobs=jobs, publisher=True)
    config = publish_config(cfg, jobs=jobs, signing_key=signing_key, allow_empty=allow_empty)
    index = binding.open_index(cfg, store, write=True)
    before = frozenset(threading.enumerate())
    try:
        result = prebake(store, index, fp, root, warmer, config=config, progress=None if as_json else _note())
    except KeyboardInterrupt:  # SIGTERM or SIGINT: requests still under way on a batch's threads are not waited for
        lingering.bound(before, 0.0)
        raise
    finally:
        index.close()
    if as_json:
        click.echo(fmt.to_json({
            "restore": {**asdict(result.restore), "donors": dict(result.restore.donors)} if result.restore else None,
            "warmup": _report_json(result.warmup),
            "publish": asdict(result.publish) if result.publish else None,
            **({"status": "error", **_failure(result.warmup)} if result.publish is None else {}),
        }))  # fmt: skip
    else:
        _print_report(result.warmup)
        if result.publish:
            p = result.publish
            verb = "published" if p.created else "unchanged (already published)"
            click.echo(f"kcache: {verb} bundle {p.bundle_id[:12]} for key {p.bundle_key}: {p.files} files, "
                       f"{fmt.size(p.bytes)}; {p.new_blobs} new blobs in {fmt.seconds(p.seconds)}")  # fmt: skip
    if result.publish is None:
        click.echo("kcache: warmup failed; nothing was published", err=True)
        raise click.exceptions.Exit(ExitCode.WARMUP)
