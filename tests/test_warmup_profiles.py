"""Hostile warmup profiles files that `kcache warmup` must refuse with a clear error, never a traceback."""

import pytest
from click.testing import CliRunner

from kcache import profiles
from kcache.cli import main
from kcache.profiles import ProfileError

SELF_HOLDING = [
    "profiles: &a [*a]\n",
    "x: &a {y: *a}\nprofiles: [{name: p, batch_size: 1, input_tokens: 1, output_tokens: 1}]\n",
    "profiles:\n  - &p {name: p, batch_size: 1, input_tokens: 1, output_tokens: 1, more: [*p]}\n",
]


@pytest.mark.parametrize("text", SELF_HOLDING)
def test_an_alias_to_its_own_container_is_a_clear_error(text):
    with pytest.raises(ProfileError, match="alias refers to a node that contains it"):
        profiles.parse_yaml(text, "p.yaml")


def test_the_cli_refuses_a_self_holding_alias_with_exit_2(tmp_path):
    path = tmp_path / "profiles.yaml"
    path.write_text(SELF_HOLDING[0])
    result = CliRunner().invoke(main, ["warmup", "--entrypoint", "x:y", "--profiles", str(path)],
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "alias refers to a node that contains it" in result.stderr
