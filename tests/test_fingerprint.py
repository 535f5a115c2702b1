import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kcache import fingerprint as f
from kcache.errors import ConfigError

BASE = {"os": "linux", "cpu.isa": "avx512", "gpu.sm": "sm_90", "model.id": "m"}
# The core facts a facts file must hold, as a model container on an AVX2 node would write them.
AVX2_NODE = {
    "os": "linux", "arch": "x86_64", "python": "3.12", "torch.version": "2.13.0+cu128", "cpu.isa": "avx2",
    "cpu.features": "avx avx2 f16c fma sse sse2 sse4_1 sse4_2 ssse3", "gpu.sm": "sm_90", "gpu.name": "NVIDIA H100",
    "gpu.count": "1", "gpu.driver": "570.124.06", "model.id": "m",
}  # fmt: skip


def write_facts(tmp_path, facts, name="facts.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"facts": facts}))
    return path


@given(st.dictionaries(st.text(min_size=1, max_size=12), st.text(max_size=12), max_size=10))
def test_keys_do_not_depend_on_fact_order(facts):
    assert f.compute(facts) == f.compute(dict(reversed(list(facts.items()))))


def test_toolchain_and_workload_are_keyed_apart():
    base = f.compute(BASE)
    other_model = f.compute({**BASE, "model.id": "n"})
    other_gpu = f.compute({**BASE, "gpu.sm": "sm_80"})
    assert other_model.toolchain_key == base.toolchain_key and other_model.workload_key != base.workload_key
    assert other_gpu.workload_key == base.workload_key and other_gpu.toolchain_key != base.toolchain_key
    assert len({base.bundle_key, other_model.bundle_key, other_gpu.bundle_key}) == 3


def test_overrides_win_over_probes():
    probe = lambda env: {"gpu.sm": "none", "os": "linux"}  # noqa: E731
    fp = f.collect(overrides={"gpu.sm": "sm_90"}, probes=[probe], env={})
    assert fp.facts["gpu.sm"] == "sm_90"


def test_an_override_naming_no_fact_is_warned_about_with_the_name_meant(caplog):
    probe = lambda env: {"gpu.sm": "none", "os": "linux"}  # noqa: E731
    fp = f.collect(overrides={"gpu.SM": "sm_90", "gpu.sm": "sm_80", "model.rev": "2"}, probes=[probe], env={})
    assert (fp.facts["gpu.SM"], fp.facts["gpu.sm"]) == ("sm_90", "sm_80")  # still applied: only a warning
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(said) == 1 and "gpu.SM" in said[0] and "did you mean gpu.sm?" in said[0]


def test_extra_and_model_config(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                                  "torch_dtype": "bfloat16", "_name_or_path": "/home/me/llama"}))  # fmt: skip
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                                 "torch_dtype": "bfloat16", "_name_or_path": "/data/llama"}))  # fmt: skip
    wider = tmp_path / "wider.json"
    wider.write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "torch_dtype": "bfloat16"})
    )
    facts = f.workload_facts("llama", config, {"tp": "2"})
    assert facts["model.arch"] == "LlamaForCausalLM" and facts["model.dtype"] == "bfloat16"
    assert facts["extra.tp"] == "2"
    assert f.workload_facts("llama", moved, {})["model.config"] == facts["model.config"]
    assert f.workload_facts("llama", wider, {})["model.config"] != facts["model.config"]


@pytest.mark.parametrize("content", [None, "not json", "[1, 2]"])
def test_bad_model_config_is_a_config_error(tmp_path, content):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError):
        f.workload_facts("m", path, {})


def test_bad_assignment_is_a_config_error():
    with pytest.raises(ConfigError, match="NAME=VALUE"):
        f.parse_assignments(["novalue"], "--fact")


def test_replica_specific_values_never_reach_the_facts(monkeypatch, tmp_path):
    fp1 = f.collect()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("HOSTNAME", "another-pod")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    fp2 = f.collect()
    assert fp1 == fp2
    assert str(tmp_path) not in json.dumps(fp2.as_dict())


