"""Probes: what this machine is. Pure rules (ISA, features, threads) are tested with given inputs."""

import json
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from kcache import probes as p

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
    assert p.pick_isa("x86_64", flags, env) == expected


def test_settings_that_change_keys_are_facts_but_paths_are_not():
    env = {"TORCHINDUCTOR_FREEZING": "1", "TORCH_COMPILE_THREADS": "4", "TORCHINDUCTOR_CACHE_DIR": "/x",
           "TORCH_COMPILE_CACHE_KEY_TAG": "t", "HOME": "/root", "HOSTNAME": "pod-123"}  # fmt: skip
    facts = p.probe_settings(env)
    # A tag the user sets is in torch's FX graph key, so it must be in ours.
    assert facts == {"env.TORCHINDUCTOR_FREEZING": "1", "env.TORCH_COMPILE_THREADS": "4",
                     "env.TORCH_COMPILE_CACHE_KEY_TAG": "t"}  # fmt: skip


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
    assert p.default_threads(env, cores=4) == expected


def test_dynamic_threads_leave_the_count_out():
    assert p.probe_threads({"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1", "OMP_NUM_THREADS": "2"}) == {
        "cpu.threads": "dynamic",
        "env.OMP_NUM_THREADS": "2",
    }


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "1"}, {"MKL_NUM_THREADS": "1"}])
def test_thread_count_matches_torch(env):
    pytest.importorskip("torch")
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | env
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True)
    assert int(out.stdout) == p.default_threads(full)


def test_torch_facts_are_read_without_importing_it():
    pytest.importorskip("torch")  # the metadata probe needs an installed torch to compare with
    code = "import torch, json; print(json.dumps([torch.__version__, torch.version.git_version]))"
    version, git = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout)  # fmt: skip
    facts = p.probe_torch(os.environ)
    assert facts["torch.version"] == version and facts["torch.git"] == git


# ---- CPU features ------------------------------------------------------------------------------

# Two CPUs with the model string and the twelve flags the first schema keyed, but not the same
# -march=native: a .so from the first SIGILLs on the second.
ZEN3_LIKE = "fma avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 gfni vaes vpclmulqdq avx_vnni"
POORER = "fma avx2 avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16"


def test_features_beyond_the_isa_level_are_keyed():
    rich, poor = p.cpu_features("x86_64", set(ZEN3_LIKE.split())), p.cpu_features("x86_64", set(POORER.split()))
    assert rich != poor
    assert {"gfni", "vaes", "vpclmulqdq", "avx_vnni"} <= set(rich.split())
    assert p.pick_isa("x86_64", set(ZEN3_LIKE.split()), {}) == p.pick_isa("x86_64", set(POORER.split()), {})


def test_features_leave_out_what_is_not_an_instruction_set():
    flags = {"avx2", "amx_fp16", "hypervisor", "constant_tsc", "ht", "nx", "x2apic", "arat", "fsrm"}
    assert p.cpu_features("x86_64", flags) == "amx_fp16 avx2"
    assert p.cpu_features("aarch64", {"fp", "asimd", "evtstrm", "sve", "cpuid"}) == "asimd fp sve"
    assert p.cpu_features("riscv64", {"a"}) == "none"


def test_features_are_sorted_whatever_the_flag_order():
    assert p.cpu_features("x86_64", {"sse2", "avx2", "fma"}) == "avx2 fma sse2"


def test_cpu_probe_has_features_and_no_model():
    facts = p.probe_cpu({}, {"model name": "Some CPU", "flags": POORER})
    if platform.machine() == "x86_64":
        assert facts["cpu.features"] == " ".join(sorted(POORER.split()))
    assert "cpu.model" not in facts and facts["cpu.isa"]


# gcc's -m option -> the /proc/cpuinfo flag that names the same extension (same name when absent).
GCC_TO_CPUINFO = {
    "sse3": "pni", "sse4.1": "sse4_1", "sse4.2": "sse4_2", "sse4": "sse4_2", "crc32": "sse4_2", "bmi": "bmi1",
    "lzcnt": "abm", "sahf": "lahf_lm", "prfchw": "3dnowprefetch", "sha": "sha_ni", "pclmul": "pclmulqdq",
    "rdrnd": "rdrand", "mwait": "monitor", "shstk": "user_shstk", "avxvnni": "avx_vnni",
    "avx512vnni": "avx512_vnni", "avx512vbmi2": "avx512_vbmi2", "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "avx512vp2intersect": "avx512_vp2intersect", "avx5124fmaps": "avx512_4fmaps", "avx5124vnniw": "avx512_4vnniw",
    "amx-tile": "amx_tile", "amx-bf16": "amx_bf16", "amx-int8": "amx_int8", "amx-fp16": "amx_fp16",
    "avxvnniint8": "avx_vnni_int8", "avxifma": "avx_ifma", "avxneconvert": "avx_ne_convert",
}  # fmt: skip
# -m options that are ABI or code-generation switches, not instruction-set extensions.
GCC_NOT_ISA = {
    "64", "80387", "128bit-long-double", "long-double-80", "fancy-math-387", "fp-ret-in-387", "hard-float",
    "ieee-fp", "red-zone", "push-args", "align-stringops", "stv", "vzeroupper", "tls-direct-seg-refs", "glibc",
    "direct-extern-access", "sse2avx", "cx8",
}  # fmt: skip
# Enabled by gcc from CPUID, hidden from /proc/cpuinfo on some VMs, emitted only through intrinsics.
GCC_INTRINSIC_ONLY = {"rdseed", "monitor", "user_shstk"}


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("gcc"), reason="needs gcc on x86_64")
def test_every_feature_gcc_march_native_enables_is_keyed():
    out = subprocess.run(["gcc", "-march=native", "-Q", "--help=target"], capture_output=True, text=True).stdout
    enabled = re.findall(r"^\s+-m([\w.-]+)\s+\[enabled\]", out, re.M)
    wanted = {GCC_TO_CPUINFO.get(opt, opt) for opt in enabled if opt not in GCC_NOT_ISA}
    keyed = set(p.probe_cpu(os.environ)["cpu.features"].split())
    assert wanted - keyed - GCC_INTRINSIC_ONLY == set()
    assert "amx_fp16" in p._X86_FEATURES
