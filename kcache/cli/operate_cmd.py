"""Operator commands: `kcache yank`, `kcache verify`, `kcache gc`."""

from __future__ import annotations

from dataclasses import asdict

import click

from kcache import durations
from kcache.allocator import reuse_freed_memory
from kcache.cli import format as fmt
from kcache.cli import progress_bars
from kcache.cli.errors import ExitCode
from kcache.cli.options import (
    MAX_LIMIT,
    NonEmptyPath,
    bundle_id_prefix,
    json_option,
    load_signing_key,
    load_trusted_keys,
    opened,
    read_jobs_option,
    settings,
    store_options,
    trusted_key_option,
)
from kcache.errors import ConfigError

# kcache.gc.MIN_GRACE as --grace is written; not imported from there: `kcache --help` would pay for gc's imports.
MIN_GRACE_TEXT = "1h"


def ref_signing_key_option(fn):
    """--signing-key for commands that move refs (yank, gc): what they write, pods requiring signatures follow."""
    return click.option("--signing-key", type=NonEmptyPath(dir_okay=False), envvar="KCACHE_SIGNING_KEY",
                        help="Sign the refs this command moves with this key, so pods requiring signatures "
                             "follow them.")(fn)  # fmt: skip


@click.command("yank")
@click.argument("bundle")
@click.option("--undo", is_flag=True, help="Make a yanked bundle restorable again.")
@click.option("--reason", default="", help="Why, kept in the store beside the yank.")
@ref_signing_key_option
@store_options
@json_option
def yank_cmd(bundle, undo, reason, signing_key, store_url, index_url, s3_endpoint_url, as_json):
    """Stop a bundle from ever being restored again (pods restore the previous one, or start cold).

    --undo refuses a bundle whose manifest or packs the store has lost or cut short (pods would fail on it instead
    of taking the previous bundle): publish the same files again first.

    \b
    Examples:
      kcache yank 3f2a9c01bd47 --reason "NaNs on H100 after driver 560"
      kcache yank 3f2a9c01bd47 --undo
    """
    from kcache.yank import unyank, yank

    key = load_signing_key(signing_key)
    cfg = settings(store_url, index_url, s3_endpoint_url)
    bundle = bundle_id_prefix(bundle)
    with opened(cfg) as (store, index):
        changed = unyank(store, index, bundle, signer=key) if undo else yank(store, index, bundle, reason, signer=key)
    if as_json:
        click.echo(fmt.to_json({"bundle_id": changed.id, "status": changed.status}))
    else:
        click.echo(f"kcache: bundle {fmt.text(changed.id[:12])} is {'active again' if undo else 'yanked'}")


@click.command("verify")
@click.option("--read-data", is_flag=True, help="Also fetch every blob and re-hash it.")
@click.option("--subset", metavar="N/T", help="With --read-data, only the N-th of T slices of packs [default: 1/1].")
@read_jobs_option
@trusted_key_option("A .pub from `kcache keygen`: its signatures must verify, and every bundle needs one by a "
                   "trusted key; repeatable (env: ':'-separated, as restore reads it).")  # fmt: skip
