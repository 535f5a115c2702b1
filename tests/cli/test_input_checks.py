"""Flag values kcache cannot use are one-line usage errors (exit 2), never a traceback, an exit 70,
the current directory, an empty index or invalid JSON. Each test names the input a reviewer found."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from trees import write_tree

from kcache import durations, sources
from kcache.cli import format as fmt
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.errors import ConfigError
from kcache.index import Event, Index

BUNDLE_KEY = "0123456789abcdef0123456789abcdef"


def run(*args, code: int | None = 0, env: dict | None = None):
    result = CliRunner().invoke(main, [str(a) for a in args], env=env, catch_exceptions=False)
    if code is not None:
        assert result.exit_code == code, result.output + result.stderr
    assert "Traceback" not in result.output + result.stderr
    return result


def strict_json(text: str):
    """JSON as a strict parser reads it: NaN and Infinity are not JSON."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def names(directory: Path) -> list[str]:
    """What a command left in `directory` (the test's KCACHE_HOME aside)."""
    return sorted(p.name for p in directory.iterdir() if p.name != "kcache-home")


def published(tmp_path: Path, *more) -> dict:
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph", "triton/k/kernel.cubin": b"\x7fELF"})
    return json.loads(run("publish", "--from", tmp_path / "src", "--model", "m", "--json", *more).stdout)


# ---- 1. an empty path is no path ------------------------------------------------------------------