def test_fingerprint_cli_imports_neither_torch_nor_triton_nor_heavy_libraries():
    code = (
        "import sys\n"
        "from kcache.cli import main\n"
        "try:\n    main(['fingerprint', '--json'])\nexcept SystemExit:\n    pass\n"
        "print([m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'sqlalchemy', 'boto3')])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    doc, loaded = out.splitlines()
    assert loaded == "[]"
    facts = json.loads(doc)["facts"]
    assert facts["cpu.isa"] and "torch.version" in facts


def test_facts_file_reproduces_another_machines_fingerprint(tmp_path):
    from click.testing import CliRunner

    from kcache.cli import main

    there = f.compute(AVX2_NODE)
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(there.as_dict()))

    def no_probing(env):
        raise AssertionError("a facts file must replace probing")

    assert f.collect(facts_file=path, probes=[no_probing], checks=()) == there
    other_model = f.collect(facts_file=path, model="other", probes=[no_probing], checks=())
    assert other_model.toolchain_key == there.toolchain_key and other_model.facts["model.id"] == "other"
    out = CliRunner().invoke(main, ["fingerprint", "--json"], env={"KCACHE_FACTS_FILE": str(path)})
    assert json.loads(out.output)["bundle_key"] == there.bundle_key
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(dict(there.facts)))
    assert f.collect(facts_file=flat, probes=[no_probing], checks=()) == there


@pytest.mark.parametrize("content", ["[1]", '{"facts": {"a": 1}}', "not json", "{}", '{"facts": {}}'])
def test_bad_facts_file_is_a_config_error(tmp_path, content):
    path = tmp_path / "facts.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="facts-file"):
        f.collect(facts_file=path)


@pytest.mark.parametrize("content", [{}, {"facts": {}}, {"facts": {"os": "linux", "gpu.sm": "none"}}])
def test_a_facts_file_without_the_core_facts_is_refused(tmp_path, content):
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ConfigError, match="lacks the core facts .*arch.*torch.version.*cpu.features") as err:
        f.collect(facts_file=path, checks=())
    named = str(err.value).split("lacks the core facts ")[1].split(";")[0].split(", ")
    assert named == [n for n in f.CORE_FACTS if n not in content.get("facts", {})]


def test_an_x86_facts_file_with_a_compiler_but_not_what_its_march_native_turns_on_is_refused(tmp_path):
    """Written by a kcache before schema 4: its keys would not tell an AVX10.2 CPU from an AVX10.1 one."""
    old = {**AVX2_NODE, "cxx.name": "g++", "cxx.v_hash": "0d8c3b1e6f8a4c1f9b2a7e5d3c1b0a99"}
    with pytest.raises(ConfigError, match="cxx.native"):
        f.collect(facts_file=write_facts(tmp_path, old), checks=())
    fresh = {**old, "cxx.native": "avx avx2 fma"}
    assert f.collect(facts_file=write_facts(tmp_path, fresh), checks=()).facts["cxx.native"] == "avx avx2 fma"
    # no compiler there (no kernels to build), or not x86 (gcc reads what cpu.features holds): not needed
    f.collect(facts_file=write_facts(tmp_path, AVX2_NODE), checks=())
    f.collect(facts_file=write_facts(tmp_path, {**old, "arch": "aarch64"}), checks=())


def test_an_explicit_no_gpu_is_a_core_fact(tmp_path):
    facts = {**AVX2_NODE, "gpu.sm": "none"}
    assert f.collect(facts_file=write_facts(tmp_path, facts), checks=()).facts["gpu.sm"] == "none"


# ---- flags over a facts file (issue 8, item 2) -----------------------------------------------------


