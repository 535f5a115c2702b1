"""`kcache explain`: why this machine hits or misses, and which facts separate it from a bundle."""

from __future__ import annotations

import logging
from dataclasses import replace

import click

from kcache import explain, refs
from kcache.cli import format as fmt
from kcache.cli.fingerprint_cmd import echo_fingerprint
from kcache.cli.options import (
    compute_fingerprint,
    fingerprint_options,
    json_option,
    open_configured_store,
    opened,
    settings,
    store_options,
)
from kcache.errors import KcacheError

# How many of the newest bundles to compare (and as many again of this model): the nearest
# bundle is almost always recent, and comparing facts is cheap.
SCAN = 500
log = logging.getLogger(__name__)
ABSENT = "(absent)"


@click.command("explain")
@click.option("--limit", type=click.IntRange(1, 2 * SCAN), default=3, show_default=True,
              help="On a miss, show this many of the nearest bundles.")  # fmt: skip
@fingerprint_options
@store_options
@json_option
def explain_cmd(limit, model, model_config, facts, extras, store_url, index_url, s3_endpoint_url, as_json):
    """Explain a hit or a miss: this machine's facts and keys, and on a miss the nearest bundles.

    For each near bundle, lists the facts that differ (this machine's value, the bundle's value),
    split into toolchain and workload facts, with a one-line verdict. With --facts-file, also the
    facts on which the file and this machine disagree (restore then misses). The answer to "why
    did my pod start cold?". Pass the same --model/--fact/--extra/--facts-file as the restore did.

    \b
    Examples:
      kcache explain --model my-llm
      kcache explain --model my-llm --fact cpu.isa=avx512 --json
      kcache explain --model my-llm --facts-file /etc/kcache-facts/facts.json
    """
    fp = compute_fingerprint(model, model_config, facts, extras)
    cfg = settings(store_url, index_url, s3_endpoint_url)
    with opened(cfg, store=False, write=False) as (_, index):
        bundles = index.list_bundles(limit=SCAN)
        bundles += index.list_bundles(model=fp.facts.get("model.id"), limit=SCAN)
        newest = index.newest_bundle(fp.bundle_key)  # may be older than the scanned window
        if newest is not None:
            bundles.append(newest)
    result = explain.explain(fp.facts, bundles, limit=limit, mismatches=fp.mismatches)
    marked = result.hit.id if result.hit is not None and _yank_marker(cfg, result.hit.id) else None
    if marked:  # restore refuses it whatever the index says (kcache.choice), and takes no other bundle
        result = replace(result, hit=None)
    per_layer = () if result.hit else explain.layer_verdicts(fp, bundles)
    if as_json:
        click.echo(fmt.to_json({**_as_json(result), "yanked_in_store": marked, "layers": [
            {"layer": v.layer, "key": v.key, "donor": v.donor, "differing": list(v.differing), "verdict": v.verdict}
            for v in per_layer]}))  # fmt: skip
        return
    if marked:
        echo_fingerprint(fp)
        click.echo()
        click.echo(f"miss: bundle {marked[:12]}, the index's newest for bundle key {fp.bundle_key}, has a yank marker "
                   f"in the store ({refs.yank_key(marked)}), which restore obeys whatever the index says; "
                   f"`kcache yank {marked[:12]}` makes the index agree, and restore then takes the bundle "
                   "before it")  # fmt: skip
        return
    _echo(fp, result, per_layer)


def _yank_marker(cfg, bundle_id: str) -> bool:
    """Whether the store holds `bundle_id`'s yank marker; False (with a warning) when it cannot say."""
    try:
        return open_configured_store(cfg).exists(refs.yank_key(bundle_id))
    except KcacheError as exc:
        log.warning("cannot look for a yank marker in the store: %s", exc)
        return False


def _echo(fp, result: explain.Explanation, per_layer) -> None:
    echo_fingerprint(fp)
    click.echo()
    if result.hit is not None:
        b = result.hit
        click.echo(f"hit: bundle {b.id[:12]} ({b.files} files, {fmt.size(b.bytes)}, created {fmt.when(b.created_at)} "
                   f"UTC by {fmt.text(b.created_by)}) matches; `kcache restore` lays it down.")  # fmt: skip
        return
    if result.mismatches:
        click.echo(f"miss: {fmt.text(fp.mismatch_reason())}; restore misses whatever the index holds")
    if not result.nearest:
        click.echo("miss: the index holds no bundles; run `kcache publish` after a warmup")
        return
    lead = "" if result.mismatches else f"miss: no active bundle for bundle key {fp.bundle_key}; "
    click.echo(f"{lead}nearest of {result.considered} bundles:")
    for n, cand in enumerate(result.nearest, 1):
        b = cand.bundle
        click.echo()
        click.echo(f"{n}. bundle {b.id[:12]}  model {fmt.text(b.model or '-')}  created {fmt.when(b.created_at)} UTC  "
                   f"{fmt.text(b.status)}  {len(cand.differences)} fact(s) differ")  # fmt: skip
        rows = [(d.group, d.name, _value(d.here), _value(d.bundle)) for d in cand.differences]
        if rows:
            table = fmt.table(["group", "fact", "this machine", "bundle"], rows)
            click.echo("\n".join("   " + line for line in table.splitlines()))
        click.echo(f"   verdict: {fmt.text(cand.verdict)}")
    click.echo()
    if result.mismatches:
        click.echo("per layer: `kcache restore --fallback layers` reuses no layer: "
                   f"{fp.contradicted} does not describe this machine")  # fmt: skip
        return
    click.echo("per layer (what `kcache restore --fallback layers` would reuse):")
    for v in per_layer:
        click.echo(f"   {v.layer:<13} {fmt.text(v.verdict)}")


def _value(v: str | None) -> str:
    return ABSENT if v is None else v


def _bundle(b) -> dict:
    return fmt.bundle_json(b, fields=("bundle_key", "toolchain_key", "workload_key", "model", "created_at",
                                      "created_by", "status", "files", "bytes", "compile_seconds"))  # fmt: skip


def _difference(d: explain.FactDiff) -> dict:
    doc = {"fact": d.name, "here": d.here, "bundle": d.bundle}
    if d.here_only is not None:  # a set-valued fact (cpu.features): which members differ, not only both lists
        doc.update(here_only=list(d.here_only), bundle_only=list(d.bundle_only or ()))
    return doc


def _as_json(result: explain.Explanation) -> dict:
    nearest = [
        {
            "bundle": _bundle(c.bundle),
            "verdict": c.verdict,
            "differences": {
                group: [_difference(d) for d in c.group(group)] for group in (explain.TOOLCHAIN, explain.WORKLOAD)
            },
        }
        for c in result.nearest
    ]
    return {
        **result.fingerprint.as_dict(),
        "status": "hit" if result.hit else "miss",
        "hit": _bundle(result.hit) if result.hit else None,
        "considered": result.considered,
        "nearest": nearest,
    }
