"""`kcache restore`: the init container's step. Fail-open unless --strict."""

from __future__ import annotations

import os
import time
from pathlib import Path

import click

from kcache.catalog import open_for_restore
from kcache.cli import format as fmt
from kcache.cli import progress_bars
from kcache.cli.errors import ExitCode, describe
from kcache.cli.options import (
    compute_fingerprint,
    fingerprint_options,
    json_option,
    load_trusted_keys,
    settings,
    store_options,
)
from kcache.restore import restore
from kcache.store import open_store


@click.command("restore")
@click.option("--into", "root", required=True, type=click.Path(path_type=Path),
              help="Restore root, e.g. an emptyDir shared with the model container.")  # fmt: skip
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              envvar="KCACHE_RESTORE_TIMEOUT", help="Seconds before giving up and starting cold.")  # fmt: skip
@click.option("--bundle", "bundle_id", metavar="ID",
              help="Pin this bundle (full id) instead of the newest; it must still match the fingerprint.")  # fmt: skip
@click.option("--trusted-key", "trusted_keys", multiple=True, type=click.Path(dir_okay=False, path_type=Path),
              envvar="KCACHE_TRUSTED_KEYS", help="A .pub from `kcache keygen`; repeatable (env: ':'-separated).",
              )  # fmt: skip
@click.option("--require-signature", is_flag=True, envvar="KCACHE_REQUIRE_SIGNATURE",
              help="Refuse bundles not signed by a trusted key.")  # fmt: skip
@click.option("--fallback", type=click.Choice(["toolchain"]),
              help="On a miss, restore the kernel layers (inductor, triton, cuda) of the newest bundle built "
                   "on this toolchain for another workload.")  # fmt: skip
@click.option("--strict", is_flag=True, help="Exit non-zero on a miss (10; 15 when the facts file contradicts this "
              "machine) or an error instead of starting cold.")
@click.option("--jobs", type=click.IntRange(1, 256), default=16, show_default=True, help="Parallel pack reads.")
@fingerprint_options
@store_options(index_none=True)
@json_option
def restore_cmd(root, timeout, bundle_id, trusted_keys, require_signature, fallback, strict, jobs,
                model, model_config, facts, extras, store_url, index_url, s3_endpoint_url, as_json):  # fmt: skip
    """Lay the bundle that matches this machine into ROOT and write ROOT/kcache.env.

    On a miss, ROOT still gets empty layer directories and kcache.env, so the cold pod's compile
    lands where `kcache publish --from ROOT` will find it. Any failure prints one line and exits 0
    (the pod starts cold) unless --strict. Never imports torch.

    With --index none (or no index named and no local one), the bundle is found through the
    store's refs/, so the pod needs only read access to the bucket.

    \b
    Examples:
      kcache restore --into /cache --model my-llm && . /cache/kcache.env
      kcache restore --into /cache --strict --timeout 60 --json
    """
    started = time.perf_counter()
    try:
        fp = compute_fingerprint(model, model_config, facts, extras)
        trusted = load_trusted_keys(trusted_keys)
        cfg = settings(store_url, index_url, s3_endpoint_url)
        store = open_store(cfg.store_url, endpoint_url=cfg.s3_endpoint_url, jobs=jobs)
        index = open_for_restore(cfg, store)
        try:
            with progress_bars.bars(progress_bars.wanted(as_json)) as report:
                result = restore(store, index, fp, root, jobs=jobs, timeout=timeout, bundle_id=bundle_id,
                                 trusted=trusted, require_signature=require_signature, fallback=fallback,
                                 report=report)  # fmt: skip
        finally:
            index.close()
    except Exception as exc:  # noqa: BLE001 - an init container must never crash-loop on a kcache bug
        if os.environ.get("KCACHE_DEBUG") == "1":
            raise
        _report_error(exc, strict, as_json, time.perf_counter() - started)
        return
    payload = {
        "status": result.status, "bundle_key": result.bundle_key, "bundle_id": result.bundle_id,
        "files": result.files, "bytes": result.bytes, "seconds": round(result.seconds, 4),
        "reason": result.reason, "root": str(result.root), "env_file": str(result.env_file),
        "layers": list(result.layers),
        "signed_by": result.signed_by,
    }  # fmt: skip
    if as_json:
        click.echo(fmt.to_json(payload))
    elif result.status in ("hit", "partial"):
        what = "partial hit: restored the kernel layers of" if result.status == "partial" else "hit: restored"
        click.echo(f"kcache: {what} bundle {result.bundle_id[:12]} ({result.files} files, "
                   f"{fmt.size(result.bytes)}) into {result.root} in {fmt.seconds(result.seconds)}; "
                   f"source {result.env_file}")  # fmt: skip
    else:
        click.echo(f"kcache: miss: {result.reason} (key {result.bundle_key}); starting cold. "
                   f"Source {result.env_file}, then `kcache publish --from {result.root}` after warmup.")  # fmt: skip
    if strict and result.status == "miss":
        raise click.exceptions.Exit(ExitCode.FACTS_DISAGREE if fp.mismatches else ExitCode.MISS)


def _report_error(exc: Exception, strict: bool, as_json: bool, seconds: float) -> None:
    message, hint, code = describe(exc)
    if as_json:
        click.echo(fmt.to_json({"status": "error", "bundle_id": None, "files": 0, "bytes": 0,
                                "seconds": round(seconds, 4), "reason": message, "error": message, "hint": hint,
                                "exit_code": int(code) if strict else 0}))  # fmt: skip
    action = "failing (--strict)" if strict else "starting cold"
    click.echo(f"kcache: restore failed, {action}: {message}", err=True)
    click.echo(f"  hint: {hint}", err=True)
    if strict:
        raise click.exceptions.Exit(code)