def test_restore_into_empty_is_refused_and_leaves_the_current_directory_alone(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_tree(tmp_path, {"inductor/keep": b"mine"})
    result = run("restore", "--into", "", "--model", "A", code=ExitCode.USAGE)
    assert "is an empty path" in result.stderr
    assert (tmp_path / "inductor/keep").read_bytes() == b"mine"
    assert not (tmp_path / "kcache.env").exists() and not (tmp_path / "triton").exists()


def test_restore_into_empty_under_json_is_one_error_object(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = json.loads(run("restore", "--into", "", "--json", code=ExitCode.USAGE).stdout)
    assert doc["status"] == "error" and doc["exit_code"] == 2 and "--into" in doc["error"]
    assert not (tmp_path / "kcache.env").exists()


EMPTY_PATHS = {
    "publish --from": ["publish", "--from", "", "--model", "m"],
    "publish --signing-key": ["publish", "--from", "{tmp}/src", "--model", "m", "--signing-key", ""],
    "prefetch --node-cache": ["prefetch", "--node-cache", "", "--model", "m", "--once"],
    "warmup --root": ["warmup", "--root", "", "--url", "http://127.0.0.1:1"],
    "warmup --profiles": ["warmup", "--profiles", "", "--url", "http://127.0.0.1:1"],
    "prebake --root": ["prebake", "--root", "", "--url", "http://127.0.0.1:1"],
    "ready --root": ["ready", "--root", ""],
    "serve --root": ["serve", "--root", "", "--port", "0"],
    "watch --root": ["watch", "--root", "", "--once"],
    "proxy --root": ["proxy", "--root", "", "--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9",
                     "--port", "0"],
    "config --root": ["config", "--root", ""],
    "keygen --dir": ["keygen", "k", "--dir", ""],
    "refresh --signing-key": ["refresh", "--signing-key", ""],
    "yank --signing-key": ["yank", "abcdef", "--signing-key", ""],
    "fingerprint --facts-file": ["fingerprint", "--facts-file", ""],
    "fingerprint --model-config": ["fingerprint", "--model-config", ""],
}  # fmt: skip


@pytest.mark.parametrize("case", list(EMPTY_PATHS))
def test_an_empty_path_flag_is_a_usage_error(tmp_path, monkeypatch, case):
    monkeypatch.chdir(tmp_path)
    write_tree(tmp_path, {"src/inductor/a": b"a", "inductor/keep": b"mine"})
    result = run(*(a.format(tmp=tmp_path) for a in EMPTY_PATHS[case]), code=ExitCode.USAGE)
    assert "is an empty path" in result.stderr, result.stderr
    assert names(tmp_path) == ["inductor", "src"]


def test_restore_with_an_empty_node_cache_starts_cold_unless_strict(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "r"
    run("restore", "--into", root, "--node-cache", "", "--model", "m")
    assert json.loads((root / ".kcache-state.json").read_text())["status"] == "error"
    run("restore", "--into", tmp_path / "s", "--node-cache", "", "--model", "m", "--strict", code=ExitCode.USAGE)
    assert names(tmp_path) == ["r", "s"]


def test_an_empty_environment_value_means_unset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = run("ready", code=ExitCode.USAGE, env={"KCACHE_ROOT": ""})
    assert "Missing option '--root'" in missing.stderr
    doc = json.loads(run("restore", "--into", tmp_path / "r", "--model", "m", "--json",
                         env={"KCACHE_NODE_CACHE": ""}).stdout)  # fmt: skip
    assert doc["status"] == "miss"
    assert names(tmp_path) == ["r"]


# ---- 2. an in-process entrypoint's prints stay off --json's stdout --------------------------------

NOISY = """\
import os
import sys

print("noise while importing")


def run(batch_size, input_tokens, output_tokens):
    print("noise from print")
    sys.stdout.flush()
    os.write(1, b"noise on fd 1\\n")
"""


def test_warmup_entrypoint_output_goes_to_stderr_under_json(tmp_path):
    (tmp_path / "noisy_warm.py").write_text(NOISY)
    (tmp_path / "profiles.yaml").write_text("profiles:\n  - {name: one, batch_size: 1, input_tokens: 4, "
                                            "output_tokens: 1, repeats: 2}\n")  # fmt: skip
    env = {**os.environ, "KCACHE_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-m", "kcache", "warmup", "--entrypoint", "noisy_warm:run", "--profiles",
                           "profiles.yaml", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["status"] == "ok" and [p["name"] for p in doc["profiles"]] == ["one"]
    for line in ("noise while importing", "noise from print", "noise on fd 1"):
        assert line in done.stderr and line not in done.stdout


def test_warmup_entrypoint_prints_stay_off_stdout_in_process(tmp_path, monkeypatch):
    module = 'print("noise while importing")\n\n\ndef run(*_shape):\n    print("noise from print")\n'
    (tmp_path / "noisy_warm_in_process.py").write_text(module)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    out = run("warmup", "--entrypoint", "noisy_warm_in_process:run", "--json")
    assert json.loads(out.stdout)["status"] == "ok"
    assert "noise from print" in out.stderr


# ---- 3. no NaN or Infinity in JSON ----------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e400"])
def test_publish_refuses_a_compile_time_that_is_no_number(tmp_path, value):
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    result = run("publish", "--from", tmp_path / "src", "--model", "m", "--compile-seconds", value,
                 code=ExitCode.USAGE)  # fmt: skip
    assert "--compile-seconds" in result.stderr


def test_to_json_writes_null_for_numbers_json_cannot_hold():
    doc = {"a": float("inf"), "b": [float("nan"), 1.5, {"c": float("-inf")}], "d": (2.0,)}
    assert strict_json(fmt.to_json(doc)) == {"a": None, "b": [None, 1.5, {"c": None}], "d": [2.0]}


def test_a_stored_infinite_compile_time_still_reads_as_json(tmp_path, isolated_home):
    bundle = published(tmp_path, "--compile-seconds", "30")
    from sqlalchemy import update

    from kcache.index.models import BundleRow

    index = Index.open(f"sqlite:///{isolated_home / 'index.db'}")
    with index.engine.begin() as conn:
        conn.execute(update(BundleRow).values(compile_seconds=float("inf")))
    index.record_event(Event("restore", "hit", bundle["bundle_key"], bundle["bundle_id"], 2, 9, 0.5))
    index.close()
    assert strict_json(run("ls", "--json").stdout)[0]["compile_seconds"] is None
    assert strict_json(run("show", bundle["bundle_id"][:12], "--json").stdout)["compile_seconds"] is None
    strict_json(run("stats", "--json").stdout)
    strict_json(run("explain", "--model", "m", "--json").stdout)


# ---- 4. float flags are finite --------------------------------------------------------------------

FLOAT_FLAGS = {
    "warmup --budget inf": ["warmup", "--url", "http://127.0.0.1:1", "--budget", "inf"],
    "warmup --budget nan": ["warmup", "--url", "http://127.0.0.1:1", "--budget", "nan"],
    "warmup --budget 1e300": ["warmup", "--url", "http://127.0.0.1:1", "--budget", "1e300"],
    "warmup --wait-timeout nan": ["warmup", "--url", "http://127.0.0.1:1", "--wait-timeout", "nan", "--budget", "1"],
    "warmup --request-timeout inf": ["warmup", "--url", "http://127.0.0.1:1", "--request-timeout", "inf"],
    "prebake --budget inf": ["prebake", "--root", "{tmp}/r", "--url", "http://127.0.0.1:1", "--budget", "inf"],
    "prebake --wait-timeout nan": ["prebake", "--root", "{tmp}/r", "--url", "http://127.0.0.1:1",
                                   "--wait-timeout", "nan"],
    "proxy --redis-timeout nan": ["proxy", "--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9",
                                  "--port", "0", "--model", "m", "--redis-timeout", "nan"],
    "proxy --redis-retry-after inf": ["proxy", "--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9",
                                      "--port", "0", "--model", "m", "--redis-retry-after", "inf"],
}  # fmt: skip


@pytest.mark.parametrize("case", list(FLOAT_FLAGS))
def test_a_float_flag_that_is_not_finite_is_a_usage_error(tmp_path, case):
    args = [a.format(tmp=tmp_path) for a in FLOAT_FLAGS[case]]
    result = run(*args, code=ExitCode.USAGE)
    assert case.split()[1] in result.stderr
    assert not (tmp_path / "r").exists()


# ---- 5. durations have a ceiling ------------------------------------------------------------------

LONG_DURATIONS = {
    "stats --since 999999d": ["stats", "--since", "999999d"],
    "stats --since 99999999999d": ["stats", "--since", "99999999999d"],
    "gc --grace 999999d": ["gc", "--dry-run", "--grace", "999999d"],
    "gc --older-than 99999999999d": ["gc", "--dry-run", "--older-than", "99999999999d"],
    "watch --interval 99999999999d": ["watch", "--root", "{tmp}", "--interval", "99999999999d"],
    "prefetch --every 99999999999d": ["prefetch", "--node-cache", "{tmp}/n", "--model", "m", "--every",
                                      "99999999999d"],
    "proxy --ttl 99999999999d": ["proxy", "--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9",
                                 "--port", "0", "--model", "m", "--ttl", "99999999999d"],
    "refresh --ttl 99999999999d": ["refresh", "--signing-key", "{tmp}/k.key", "--ttl", "99999999999d"],
    "watch --interval 1e400 seconds": ["watch", "--root", "{tmp}", "--interval", "9" * 400],
}  # fmt: skip


@pytest.mark.parametrize("case", list(LONG_DURATIONS))
def test_a_duration_too_long_for_a_clock_is_a_usage_error(tmp_path, case):
    run("keygen", "k", "--dir", tmp_path)
    result = run(*(a.format(tmp=tmp_path) for a in LONG_DURATIONS[case]), code=ExitCode.USAGE)
    assert case.split()[1] in result.stderr and "years" in result.stderr


def test_durations_up_to_a_century_parse():
    assert durations.parse("36500d", "--since").days == 36500
    with pytest.raises(ConfigError, match="100 years"):
        durations.parse("36526d", "--since")
    with pytest.raises(ConfigError, match="100 years"):
        durations.parse("9" * 400, "--interval", bare_seconds=True)


def test_stats_over_a_long_window_counts_everything(tmp_path):
    published(tmp_path)
    assert json.loads(run("stats", "--since", "36500d", "--json").stdout)["publishes"] == 1


# ---- 6. integer flags that reach SQL have a ceiling -----------------------------------------------

HUGE = "99999999999999999999999"
BIG_INTS = {
    "ls --limit": ["ls", "--limit", HUGE],
    "explain --limit": ["explain", "--model", "m", "--limit", HUGE],
    "gc --keep-last": ["gc", "--dry-run", "--keep-last", HUGE],
    "proxy --max-entry-bytes": ["proxy", "--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9",
                                "--port", "0", "--model", "m", "--max-entry-bytes", HUGE],
    "proxy --prefix-entries": ["proxy", "--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9",
                               "--port", "0", "--model", "m", "--prefix-entries", HUGE],
}  # fmt: skip


@pytest.mark.parametrize("case", list(BIG_INTS))
def test_an_integer_flag_past_its_range_is_a_usage_error(case):
    result = run(*BIG_INTS[case], code=ExitCode.USAGE)
    assert case.split()[1] in result.stderr


def test_ls_takes_a_large_limit(tmp_path):
    bundle = published(tmp_path)
    listed = json.loads(run("ls", "--limit", "1000000", "--json").stdout)
    assert [b["bundle_id"] for b in listed] == [bundle["bundle_id"]]


# ---- 7. a layer named twice is one layer ----------------------------------------------------------


def test_a_layer_named_twice_is_published_once(tmp_path):
    bundle = published(tmp_path, "--layers", "inductor,triton,inductor")
    assert bundle["files"] == 2
    assert [s.name for s in sources.select(["inductor", "inductor"])] == ["inductor"]


def test_an_extra_dir_named_twice(tmp_path):
    write_tree(tmp_path, {"d/a.bin": b"a", "e/b.bin": b"b", "src/inductor/g": b"g"})
    same = ["--extra-dir", f"X={tmp_path / 'd'}", "--extra-dir", f"X={tmp_path / 'd'}/"]
    doc = json.loads(run("publish", "--from", tmp_path / "src", "--model", "m", *same, "--json").stdout)
    assert doc["files"] == 2
    other = ["--extra-dir", f"X={tmp_path / 'd'}", "--extra-dir", f"X={tmp_path / 'e'}"]
    refused = run("publish", "--from", tmp_path / "src", "--model", "m", *other, code=ExitCode.USAGE)
    assert "--extra-dir" in refused.stderr and "twice" in refused.stderr


@pytest.mark.parametrize("names", [("a-b", "a_b"), ("trt", "TRT")])
def test_two_extra_dirs_that_would_export_one_variable_are_refused(tmp_path, names):
    """kcache.env exports KCACHE_EXTRA_<NAME>: a-b and a_b (or trt and TRT) would be one variable,
    and the model would read the other directory."""
    write_tree(tmp_path, {"d/a.bin": b"a", "e/b.bin": b"b", "src/inductor/g": b"g"})
    both = ["--extra-dir", f"{names[0]}={tmp_path / 'd'}", "--extra-dir", f"{names[1]}={tmp_path / 'e'}"]
    refused = run("publish", "--from", tmp_path / "src", "--model", "m", *both, code=ExitCode.USAGE)
    assert "KCACHE_EXTRA_" in refused.stderr and names[1] in refused.stderr


# ---- 8. a named SQLite file that does not exist ---------------------------------------------------

READERS = {
    "ls": ["ls"],
    "show": ["show", "abcdef"],
    "stats": ["stats"],
    "explain": ["explain", "--model", "m"],
    "verify": ["verify"],
    "gc": ["gc", "--dry-run"],
    "yank": ["yank", "abcdef"],
    "refresh": ["refresh", "--signing-key", "{tmp}/k.key"],
}


@pytest.mark.parametrize("case", list(READERS))
def test_a_named_index_file_that_does_not_exist_is_an_index_error(tmp_path, case):
    published(tmp_path)  # the default index holds a bundle: the typo must not read as another, empty one
    run("keygen", "k", "--dir", tmp_path)
    typo = tmp_path / "typo.db"
    args = [a.format(tmp=tmp_path) for a in READERS[case]]
    result = run(*args, "--index", f"sqlite:///{typo}", "--json", code=ExitCode.INDEX)
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 5 and "does not exist" in doc["error"] and str(typo) in doc["error"]
    assert "db upgrade" in doc["error"]  # it creates one too: the message must not send a user elsewhere
    assert not typo.exists()
    env = run(*args, code=ExitCode.INDEX, env={"KCACHE_INDEX": f"sqlite:///{typo}"})
    assert "does not exist" in env.stderr and not typo.exists()


def test_publish_and_reindex_create_the_index_file_they_are_given(tmp_path):
    bundle = published(tmp_path, "--index", f"sqlite:///{tmp_path / 'new.db'}")
    assert (tmp_path / "new.db").is_file()
    doc = json.loads(run("reindex", "--index", f"sqlite:///{tmp_path / 'rebuilt.db'}", "--json").stdout)
    assert doc["bundles"] == 1
    listed = json.loads(run("ls", "--index", f"sqlite:///{tmp_path / 'rebuilt.db'}", "--json").stdout)
    assert [b["bundle_id"] for b in listed] == [bundle["bundle_id"]]


def test_the_default_index_reads_as_empty_before_the_first_publish(isolated_home):
    assert "no bundles yet" in run("ls").stdout
    assert json.loads(run("verify", "--json").stdout)["bundles"] == 0
    assert not (isolated_home / "index.db").exists()


def test_restore_with_a_named_index_file_that_does_not_exist_still_finds_refs(tmp_path):
    bundle = published(tmp_path)
    typo = tmp_path / "typo.db"
    doc = json.loads(run("restore", "--into", tmp_path / "r", "--model", "m", "--index", f"sqlite:///{typo}",
                         "--json").stdout)  # fmt: skip
    assert (doc["status"], doc["bundle_id"]) == ("hit", bundle["bundle_id"]) and not typo.exists()


# ---- 9. partial restores in stats -----------------------------------------------------------------


def test_stats_counts_partial_restores(isolated_home):
    index = Index.open(f"sqlite:///{isolated_home / 'index.db'}")
    index.record_event(Event("restore", "hit", BUNDLE_KEY, "a" * 64, 3, 1000, 0.5))
    index.record_event(Event("restore", "partial", BUNDLE_KEY, None, 2, 300, 0.4))
    index.record_event(Event("restore", "partial", BUNDLE_KEY, "b" * 64, 1, 200, 0.3))
    index.record_event(Event("restore", "miss", BUNDLE_KEY))
    index.close()
    doc = json.loads(run("stats", "--json").stdout)
    assert (doc["restores"], doc["hits"], doc["partials"], doc["misses"], doc["errors"]) == (4, 1, 2, 1, 0)
    assert doc["partial_bytes"] == 500 and doc["bytes_restored"] == 1500
    assert doc["hit_rate"] == 0.25
    text = run("stats").stdout
    assert "1 hits, 2 partial, 1 misses" in text and "partial restores are not hits" in text
    assert "partial" in run("stats", "--help").stdout


# ---- 10. refresh checks the keys it is given ------------------------------------------------------


@pytest.mark.parametrize("key", ["deadbeef", "../../x", "", "g" * 32, "a" * 33])
def test_refresh_refuses_a_key_that_is_no_bundle_key(tmp_path, key):
    run("keygen", "k", "--dir", tmp_path)
    result = run("refresh", key, "--signing-key", tmp_path / "k.key", "--json", code=ExitCode.USAGE)
    doc = json.loads(result.stdout)
    assert doc["exit_code"] == 2 and "32 hex digits" in doc["error"]


def test_refresh_of_a_key_the_index_never_saw_is_not_found(tmp_path):
    published(tmp_path)
    run("keygen", "k", "--dir", tmp_path)
    result = run("refresh", BUNDLE_KEY, "--signing-key", tmp_path / "k.key", code=ExitCode.NOT_FOUND)
    assert BUNDLE_KEY in result.stderr
    assert not list((tmp_path / "kcache-home/store").rglob(f"*{BUNDLE_KEY}*"))


def test_refresh_takes_an_upper_case_key_and_refuses_model_with_keys(tmp_path):
    bundle = published(tmp_path)
    run("keygen", "k", "--dir", tmp_path)
    doc = json.loads(run("refresh", bundle["bundle_key"].upper(), "--signing-key", tmp_path / "k.key",
                         "--json").stdout)  # fmt: skip
    assert [(r["bundle_key"], r["bundle_id"]) for r in doc["refs"]] == [(bundle["bundle_key"], bundle["bundle_id"])]
    both = run("refresh", bundle["bundle_key"], "--model", "m", "--signing-key", tmp_path / "k.key",
               code=ExitCode.USAGE)  # fmt: skip
    assert "--model" in both.stderr


# ---- 11. ids are hex in either case ---------------------------------------------------------------


def test_upper_case_ids_and_keys_match(tmp_path):
    bundle = published(tmp_path)
    shown = json.loads(run("show", bundle["bundle_id"][:12].upper(), "--json").stdout)
    assert shown["bundle_id"] == bundle["bundle_id"]
    listed = json.loads(run("ls", "--key", bundle["bundle_key"][:4].upper(), "--json").stdout)
    assert [b["bundle_id"] for b in listed] == [bundle["bundle_id"]]
    yanked = json.loads(run("yank", bundle["bundle_id"][:12].upper(), "--json").stdout)
    assert yanked == {"bundle_id": bundle["bundle_id"], "status": "yanked"}


@pytest.mark.parametrize("args", [["show", "zzzzzz"], ["show", "abc"], ["show", "%%%%%%"], ["yank", "%%%%%%"],
                                  ["yank", "xyz123"], ["ls", "--key", "xyz"], ["ls", "--key", "a" * 33]])  # fmt: skip
def test_an_id_that_is_not_hex_is_a_usage_error(tmp_path, args):
    published(tmp_path)
    result = run(*args, code=ExitCode.USAGE)
    assert "hex digits" in result.stderr
    assert [b["status"] for b in json.loads(run("ls", "--json").stdout)] == ["active"]


def test_a_well_formed_id_nobody_has_is_not_found(tmp_path):
    published(tmp_path)
    run("show", "abcdef0123", code=ExitCode.NOT_FOUND)
    run("yank", "abcdef0123", code=ExitCode.NOT_FOUND)


# ---- 12. --index none where an index is needed ----------------------------------------------------

NEEDS_INDEX = {
    "publish": ["publish", "--from", "{tmp}/src", "--model", "m"],
    "prebake": ["prebake", "--root", "{tmp}/r", "--url", "http://127.0.0.1:1", "--model", "m"],
    "watch": ["watch", "--root", "{tmp}/r", "--once", "--publish-every", "1m", "--model", "m"],
    "db upgrade": ["db", "upgrade"],
}


@pytest.mark.parametrize("case", list(NEEDS_INDEX))
@pytest.mark.parametrize("how", ["flag", "env"])
def test_index_none_is_refused_where_an_index_is_needed(tmp_path, case, how):
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    args = [a.format(tmp=tmp_path) for a in NEEDS_INDEX[case]]
    flag, env = (["--index", "none"], None) if how == "flag" else ([], {"KCACHE_INDEX": "none"})
    result = run(*args, *flag, code=ExitCode.USAGE, env=env)
    assert "this command needs an index; only `kcache restore` works from refs/" in result.stderr
    assert not (tmp_path / "r").exists()


# ---- minor: the S3 endpoint, prebake's donors -----------------------------------------------------


@pytest.mark.parametrize("endpoint", ["notaurl", "ftp://minio:9000", "http://", "http://minio:99999"])
def test_an_s3_endpoint_that_is_no_http_url_is_a_usage_error(tmp_path, endpoint):
    store = ["--store", "s3://bucket/prefix", "--s3-endpoint-url", endpoint]
    verify = run("verify", *store, "--json", code=ExitCode.USAGE)
    assert "--s3-endpoint-url" in json.loads(verify.stdout)["error"]
    strict = run("restore", "--into", tmp_path / "r", "--model", "m", *store, "--strict", code=ExitCode.USAGE)
    assert "--s3-endpoint-url" in strict.stderr
    env = run("verify", "--store", "s3://bucket/prefix", code=ExitCode.USAGE, env={"AWS_ENDPOINT_URL": endpoint})
    assert "AWS_ENDPOINT_URL" in env.stderr
    # restore opens the store off click's thread: it still names the variable the value came from
    env = run("restore", "--into", tmp_path / "r", "--model", "m", "--store", "s3://bucket/prefix", "--strict",
              code=ExitCode.USAGE, env={"AWS_ENDPOINT_URL": endpoint})  # fmt: skip
    assert "AWS_ENDPOINT_URL" in env.stderr and "--s3-endpoint-url" not in env.stderr


def test_an_s3_endpoint_is_not_checked_for_a_file_store(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "notaurl")  # another tool's setting; kcache does not use it here
    assert json.loads(run("verify", "--json").stdout)["bundles"] == 0


COMPILES = """\
import os
from pathlib import Path


def run(batch_size, input_tokens, output_tokens):
    Path(os.environ["TORCHINDUCTOR_CACHE_DIR"], "kernel.so").write_text("k")
"""


def test_prebake_json_names_donors_as_restore_does(tmp_path, monkeypatch):
    (tmp_path / "compiling_warm.py").write_text(COMPILES)
    (tmp_path / "profiles.yaml").write_text("profiles:\n  - {name: one, batch_size: 1, input_tokens: 4, "
                                            "output_tokens: 1}\n")  # fmt: skip
    monkeypatch.chdir(tmp_path)
    doc = json.loads(run("prebake", "--root", tmp_path / "r", "--entrypoint", "compiling_warm:run",
                         "--profiles", "profiles.yaml", "--model", "m", "--json").stdout)  # fmt: skip
    restored = json.loads(run("restore", "--into", tmp_path / "s", "--model", "other", "--json").stdout)
    assert doc["restore"]["donors"] == restored["donors"] == {}


# ---- empty URLs and names are not the default ------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["publish", "--model", "m", "--store", ""], "--store"),  # would publish into the pod's own disk
        (["publish", "--model", "m", "--index", ""], "--index"),
        (["publish", "--model", "m", "--s3-endpoint-url", ""], "--s3-endpoint-url"),
        (["publish", "--model", "m", "--layers", ""], "--layers"),
        (["ls", "--index", ""], "--index"),
        (["db", "upgrade", "--index", ""], "--index"),
    ],
)
def test_an_empty_url_or_name_is_a_usage_error_not_the_default(tmp_path, args, flag):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph"})
    extra = ["--from", tmp_path / "src"] if args[0] == "publish" else []
    result = run(*args, *extra, code=ExitCode.USAGE)
    assert flag in result.stderr and "empty" in result.stderr
    assert not (tmp_path / "kcache-home" / "store").exists()


@pytest.mark.parametrize("command", ["serve", "watch"])
def test_an_empty_host_is_a_usage_error_not_every_interface(tmp_path, command):
    """socket.create_server(("", port)) listens on every interface: a --host "$UNSET" would open the
    probe server to the whole network. A child with a deadline: a server that starts serves forever."""
    child = subprocess.run([sys.executable, "-m", "kcache", command, "--root", str(tmp_path), "--port", "0",
                            "--host", ""], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert child.returncode == ExitCode.USAGE, child.stdout + child.stderr
    assert "--host" in child.stderr and "empty" in child.stderr


def test_restore_with_an_empty_store_starts_cold_without_reading_the_default(tmp_path):
    result = run("restore", "--into", tmp_path / "root", "--model", "m", "--store", "", "--json")
    doc = json.loads(result.stdout)
    assert doc["status"] == "error" and "--store" in doc["error"]
    assert run("restore", "--into", tmp_path / "r2", "--model", "m", "--store", "", "--strict",
               code=ExitCode.USAGE).stderr  # fmt: skip


def test_an_empty_environment_variable_still_means_unset(tmp_path):
    env = {"KCACHE_STORE": "", "KCACHE_HOME": str(tmp_path / "kcache-home")}
    doc = json.loads(run("config", "--json", env=env).stdout)
    assert doc["store"]["value"].startswith("file://")


def _published(tmp_path) -> str:
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    out = CliRunner().invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m", "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.output)["bundle_id"]


LONG = "x" * 300  # past NAME_MAX: exists() raises ENAMETOOLONG rather than saying False


@pytest.mark.parametrize("args, env, code", [
    (["ls", "--json", "--index", "sqlite:///{t}/i.db?timeout=abc"], {}, ExitCode.USAGE),
    (["ls", "--json", "--index", "sqlite:///{t}/i.db?check_same_thread=maybe"], {}, ExitCode.USAGE),
    (["ls", "--json", "--index", "postgresql+psycopg://u@[::1/x"], {}, ExitCode.USAGE),
    (["ls", "--json", "--index", "sqlite://"], {}, ExitCode.USAGE),
    (["ls", "--json", "--index", "sqlite:///:memory:"], {}, ExitCode.USAGE),
    (["ls", "--json", "--index", "sqlite:////{t}/" + LONG + "/i.db"], {}, ExitCode.INDEX),
    (["verify", "--json", "--store", "file:///{t}/" + LONG], {}, ExitCode.STORE),
    (["config", "--json"], {"KCACHE_HOME": "/{t}/" + LONG}, ExitCode.USAGE),
    (["config", "--json"], {"KCACHE_HOME": "~kcache-no-such-user/x"}, ExitCode.USAGE),
    (["warmup", "--json", "--entrypoint", "..:f"], {}, ExitCode.USAGE),
    (["warmup", "--json", "--entrypoint", ".os:f"], {}, ExitCode.USAGE),
    (["restore", "--into", "{t}/r", "--model", "m", "--strict", "--json", "--index", "none", "--store", "s3://b/p",
      "--s3-endpoint-url", "http://127.0.0.1:1"], {"KCACHE_S3_MAX_ATTEMPTS": "9" * 5000}, ExitCode.USAGE),
], ids=["sqlite-timeout", "sqlite-bool", "pg-port", "sqlite-memory", "sqlite-memory-named", "index-past-name-max",
        "store-past-name-max", "home-past-name-max", "home-unknown-user", "entrypoint-dots", "entrypoint-relative",
        "s3-attempts-digits"])  # fmt: skip
def test_values_that_raised_past_their_checks_are_named_errors(tmp_path, monkeypatch, args, env, code):
    """Each was a bug exit (70): a value SQLAlchemy or int() refuses with ValueError, a path the kernel refuses
    with ENAMETOOLONG where it was asked whether it exists, ~user of no user, a relative module name."""
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path / "home"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.setenv(name, "x")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    (tmp_path / "i.db").touch()  # an index file to open (an empty file is an empty SQLite database)
    filled = [a.replace("{t}", str(tmp_path)) for a in args]
    out = CliRunner().invoke(main, filled, env={k: v.replace("{t}", str(tmp_path)) for k, v in env.items()},
                             catch_exceptions=False)  # fmt: skip
    assert out.exit_code == code, out.output
    assert "bug" not in out.output


def test_a_yank_reason_that_is_not_utf8_changes_nothing(tmp_path, monkeypatch):
    """The reason was encoded after the index row was yanked: UnicodeEncodeError left the bundle yanked in the
    index with no yank marker in the store and its ref not moved, and exited 70."""
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path / "home"))
    bundle = _published(tmp_path)
    out = CliRunner().invoke(main, ["yank", bundle, "--reason", "bad \udcff", "--json"], catch_exceptions=False)
    assert out.exit_code == ExitCode.USAGE and "--reason" in out.output, out.output
    listed = json.loads(CliRunner().invoke(main, ["ls", "--json"]).output)
    assert [b["status"] for b in listed] == ["active"]


