"""`kcache keygen`: an Ed25519 key pair for signing manifests."""

from __future__ import annotations

from pathlib import Path

import click

from kcache.cli import format as fmt
from kcache.cli.options import NonEmptyPath, json_option


@click.command("keygen")
@click.argument("name")
@click.option("--dir", "directory", type=NonEmptyPath(file_okay=False, path_type=Path), default=Path("."),
              show_default=True, help="Where to write NAME.key (mode 0600) and NAME.pub.")  # fmt: skip
@json_option
def keygen_cmd(name, directory, as_json):
    """Make a named Ed25519 key pair: NAME.key signs, NAME.pub verifies.

    Keys are named so they can be rotated: publish with the new key, trust both .pub files
    in the pods, then retire the old one.

    \b
    Example:
      kcache keygen prod-2026 --dir /secrets
      kcache publish --signing-key /secrets/prod-2026.key ...
      kcache restore --trusted-key /secrets/prod-2026.pub --require-signature ...
    """
    from kcache.signing import generate

    private, public = generate(name, directory)
    if as_json:
        click.echo(fmt.to_json({"status": "ok", "name": name, "private_key": str(private), "public_key": str(public)}))
    else:
        click.echo(f"kcache: wrote {private} (keep it secret) and {public} (give it to pods)")
