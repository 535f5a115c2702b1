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


ALL_AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}


@pytest.mark.parametrize(
    "flags, env, expected",
    [
        (ALL_AVX512 | {"avx512_vnni", "amx_tile"}, {}, "amx"),
        (ALL_AVX512 | {"avx512_vnni"}, {}, "avx512_vnni"),
        (ALL_AVX512, {}, "avx512"),
        (ALL_AVX512 - {"avx512bw"}, {}, "avx2"),
        (ALL_AVX512 | {"amx_tile"}, {}, "avx512"),  # AMX needs VNNI too
        ({"avx2"}, {}, "avx2"),
        (ALL_AVX512 | {"avx512_vnni", "amx_tile"}, {"ATEN_CPU_CAPABILITY": "avx512"}, "amx"),
        (ALL_AVX512, {"TORCHINDUCTOR_VEC_ISA_OK": "0"}, "none"),
        ({"sse4_2"}, {}, "none"),
        (ALL_AVX512, {"ATEN_CPU_CAPABILITY": "avx2"}, "avx2"),
        (ALL_AVX512, {"ATEN_CPU_CAPABILITY": "default"}, "none"),
    ],
)
def test_isa_choice_mirrors_inductor(flags, env, expected):
    assert f.pick_isa("x86_64", flags, env) == expected


def test_settings_that_change_keys_are_facts_but_paths_are_not():
    env = {"TORCHINDUCTOR_FREEZING": "1", "TORCH_COMPILE_THREADS": "4", "TORCHINDUCTOR_CACHE_DIR": "/x",
           "TORCH_COMPILE_CACHE_KEY_TAG": "t", "HOME": "/root", "HOSTNAME": "pod-123"}  # fmt: skip
    facts = f.probe_settings(env)
    assert facts == {"env.TORCHINDUCTOR_FREEZING": "1", "env.TORCH_COMPILE_THREADS": "4"}


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, 4),
        ({"OMP_NUM_THREADS": "1"}, 1),
        ({"OMP_NUM_THREADS": "3"}, 3),
        ({"OMP_NUM_THREADS": "16"}, 4),  # capped at the machine's cores
        ({"OMP_NUM_THREADS": "16", "MKL_DYNAMIC": "FALSE"}, 16),
        ({"OMP_NUM_THREADS": "abc"}, 4),
        ({"OMP_NUM_THREADS": "2,1"}, 2),
        ({"MKL_NUM_THREADS": "1", "OMP_NUM_THREADS": "3"}, 1),  # MKL's own setting wins
        ({"MKL_NUM_THREADS": "abc"}, 1),
        ({"MKL_NUM_THREADS": "0", "OMP_NUM_THREADS": "2"}, 2),
    ],
)
def test_thread_count_rule(env, expected):
    assert f.default_threads(env, cores=4) == expected


def test_dynamic_threads_leave_the_count_out():
    assert f.probe_threads({"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1", "OMP_NUM_THREADS": "2"}) == {
        "cpu.threads": "dynamic",
        "env.OMP_NUM_THREADS": "2",
    }


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "1"}, {"MKL_NUM_THREADS": "1"}])
def test_thread_count_matches_torch(env):
    pytest.importorskip("torch")
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | env
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True)
    assert int(out.stdout) == f.default_threads(full)


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


def test_torch_facts_are_read_without_importing_it():
    pytest.importorskip("torch")  # the metadata probe needs an installed torch to compare with
    code = "import torch, json; print(json.dumps([torch.__version__, torch.version.git_version]))"
    version, git = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout)  # fmt: skip
    facts = f.probe_torch(os.environ)
    assert facts["torch.version"] == version and facts["torch.git"] == git


def test_facts_file_reproduces_another_machines_fingerprint(tmp_path):
    from click.testing import CliRunner

    from kcache.cli import main

    there = f.compute({**BASE, "torch.version": "2.13.0+cu128", "gpu.sm": "sm_90"})
    path = tmp_path / "facts.json"
    path.write_text(json.dumps(there.as_dict()))

    def no_probing(env):
        raise AssertionError("a facts file must replace probing")

    assert f.collect(facts_file=path, probes=[no_probing]) == there
    other_model = f.collect(facts_file=path, model="other", probes=[no_probing])
    assert other_model.toolchain_key == there.toolchain_key and other_model.facts["model.id"] == "other"
    out = CliRunner().invoke(main, ["fingerprint", "--json"], env={"KCACHE_FACTS_FILE": str(path)})
    assert json.loads(out.output)["bundle_key"] == there.bundle_key
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps(dict(there.facts)))
    assert f.collect(facts_file=flat, probes=[no_probing]) == there


@pytest.mark.parametrize("content", ["[1]", '{"facts": {"a": 1}}', "not json"])
def test_bad_facts_file_is_a_config_error(tmp_path, content):
    path = tmp_path / "facts.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match="facts-file"):
        f.collect(facts_file=path)