@pytest.mark.parametrize("args", [
    ["serve", "--root", "{t}/r", "--port", "0", "--json", "--host", "bad\udcff"],
    ["serve", "--root", "{t}/r", "--port", "0", "--json", "--host", "x" * 300],
    ["proxy", "--model", "m", "--upstream", "http://127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0", "--port", "0",
     "--json", "--host", "nosuch.invalid"],
    ["proxy", "--model", "m", "--upstream", "http://127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0", "--port", "0",
     "--json", "--host", "x" * 300],
    ["serve", "--root", "{t}/r", "--port", "0", "--json", "--host", "fe80::1"],
    ["serve", "--root", "{t}/r", "--port", "0", "--json", "--host", "ff02::1"],
    ["proxy", "--model", "m", "--upstream", "http://127.0.0.1:1", "--redis", "redis://127.0.0.1:1/0", "--port", "0",
     "--json", "--host", "fe80::1"],
], ids=["serve-not-utf8", "serve-label-too-long", "proxy-unresolvable", "proxy-label-too-long",
        "serve-link-local-without-interface", "serve-multicast", "proxy-link-local-without-interface"])  # fmt: skip
def test_a_host_that_cannot_be_bound_is_a_usage_error(tmp_path, monkeypatch, args):
    """UnicodeError from IDNA, TypeError from a lone surrogate, and (proxy) the resolver's gaierror were bug exits;
    so was a bind the kernel refuses with an errno kcache did not list (EINVAL: an IPv6 link-local address
    without its %interface, a multicast one)."""
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path / "home"))
    (tmp_path / "r").mkdir()
    out = CliRunner().invoke(main, [a.replace("{t}", str(tmp_path)) for a in args], catch_exceptions=False)
    assert out.exit_code == ExitCode.USAGE and "--host" in out.output, out.output