def test_extra_over_a_facts_file_keeps_the_model(tmp_path):
    qwen = write_facts(tmp_path, {**AVX2_NODE, "model.id": "qwen"}, "qwen.json")
    llama = write_facts(tmp_path, {**AVX2_NODE, "model.id": "llama"}, "llama.json")
    a = f.collect(facts_file=qwen, extra={"tp": "8"}, checks=())
    b = f.collect(facts_file=llama, extra={"tp": "8"}, checks=())
    assert a.facts["model.id"] == "qwen" and a.facts["extra.tp"] == "8"
    assert a.bundle_key != b.bundle_key


def test_a_new_model_config_replaces_the_files_config_facts(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"hidden_size": 8}))  # no architectures, no dtype
    stale = {**AVX2_NODE, "model.config": "old", "model.arch": "LlamaForCausalLM", "model.dtype": "bfloat16"}
    fp = f.collect(facts_file=write_facts(tmp_path, stale), model_config=config, checks=())
    assert fp.facts["model.config"] != "old" and "model.arch" not in fp.facts and "model.dtype" not in fp.facts
    assert fp.facts["model.id"] == "m"


WORKLOAD_NAMES = ["model.id", "model.config", "model.arch", "workload.tp", "extra.tp", "extra.pp"]
workloads = st.dictionaries(st.sampled_from(WORKLOAD_NAMES), st.text("abc=", min_size=1, max_size=3), min_size=1)


@st.composite
def sourced(draw, workload):
    """One way to express `workload`: each fact from the facts file, from its flag, or from both
    (the flag then carrying the value and the file a stale one)."""
    in_file, model, extra, overrides = {}, None, {}, {}
    for name, value in workload.items():
        where = draw(st.sampled_from(["file", "flag", "both"]))
        if where in ("file", "both"):
            in_file[name] = value if where == "file" else value + "-stale"
        if where == "file":
            continue
        if name == "model.id":
            model = value
        elif name.startswith("extra.") and "=" not in value:
            extra[name[len("extra.") :]] = value
        else:
            overrides[name] = value
    return in_file, model, extra, overrides


@given(st.data(), workloads, workloads)
def test_differing_workloads_never_share_a_bundle_key(tmp_path_factory, data, w1, w2):
    keys = []
    for n, workload in enumerate((w1, w2)):
        in_file, model, extra, overrides = data.draw(sourced(workload))
        path = write_facts(tmp_path_factory.mktemp("f"), {**AVX2_NODE, "model.id": "none", **in_file}, f"{n}.json")
        fp = f.collect(facts_file=path, model=model, extra=extra, overrides=overrides, checks=())
        assert {k: v for k, v in fp.facts.items() if f.is_workload_fact(k)} == {"model.id": "none", **workload}
        keys.append(fp.bundle_key)
    assert (keys[0] == keys[1]) == ({"model.id": "none", **w1} == {"model.id": "none", **w2})


# ---- a facts file checked against this machine (issue 8, item 3) ------------------------------------


def test_an_avx2_facts_file_on_this_machine_disagrees_on_cpu_features(tmp_path):
    from kcache import probes

    here = probes.probe_cpu(os.environ)["cpu.features"]
    if "avx512f" not in here.split():
        pytest.skip("needs an AVX-512 machine")
    fp = f.collect(facts_file=write_facts(tmp_path, {**AVX2_NODE, "arch": probes.probe_platform({})["arch"]}))
    (mismatch,) = [m for m in fp.mismatches if m.fact == "cpu.features"]
    assert mismatch == f.Mismatch("cpu.features", AVX2_NODE["cpu.features"], here)
    assert "cpu.features (" in fp.mismatch_reason() and "avx512_vnni" in fp.mismatch_reason()
    assert "here only" in fp.mismatch_reason() and "facts file only" not in fp.mismatch_reason()


def fake_checks(**seen):
    return [lambda env: dict(seen)]


