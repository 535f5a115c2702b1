"""`kcache fingerprint`: this machine's facts and keys."""

from __future__ import annotations

import click

from kcache.cli import format as fmt
from kcache.cli.options import compute_fingerprint, fingerprint_options, json_option


@click.command("fingerprint")
@fingerprint_options
@json_option
def fingerprint_cmd(model, model_config, facts, extras, as_json):
    """Print this machine's facts and the keys kcache files caches under.

    Answers in well under a second and never imports torch or triton. With --facts-file, also
    lists the facts on which the file and what this machine sees disagree (restore then misses).

    \b
    Examples:
      kcache fingerprint --model meta-llama/Llama-3.1-8B --json
      kcache fingerprint --fact gpu.sm=sm_90 --fact gpu.name="NVIDIA H100 80GB HBM3"
    """
    fp = compute_fingerprint(model, model_config, facts, extras)
    if as_json:
        click.echo(fmt.to_json(fp.as_dict()))
        return
    echo_fingerprint(fp)


def echo_fingerprint(fp) -> None:
    """Keys, then facts, as `kcache fingerprint` and `kcache explain` print them."""
    click.echo(f"bundle key     {fp.bundle_key}")
    click.echo(f"toolchain key  {fp.toolchain_key}")
    click.echo(f"workload key   {fp.workload_key}")
    click.echo()
    click.echo(fmt.table(["fact", "value"], sorted(fp.facts.items())))
    if fp.mismatches:
        click.echo()
        click.echo(f"{fp.contradicted} disagrees with this machine (restore will miss, publish refuses):")
        rows = [(m.fact, "(absent)" if m.claimed is None else m.claimed, m.probed) for m in fp.mismatches]
        click.echo(fmt.table(["fact", fp.contradicted.removeprefix("the "), "this machine"], rows))