def test_watch_of_a_root_that_is_no_directory_is_a_root_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path / "home"))
    os.mkfifo(tmp_path / "fifo")
    out = CliRunner().invoke(main, ["watch", "--once", "--json", "--root", str(tmp_path / "fifo")],
                             catch_exceptions=False)  # fmt: skip
    assert out.exit_code == ExitCode.ROOT, out.output


def test_warmup_whose_marker_place_holds_a_directory_is_a_root_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path / "home"))
    (tmp_path / "r" / ".kcache-warmup.json").mkdir(parents=True)
    out = CliRunner().invoke(main, ["warmup", "--json", "--url", "http://127.0.0.1:1", "--wait-timeout", "0",
                                    "--root", str(tmp_path / "r")], catch_exceptions=False)  # fmt: skip
    assert out.exit_code == ExitCode.ROOT, out.output


def test_verbose_after_the_command_is_taken_by_every_command(tmp_path, isolated_home, monkeypatch):
    """-v was only an option of `kcache` itself: `kcache restore ... -v`, a common habit, was a usage
    error, which restore answers by starting cold (exit 0, one log line), and every other command
    refused it. Each command now takes it after its name too."""
    write_tree(tmp_path / "src", {"inductor/a": b"kernel"})
    run("publish", "--from", tmp_path / "src", "--model", "m", "-v")
    restored = strict_json(run("restore", "--into", tmp_path / "dst", "--model", "m", "--json", "-v").output)
    assert restored["status"] == "hit", restored
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", logging.WARNING)  # and back to what it was after the test
    run("restore", "--into", tmp_path / "third", "--model", "m")
    assert root.level == logging.WARNING
    run("restore", "--into", tmp_path / "again", "--model", "m", "-vv")
    assert root.level == logging.DEBUG  # -vv after the command is debug, as before it
    run("db", "upgrade", "-v")  # a group's commands too


