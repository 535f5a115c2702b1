"""Warmup profiles from YAML and TOML: defaults, parsing, and errors that say where."""

import os

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


# ---- hostile files --------------------------------------------------------------------------------

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
)


def test_a_device_is_refused_before_reading(tmp_path):
    (tmp_path / "zero.yaml").symlink_to("/dev/zero")
    with pytest.raises(ProfileError, match="not a regular file"):
        profiles.load(tmp_path / "zero.yaml")


def test_a_fifo_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "p.yaml")
    with pytest.raises(ProfileError, match="not a regular file"):
        profiles.load(tmp_path / "p.yaml")


def test_a_directory_is_refused(tmp_path):
    (tmp_path / "d.yaml").mkdir()
    with pytest.raises(ProfileError, match="not a regular file"):
        profiles.load(tmp_path / "d.yaml")


def test_a_file_over_the_size_cap_is_refused(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(YAML + "#" * profiles.MAX_FILE_BYTES)
    with pytest.raises(ProfileError, match="over the 1048576-byte limit"):
        profiles.load(path)


def test_billion_laughs_in_a_field_value_is_refused_with_a_short_message():
    text = (
        LAUGHS.replace("a: &a", "x: &a")
        + "profiles:\n  - {name: p, batch_size: *i, input_tokens: 1, output_tokens: 1}\n"
    )
    with pytest.raises(ProfileError) as caught:
        profiles.parse_yaml(text, "p.yaml")
    assert "aliases expand to more than" in str(caught.value) and len(str(caught.value)) < 300


def test_a_list_value_is_described_not_printed():
    with pytest.raises(ProfileError) as caught:
        profiles.parse_yaml("profiles:\n  - {name: p, batch_size: [1, 2, 3], input_tokens: 1, output_tokens: 1}\n")
    assert str(caught.value).endswith("batch_size must be a positive integer (got a list)")


def test_merge_keys_and_a_few_aliases_still_work():
    text = "base: &base {input_tokens: 8, output_tokens: 2}\nprofiles:\n  - {<<: *base, name: a, batch_size: 1}\n"
    with pytest.raises(ProfileError, match="unknown top-level key 'base'"):  # aliases parse; the key is unknown
        profiles.parse_yaml(text)


@pytest.mark.parametrize("parse, text", [
    (profiles.parse_yaml, "profiles: " + "[" * 5000 + "]" * 5000 + "\n"),
    (profiles.parse_toml, "profiles = " + "[" * 5000 + "]" * 5000 + "\n"),
])  # fmt: skip
def test_deep_nesting_is_a_clear_error(parse, text):
    with pytest.raises(ProfileError, match="nested too deeply"):
        parse(text)


@pytest.mark.parametrize("parse, text", [
    (profiles.parse_toml, TOML.replace("batch_size = 8", "batch_size = " + "1" * 4400)),
    (profiles.parse_yaml, YAML.replace("batch_size: 8", "batch_size: " + "1" * 4400)),
])  # fmt: skip
def test_a_4400_digit_integer_is_a_clear_error(parse, text):
    with pytest.raises(ProfileError) as caught:
        parse(text)
    assert "number" in str(caught.value) and len(str(caught.value)) < 300


FIRST = {"batch_size": 1, "input_tokens": 512, "output_tokens": 64, "repeats": 3}


@pytest.mark.parametrize("field, limit", sorted(profiles.LIMITS.items()))
def test_upper_bounds_are_named_in_the_error(field, limit):
    def with_value(value):
        return YAML.replace(f"    {field}: {FIRST[field]}\n", f"    {field}: {value}\n", 1)

    with pytest.raises(ProfileError) as caught:
        profiles.parse_yaml(with_value(10**12))
    assert str(caught.value).endswith(f"{field} must be at most {limit} (got 1000000000000)")
    assert profiles.parse_yaml(with_value(limit))[0] == Profile("chat", **{**FIRST, field: limit})


def test_a_long_name_is_refused():
    with pytest.raises(ProfileError, match="name must be at most 200 characters"):
        profiles.parse_yaml(YAML.replace("name: chat", "name: " + "n" * 5000))


def test_too_many_profiles_is_refused():
    text = "profiles:\n" + "".join(
        f"  - {{name: p{i}, batch_size: 1, input_tokens: 1, output_tokens: 1}}\n"
        for i in range(profiles.MAX_PROFILES + 1)
    )
    with pytest.raises(ProfileError, match=f"at most {profiles.MAX_PROFILES} profiles"):
        profiles.parse_yaml(text)