@store_options
@json_option
def verify_cmd(read_data, subset, jobs, trusted_keys, store_url, index_url, s3_endpoint_url, as_json):
    """Check that every bundle's blobs exist (and, with --read-data, hash to their ids), its signatures, and refs/.

    Every signature must be well-formed; with --trusted-key (or KCACHE_TRUSTED_KEYS), those by trusted
    keys must verify and a bundle none of them signed is a problem. Every refs/<bundle-key> is checked
    as a pod restoring with --index none follows it: it must parse, and (with trusted keys) be signed,
    verify and be unexpired; the bundle it names must have its manifest, be neither yanked nor absent
    from the index. Every refs/layers/<layer>/<key> is checked as `restore --fallback layers` follows
    it: it must parse and lead to an active, unyanked bundle that gives that layer under that key.
    Reads nothing but the store and the index, and writes to neither.

    \b
    Exit codes (--json: "status"):
       0  ok        everything checked is sound
      12  damaged   problems found, each listed (they win over reads that failed)
       4  unchecked the store failed some reads (listed as "could not check"): run it again

    \b
    Examples:
      kcache verify
      kcache verify --trusted-key /secrets/prod-2026.pub
      kcache verify --read-data --subset 3/7    # a seventh of the packs, e.g. one slice per night
    """
    from kcache.verify import parse_subset, verify

    if subset is not None and not read_data:  # a nightly slice that reads nothing would report "ok" every night
        raise ConfigError("--subset", subset, "slices the packs --read-data reads; pass --read-data too")
    part = parse_subset("1/1" if subset is None else subset)
    trusted = load_trusted_keys(trusted_keys)
    reuse_freed_memory()  # --read-data streams every pack: see kcache.allocator
    with opened(settings(store_url, index_url, s3_endpoint_url), jobs=jobs, write=False) as (store, index):
        with progress_bars.bars(progress_bars.wanted(as_json) and read_data) as report:
            result = verify(store, index, read_data=read_data, subset=part, jobs=jobs, report=report,
                            trusted=trusted)  # fmt: skip
    if as_json:  # a failing exit prints the error object every command prints, with the report
        click.echo(fmt.to_json({"status": result.status, **asdict(result), **_verify_failure(result)}))
    else:
        read = f", read {result.blobs_read} blobs ({fmt.size(result.bytes_read)})" if read_data else ""
        unread = f"; could not check {len(result.unchecked)}" if result.unchecked else ""
        click.echo(f"kcache: checked {result.bundles} bundles, {result.refs} refs and {result.layer_refs} layer refs "
                   f"over {result.packs} packs{read}: {len(result.problems) or 'no'} problems{unread}")  # fmt: skip
        for problem in result.problems:
            click.echo(f"  {fmt.text(problem)}", err=True)
        for what in result.unchecked:
            click.echo(f"  could not check: {fmt.text(what)}", err=True)
    if result.problems:
        raise click.exceptions.Exit(ExitCode.PROBLEMS)
    if result.unchecked:  # not "sound": a CronJob must not read a store that failed its reads as a clean one
        raise click.exceptions.Exit(ExitCode.STORE)


@click.command("gc")
@click.option("--keep-last", type=click.IntRange(0, MAX_LIMIT), default=3, show_default=True,
              help="Newest active bundles kept per bundle key, however old.")  # fmt: skip
@click.option("--older-than", default="7d", show_default=True, metavar="DURATION",
              help="Only bundles older than this are deleted.")  # fmt: skip
@click.option("--grace", default="6h", show_default=True, metavar="DURATION",
              help="A condemned pack is deleted only after this long, so running publishes can revive it; "
                   f"at least {MIN_GRACE_TEXT}.")  # fmt: skip
@click.option("--allow-short-grace", is_flag=True,
              help=f"Take a --grace under {MIN_GRACE_TEXT}: only when no publish can run meanwhile (a publish "
                   "that revives a pack gc is sweeping may commit a bundle naming a deleted pack).")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Print the plan and the bytes it would free; change nothing.")