@pytest.mark.parametrize("name", ["warmup", "prebake"])
def test_warmup_times_take_durations_like_every_other_time_option(name, tmp_path):
    """restore --timeout, watch --stop-timeout and proxy --shutdown-timeout took 10m; warmup's and
    prebake's --wait-timeout, --request-timeout and --budget refused it as "not a valid float"."""
    command = main.commands[name]
    args = ["--url", "http://127.0.0.1:1", "--root", str(tmp_path), "--wait-timeout", "10m", "--request-timeout",
            "90s", "--budget", "1h"]  # fmt: skip
    params = command.make_context(name, list(args)).params  # a copy: click consumes the list
    assert (params["wait_timeout"], params["request_timeout"], params["budget"]) == (600.0, 90.0, 3600.0)
    bare = command.make_context(name, [*args[:4], "--wait-timeout", "2.5", "--budget", "0"]).params
    assert (bare["wait_timeout"], bare["budget"]) == (2.5, 0.0)  # seconds, and 0: no limit, as before
    for flag, value in (("--request-timeout", "0"), ("--wait-timeout", "-1"), ("--budget", "soon")):
        result = run(name, *args[:4], flag, value, code=ExitCode.USAGE)
        assert flag in result.output


def test_ls_json_help_says_it_prints_an_array(isolated_home):
    """Every --json help said "one JSON object"; ls prints an array of them."""
    assert "one JSON array" in " ".join(run("ls", "--help").output.split())
    assert isinstance(strict_json(run("ls", "--json").stdout), list)
    assert "one JSON object" in " ".join(run("show", "--help").output.split())


