"""Warmup profiles from YAML and TOML: defaults, parsing, and errors that say where."""

import pytest
from click.testing import CliRunner

from kcache import profiles
from kcache.cli import main
from kcache.errors import ConfigError
from kcache.profiles import Profile, ProfileError

YAML = """\
profiles:
  - name: chat
    batch_size: 1
    input_tokens: 512
    output_tokens: 64
    repeats: 3
  - name: burst
    batch_size: 8
    input_tokens: 128
    output_tokens: 16
"""

TOML = """\
[[profiles]]
name = "chat"
batch_size = 1
input_tokens = 512
output_tokens = 64
repeats = 3

[[profiles]]
name = "burst"
batch_size = 8
input_tokens = 128
output_tokens = 16
"""

EXPECTED = (Profile("chat", 1, 512, 64, 3), Profile("burst", 8, 128, 16, 1))


def test_defaults_are_the_documented_five():
    assert [(p.name, p.batch_size, p.input_tokens, p.output_tokens, p.repeats) for p in profiles.DEFAULTS] == [
        ("single-short", 1, 128, 50, 3),
        ("single-long", 1, 4096, 100, 2),
        ("batch-mid", 4, 512, 100, 5),
        ("batch-large", 8, 256, 50, 3),
        ("batch-max", 16, 128, 30, 2),
    ]


@pytest.mark.parametrize("name, text", [("p.yaml", YAML), ("p.yml", YAML), ("p.toml", TOML)])
def test_files_parse_to_the_same_profiles(tmp_path, name, text):
    (tmp_path / name).write_text(text)
    assert profiles.load(tmp_path / name) == EXPECTED


def test_toml_inline_tables_parse_too():
    text = 'profiles = [{name = "a", batch_size = 2, input_tokens = 8, output_tokens = 4}]'
    assert profiles.parse_toml(text) == (Profile("a", 2, 8, 4, 1),)


@pytest.mark.parametrize(
    "field, value, line",
    [("batch_size", "0", 8), ("input_tokens", "-5", 9), ("output_tokens", "many", 10), ("repeats", "true", 11)],
)
def test_yaml_bad_value_names_line_profile_and_field(field, value, line):
    text = YAML.replace("    output_tokens: 16\n", "    output_tokens: 16\n    repeats: 1\n")
    lines = text.splitlines()
    index = next(i for i, t in enumerate(lines) if i >= 6 and t.strip().startswith(field + ":"))
    lines[index] = f"    {field}: {value}"
    with pytest.raises(ProfileError) as caught:
        profiles.parse_yaml("\n".join(lines), "profiles.yaml")
    assert str(caught.value).startswith(f"profiles.yaml:{line}: profile 2 (burst): {field} must be a positive integer")
    assert caught.value.field == field and caught.value.line == line
    assert isinstance(caught.value, ConfigError)


def test_toml_bad_value_names_line_profile_and_field():
    with pytest.raises(ProfileError) as caught:
        profiles.parse_toml(TOML.replace("batch_size = 8", "batch_size = 0"), "profiles.toml")
    assert str(caught.value) == "profiles.toml:10: profile 2 (burst): batch_size must be a positive integer (got 0)"


def test_toml_syntax_error_names_line():
    with pytest.raises(ProfileError) as caught:
        profiles.parse_toml(TOML.replace('name = "burst"', "name = burst"), "profiles.toml")
    assert caught.value.line == 9 and "not valid TOML" in str(caught.value)


def test_yaml_syntax_error_names_line():
    with pytest.raises(ProfileError) as caught:
        profiles.parse_yaml(YAML.replace("    batch_size: 8", "   batch_size: [8"), "profiles.yaml")
    assert caught.value.line is not None and "not valid YAML" in str(caught.value)


@pytest.mark.parametrize(
    "edit, message",
    [
        (("    repeats: 3\n", "    repeats: 3\n    batchsize: 2\n"), "profile 1 (chat): unknown field 'batchsize'"),
        (("    input_tokens: 128\n", ""), "profile 2 (burst): input_tokens is missing"),
        (("name: burst", "name: chat"), "profile 2 (chat): duplicate name 'chat'"),
        (("name: burst", "name: ''"), "profile 2: name must be a non-empty string"),
        (("profiles:", "profile:"), "expected a top-level 'profiles' list"),
    ],
)
def test_structural_errors_say_what(edit, message):
    with pytest.raises(ProfileError) as caught:
        profiles.parse_yaml(YAML.replace(*edit), "p.yaml")
    assert message in str(caught.value)


def test_empty_list_and_unknown_extension(tmp_path):
    with pytest.raises(ProfileError, match="non-empty list"):
        profiles.parse_yaml("profiles: []\n")
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(ProfileError, match="unknown format"):
        profiles.load(tmp_path / "p.json")


def test_cli_shows_the_error_with_its_hint_and_exit_code(tmp_path):
    path = tmp_path / "profiles.yaml"
    path.write_text(YAML.replace("batch_size: 8", "batch_size: 0"))
    result = CliRunner().invoke(main, ["warmup", "--url", "http://127.0.0.1:9", "--profiles", str(path)])
    assert result.exit_code == 2
    assert f"{path}:8: profile 2 (burst): batch_size must be a positive integer" in result.output
    assert "hint: fix the profiles file" in result.output