@ref_signing_key_option
@store_options
@json_option
def gc_cmd(keep_last, older_than, grace, allow_short_grace, dry_run, signing_key, store_url, index_url,
           s3_endpoint_url, as_json):  # fmt: skip
    """Delete old bundles and the packs nobody needs, in two phases that are safe while publishes run.

    A first run condemns unreferenced packs; a run after --grace deletes those still condemned.

    \b
    Examples:
      kcache gc --dry-run
      kcache gc --keep-last 2 --older-than 14d --grace 12h
    """
    from kcache import binding, gc
    from kcache.errors import IndexDbError

    policy = gc.Policy(keep_last, durations.parse(older_than, "--older-than"), durations.parse(grace, "--grace"))
    if policy.grace < gc.MIN_GRACE and not allow_short_grace:
        raise ConfigError("--grace", grace, f"is shorter than {MIN_GRACE_TEXT}, the least a publish running meanwhile "
                          "may need between reviving a pack and committing the bundle that names it; pass "
                          "--allow-short-grace if no publish can run")  # fmt: skip
    key = load_signing_key(signing_key)
    cfg = settings(store_url, index_url, s3_endpoint_url)
    if not cfg.index_explicit and binding.missing_sqlite_file(cfg.index_url):  # (a named one: `opened` says so)
        # An empty index is no index of this store: to it every manifest is an orphan.
        raise IndexDbError(cfg.index_url, f"{binding.sqlite_path(cfg.index_url)} does not exist; gc needs the "
                                          "index this store's publishers use")  # fmt: skip
    # A dry run opens as a reader: it neither binds the index nor names the store.
    with opened(cfg, write=not dry_run) as (store, index):
        plan = gc.plan(store, index, policy)
        result = None if dry_run else gc.execute(store, index, plan, signer=key)
    summary = {
        "dry_run": dry_run, "bundles_to_delete": [b.id for b in plan.delete_bundles],
        "packs_to_condemn": len(plan.condemn), "packs_to_delete": len(plan.sweep),
        "packs_in_grace": len(plan.waiting), "orphans": [o.key for o in plan.orphans],
        "orphan_packs_to_condemn": [o.key for o in plan.adopt],
        "broken_bundles": [b.id for b in plan.broken], "leftovers": [left.key for left in plan.leftovers],
        "yanked_without_rows": list(plan.yanked_without_rows),
        "half_yanked": [bundle_id for _key, bundle_id in plan.half_yanked],
        "bytes_to_free": plan.bytes_freed, "result": asdict(result) if result else None,
    }  # fmt: skip
    if as_json:
        click.echo(fmt.to_json(summary))
        return
    verb = "would" if dry_run else "will"
    click.echo(f"kcache gc plan: delete {len(plan.delete_bundles)} bundles; "
               f"condemn {len(plan.condemn)} packs and {len(plan.adopt)} orphan packs; "
               f"delete {len(plan.sweep)} condemned packs and {len(plan.orphans)} orphan objects; "
               f"remove {len(plan.leftovers)} unfinished writes "
               f"({verb} free {fmt.size(plan.bytes_freed)}); {len(plan.waiting)} packs wait out --grace")  # fmt: skip
    for bundle in plan.delete_bundles:
        click.echo(f"  bundle {bundle.id[:12]} {fmt.text(bundle.model or '-')} {fmt.when(bundle.created_at)} "
                   f"{fmt.text(bundle.status)}")  # fmt: skip
    for bundle in plan.broken:
        click.echo(f"  broken bundle {bundle.id[:12]} {fmt.text(bundle.model or '-')}: its manifest is missing "
                   "or does not verify, so no pack is deleted; publish it again, or yank it "
                   "(then it holds nothing back, and gc deletes it after --older-than)")  # fmt: skip
    for bundle_id in plan.yanked_without_rows:
        click.echo(f"  yanked bundle {bundle_id[:12]} has no row in this index: kept with its packs; is the index "
                   "behind the publishers'? `kcache reindex` brings its row back (yanked)")  # fmt: skip
    for _key, bundle_id in plan.half_yanked:
        click.echo(f"  bundle {bundle_id[:12]} is active in the index but yanked in the store (a yank or "
                   "`yank --undo` cut off?): kept, with what it falls back to; run that yank again")  # fmt: skip
    if result:
        click.echo(f"kcache gc: deleted {result.bundles_deleted} bundles, {result.packs_deleted} packs, "
                   f"{result.orphans_deleted} orphans, {result.leftovers_removed} unfinished writes; "
                   f"freed {fmt.size(result.bytes_freed)}")  # fmt: skip
    if result and result.bundles_kept:
        click.echo(f"kcache gc: kept {result.bundles_kept} planned bundles (yanks or publishes since the plan); "
                   "packs are condemned and deleted on the next run")  # fmt: skip


def _verify_failure(result) -> dict:
    """error, hint and exit_code for a verify that exits non-zero (damage wins over reads that failed)."""
    if result.problems:
        return {"error": f"{len(result.problems)} problems found (listed in problems)",
                "hint": "re-publish or yank the bundles named; `kcache reindex` rebuilds rows the index lost",
                "exit_code": int(ExitCode.PROBLEMS)}  # fmt: skip
    if result.unchecked:
        return {"error": f"the store failed {len(result.unchecked)} reads (listed in unchecked)",
                "hint": "run it again once the store answers", "exit_code": int(ExitCode.STORE)}  # fmt: skip
    return {}