BLANK_MODEL_FACT = {
    "fingerprint": ["fingerprint"],
    "explain": ["explain"],
    "publish": ["publish", "--from", "{tmp}/src"],
    "restore": ["restore", "--into", "{tmp}/root", "--strict"],
    "prefetch": ["prefetch", "--node-cache", "{tmp}/node", "--once", "--model", "m"],
    "prebake": ["prebake", "--root", "{tmp}/root", "--url", "http://127.0.0.1:1"],
    "watch": ["watch", "--root", "{tmp}/root", "--once", "--publish-every", "10m"],
    # A key file too short to use: proxy refuses it right after the fingerprint, rather than serve.
    "proxy": ["proxy", "--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9", "--port", "0",
              "--entry-key-file", "{tmp}/short.key"],
}  # fmt: skip


def test_every_command_that_takes_fact_is_in_the_blank_model_table():
    from command_tree import commands

    taking = {" ".join(path) for path, command in commands(main) if any(p.name == "facts" for p in command.params)}
    assert taking == set(BLANK_MODEL_FACT)


@pytest.mark.parametrize("fact", ["model.id=", "model.id= ", "model.config="])
@pytest.mark.parametrize("case", list(BLANK_MODEL_FACT))
def test_a_blank_model_fact_is_a_usage_error_as_a_blank_model_is(tmp_path, case, fact):
    """`--model ""` was refused (a bundle keyed by a blank model reaches no pod naming its model), yet
    `--fact model.id=` (a variable expanded to nothing) was taken: fingerprint printed a key for it and
    publish stored a bundle under it. Every command that takes --fact refuses it now."""
    write_tree(tmp_path, {"src/inductor/a": b"kernel", "short.key": b"x"})
    args = [a.format(tmp=tmp_path) for a in BLANK_MODEL_FACT[case]]
    result = run(*args, "--fact", fact, code=ExitCode.USAGE)
    name = fact.partition("=")[0]
    assert f"--fact {name}" in result.stderr and "blank" in result.stderr, result.stderr
    assert run("ls", "--json").stdout.strip() == "[]"  # nothing published