def test_mismatches_name_each_disagreeing_fact_and_nothing_else(tmp_path):
    path = write_facts(tmp_path, AVX2_NODE)
    checks = fake_checks(**{"arch": "x86_64", "cpu.features": "avx2 avx512f", "gpu.sm": "sm_80", "zz": "new"})
    fp = f.collect(facts_file=path, checks=checks)
    assert fp.mismatches == (
        f.Mismatch("cpu.features", AVX2_NODE["cpu.features"], "avx2 avx512f"),
        f.Mismatch("gpu.sm", "sm_90", "sm_80"),
        f.Mismatch("zz", None, "new"),
    )
    assert fp.mismatch_reason() == (
        "the facts file does not describe this machine: cpu.features (1 here only: avx512f, 8 in the facts file "
        "only: avx f16c fma sse sse2 sse4_1 sse4_2 ssse3); gpu.sm (sm_90 in the facts file, sm_80 here); "
        "zz (absent in the facts file, new here)"
    )
    assert f.collect(facts_file=path, checks=fake_checks(arch="x86_64", os="linux")).mismatches == ()
    # The keys do not depend on the check: a mismatch is a miss, never another key to hit.
    assert fp.bundle_key == f.compute(AVX2_NODE).bundle_key


def test_no_checks_without_a_facts_file():
    def never(env):
        raise AssertionError("probes are the facts; nothing to check them against")

    assert f.collect(probes=[lambda env: {"os": "linux"}], checks=[never]).mismatches == ()


def test_a_fact_override_is_what_gets_checked(tmp_path):
    path = write_facts(tmp_path, AVX2_NODE)
    fp = f.collect(facts_file=path, overrides={"gpu.sm": "sm_80"}, checks=fake_checks(**{"gpu.sm": "sm_80"}))
    assert fp.mismatches == ()


# ---- golden keys (issue 8, item 10) -----------------------------------------------------------------

GOLDEN_FACTS = {
    "os": "linux", "arch": "x86_64", "libc": "glibc 2.35", "python": "3.12", "torch.version": "2.13.0+cu128",
    "torch.git": "cf30153c4c131c8164ee7798e5022d810682e2cb", "cpu.isa": "avx512_vnni",
    "cpu.features": "avx avx2 avx512f avx512_vnni fma", "cxx.native": "avx avx2 avx512f avx512vnni fma",
    "cpu.threads": "26", "gpu.name": "NVIDIA H100 80GB HBM3", "gpu.sm": "sm_90", "gpu.count": "1",
    "gpu.driver": "570.124.06", "env.TORCH_COMPILE_CACHE_KEY_TAG": "t",
    "model.id": "meta-llama/Llama-3.1-8B", "model.dtype": "bfloat16", "extra.tp": "8",
}  # fmt: skip
GOLDEN_KEYS = {
    "schema": 5,
    "toolchain_key": "6ed3613c102eaa1e14ad5f7aca9ffc9a",
    "workload_key": "91009540f4e36369d1ecbd1d24cbc1c0",
    "bundle_key": "ef68eecc18005dae952c3b98d343b08f",
}


def test_keys_are_pinned():
    fp = f.compute(GOLDEN_FACTS)
    got = {"schema": f.SCHEMA, "toolchain_key": fp.toolchain_key, "workload_key": fp.workload_key,
           "bundle_key": fp.bundle_key}  # fmt: skip
    assert got == GOLDEN_KEYS, (
        "the fingerprint keys changed: a change to the fingerprint needs a SCHEMA bump and a note in "
        "docs/design.md (then pin the new keys here); a refactor must never change a key"
    )


@pytest.mark.parametrize("facts", [{"env.TORCHINDUCTOR_MAX_AUTOTUNE": "caf\udce9"}, {"model.id\udce9": "m"}])
def test_a_fact_that_is_not_utf8_is_a_config_error_naming_it(facts):
    """An environment variable holding a Latin-1 byte reads as a lone surrogate; hashing it raised
    UnicodeEncodeError, a bug exit (70) from restore, publish, fingerprint and explain alike."""
    with pytest.raises(ConfigError, match="not UTF-8") as raised:
        f.compute({"os": "linux", **facts})
    assert raised.value.what == f"fact {ascii(next(iter(facts)))}"