def test_restore_with_a_blank_model_fact_still_starts_cold_without_strict(tmp_path):
    result = run("restore", "--into", tmp_path / "root", "--fact", "model.id=", "--json")
    doc = strict_json(result.stdout)
    assert doc["status"] == "error" and "blank" in doc["error"] and (tmp_path / "root" / "kcache.env").is_file()


def with_model(args: list[str]) -> list[str]:
    return args if "--model" in args else [*args, "--model", "m"]


@pytest.mark.parametrize("extra", ["tp=", "tp= "])
@pytest.mark.parametrize("case", list(BLANK_MODEL_FACT))
def test_a_blank_extra_is_a_usage_error_as_a_blank_model_is(tmp_path, case, extra):
    """`--extra tp=` (a variable expanded to nothing) was taken, and keyed a bundle on an `extra.tp`
    no pod that sets it ever restores, while `--model ""` and `--fact model.id=` were refused."""
    write_tree(tmp_path, {"src/inductor/a": b"kernel", "short.key": b"x"})
    args = with_model([a.format(tmp=tmp_path) for a in BLANK_MODEL_FACT[case]])
    result = run(*args, "--extra", extra, code=ExitCode.USAGE)
    assert "--extra tp" in result.stderr and "blank" in result.stderr, result.stderr
    assert run("ls", "--json").stdout.strip() == "[]"  # nothing published


@pytest.fixture(scope="module")
def machine_facts(tmp_path_factory) -> dict:
    return strict_json(run("fingerprint", "--json").stdout)


@pytest.mark.parametrize("fact", ["model.id", "model.config"])
@pytest.mark.parametrize("case", list(BLANK_MODEL_FACT))
def test_a_facts_file_with_a_blank_model_is_a_usage_error_as_a_blank_model_is(tmp_path, case, fact, machine_facts):
    """A facts file whose model.id was blank (written by hand, or by a kcache that took
    `--fact model.id=`) keyed a bundle on it, where `--fact model.id=` itself was refused."""
    write_tree(tmp_path, {"src/inductor/a": b"kernel", "short.key": b"x"})
    doc = {**machine_facts, "facts": {**machine_facts["facts"], fact: ""}}
    (tmp_path / "facts.json").write_text(json.dumps(doc))
    args = [a.format(tmp=tmp_path) for a in BLANK_MODEL_FACT[case]]
    result = run(*args, "--facts-file", tmp_path / "facts.json", code=ExitCode.USAGE)
    assert "--facts-file" in result.stderr and fact in result.stderr and "blank" in result.stderr, result.stderr
    assert run("ls", "--json").stdout.strip() == "[]"  # nothing published


@pytest.mark.parametrize("given", [["--extra", "tp="], ["--facts-file", "{tmp}/facts.json"]])
def test_restore_with_a_blank_extra_or_facts_model_still_starts_cold_without_strict(tmp_path, given, machine_facts):
    doc = {**machine_facts, "facts": {**machine_facts["facts"], "model.id": ""}}
    (tmp_path / "facts.json").write_text(json.dumps(doc))
    args = [a.format(tmp=tmp_path) for a in given]
    result = run("restore", "--into", tmp_path / "root", "--model", "m", *args, "--json")
    doc = strict_json(result.stdout)
    assert doc["status"] == "error" and "blank" in doc["error"] and (tmp_path / "root" / "kcache.env").is_file()


def test_proxy_redis_times_take_durations_like_every_other_time_option():
    """--redis-timeout and --redis-retry-after took bare seconds only: `--redis-timeout 250ms` (its
    default, as docs/proxy.md writes it) and `1s` were "not a valid float"."""
    command = main.commands["proxy"]
    base = ["--upstream", "http://127.0.0.1:9", "--redis", "redis://127.0.0.1:9", "--port", "0"]

    def parsed(*args):
        params = command.make_context("proxy", [*base, *args]).params
        return params["redis_timeout"], params["redis_retry_after"]

    assert parsed() == (0.25, 2.0)
    assert parsed("--redis-timeout", "250ms", "--redis-retry-after", "2m") == (0.25, 120.0)
    assert parsed("--redis-timeout", "1s", "--redis-retry-after", "1m30s") == (1.0, 90.0)
    assert parsed("--redis-timeout", "0.5", "--redis-retry-after", "0") == (0.5, 0.0)  # seconds, as before
    # and every number form they took as floats: a sidecar's `--redis-timeout .25` must not crash-loop
    assert parsed("--redis-timeout", ".25", "--redis-retry-after", "2.") == (0.25, 2.0)
    assert parsed("--redis-timeout", "1e-1", "--redis-retry-after", "1E1") == (0.1, 10.0)
    for flag, value in (("--redis-timeout", "0"), ("--redis-timeout", "0.5ms"), ("--redis-retry-after", "soon")):
        result = run("proxy", *base, "--model", "m", flag, value, code=ExitCode.USAGE)
        assert flag in result.stderr


def test_milliseconds_are_a_duration_unit():
    assert durations.parse("500ms", "--x").total_seconds() == 0.5
    assert durations.parse("1m500ms", "--x").total_seconds() == 60.5
    assert durations.parse("5m", "--x").total_seconds() == 300  # m is still minutes
    with pytest.raises(ConfigError):
        durations.parse("5sm", "--x")
