"""Probes: what this machine is. Pure rules (ISA, features, threads) are tested with given inputs."""

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kcache import probes as p
from kcache.errors import ConfigError

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


SVE_BF16 = {"fp", "asimd", "sve", "bf16"}


@pytest.mark.parametrize(
    "arch, flags, env, sve_bits, expected",
    [
        # torch reads cpuinfo's SVE length (prctl PR_SVE_GET_VL): 128 bits gives VecSVE(128), any
        # other length (256, 512, or 0 when prctl fails) VecSVE(256): another -msve-vector-bits.
        ("aarch64", SVE_BF16, {}, 128, "sve128"),
        ("aarch64", SVE_BF16, {}, 256, "sve256"),
        ("aarch64", SVE_BF16, {}, 512, "sve256"),
        ("aarch64", SVE_BF16, {}, 0, "sve256"),
        ("aarch64", SVE_BF16 - {"bf16"} | {"svebf16"}, {}, 128, "sve128"),  # cpuinfo's bf16 takes either
        ("aarch64", {"fp", "asimd", "sve2", "bf16"}, {}, 256, "sve256"),
        ("aarch64", {"fp", "asimd", "sve"}, {}, 256, "neon"),
        ("aarch64", {"fp", "asimd"}, {}, 0, "neon"),
        # torch maps ATEN_CPU_CAPABILITY=default to no vector ISA on every architecture.
        ("aarch64", SVE_BF16, {"ATEN_CPU_CAPABILITY": "default"}, 256, "none"),
        ("aarch64", {"fp", "asimd"}, {"ATEN_CPU_CAPABILITY": "default"}, 0, "none"),
        ("aarch64", {"fp", "asimd"}, {"ATEN_CPU_CAPABILITY": "avx2"}, 0, "neon"),  # not an aarch64 ISA: ignored
        ("ppc64le", set(), {}, 0, "vsx"),
        ("ppc64le", set(), {"ATEN_CPU_CAPABILITY": "default"}, 0, "none"),
        ("s390x", {"zarch", "vx", "vxe", "vxe2"}, {}, 0, "zvector"),
        ("s390x", {"zarch", "vx"}, {}, 0, "none"),  # torch picks ZVECTOR only with vxe
        ("s390x", {"zarch", "vx", "vxe"}, {"ATEN_CPU_CAPABILITY": "default"}, 0, "none"),
        ("riscv64", {"a"}, {}, 0, "none"),
    ],
)
def test_isa_choice_mirrors_inductor_off_x86(arch, flags, env, sve_bits, expected):
    assert p.pick_isa(arch, flags, env, sve_bits) == expected


def test_the_sve_vector_length_is_keyed():
    # The same Features line on a 128-bit and a 256-bit SVE machine: torch builds different code.
    info = {"Features": "fp asimd evtstrm sve sve2 bf16 cpuid"}
    narrow = p.probe_cpu({}, info, arch="aarch64", sve_bits=lambda: 128)
    wide = p.probe_cpu({}, info, arch="aarch64", sve_bits=lambda: 256)
    assert narrow != wide
    assert (narrow["cpu.isa"], wide["cpu.isa"]) == ("sve128", "sve256")
    assert narrow["cpu.features"] == wide["cpu.features"] == "asimd bf16 fp sve sve2"


def test_the_sve_length_is_read_as_cpuinfo_reads_it():
    bits = p.sve_vector_bits()
    default = Path("/proc/sys/abi/sve_default_vector_length")
    if platform.machine() != "aarch64" or not default.exists():
        assert bits == 0  # prctl(PR_SVE_GET_VL) fails without SVE; torch then sees length 0
    else:  # a fresh process runs with the default length, in bytes there
        assert bits == 8 * int(default.read_text())


POWER9 = {"processor": "0", "cpu": "POWER9 (raw), altivec supported", "clock": "2300.000000MHz",
          "revision": "2.2 (pvr 004e 1202)"}  # fmt: skip
POWER10 = {**POWER9, "cpu": "POWER10 (raw), altivec supported", "revision": "2.0 (pvr 0080 0200)"}


def test_the_power_model_is_keyed():
    # ppc64le has no feature line, and torch compiles with -mcpu=native: the model sets the ISA level.
    nine, ten = (p.probe_cpu({}, info, arch="ppc64le") for info in (POWER9, POWER10))
    assert nine["cpu.model"] == "POWER9 (raw), altivec supported" and nine != ten
    assert nine["cpu.isa"] == ten["cpu.isa"] == "vsx"
    assert p.check_cpu({}, POWER9, arch="ppc64le") == {"cpu.model": POWER9["cpu"]}  # a node fact: checked


Z15 = {"vendor_id": "IBM/S390", "# processors": "4",
       "features": "esan3 zarch stfle msa ldisp eimm dfp edat etf3eh highgprs te vx vxd vxe gs vxe2 vxp sort dflt sie",
       "processor 0": "version = FF,  identification = 0133E8,  machine = 8561"}  # fmt: skip
Z14 = {**Z15, "features": "esan3 zarch stfle msa ldisp eimm dfp edat etf3eh highgprs te vx vxd vxe gs sie",
       "processor 0": "version = FF,  identification = 0133E8,  machine = 3906"}  # fmt: skip
Z13 = {**Z15, "features": "esan3 zarch stfle msa ldisp eimm dfp edat etf3eh highgprs te vx sie",
       "processor 0": "version = FF,  identification = 2F1D47,  machine = 2964"}  # fmt: skip


def test_s390x_features_and_machine_type_are_keyed():
    # The kernel spells the line 'features'; gcc's -march=native picks -march from the machine type.
    z15, z14, z13 = (p.probe_cpu({}, info, arch="s390x") for info in (Z15, Z14, Z13))
    assert {"vx", "vxe", "vxe2"} <= set(z15["cpu.features"].split())
    assert z15["cpu.features"] != z14["cpu.features"] and z15["cpu.model"] == "8561"
    assert (z15["cpu.isa"], z14["cpu.isa"], z13["cpu.isa"]) == ("zvector", "zvector", "none")
    same_features = {**Z15, "processor 0": Z14["processor 0"]}
    assert p.probe_cpu({}, same_features, arch="s390x") != z15
    # the identification is the machine's serial: replicas differ in it, so it is not keyed
    assert p.probe_cpu({}, {**Z15, "processor 0": Z15["processor 0"].replace("0133E8", "0288A1")},
                       arch="s390x") == z15  # fmt: skip
    assert p.check_cpu({}, Z13, arch="s390x") == {"cpu.features": z13["cpu.features"], "cpu.model": "2964"}


def test_settings_that_change_keys_are_facts_but_paths_are_not():
    env = {"TORCHINDUCTOR_FREEZING": "1", "TORCH_COMPILE_THREADS": "4", "TORCHINDUCTOR_CACHE_DIR": "/x",
           "TORCH_COMPILE_CACHE_KEY_TAG": "t", "HOME": "/root", "HOSTNAME": "pod-123"}  # fmt: skip
    facts = p.probe_settings(env)
    # A tag the user sets is in torch's FX graph key, so it must be in ours.
    assert facts == {"env.TORCHINDUCTOR_FREEZING": "1", "env.TORCH_COMPILE_THREADS": "4",
                     "env.TORCH_COMPILE_CACHE_KEY_TAG": "t"}  # fmt: skip


def test_asking_torch_to_install_gxx_is_a_setting():
    # With it set (and no CXX), Inductor compiles with a conda g++ of its own, not the one probed.
    assert p.probe_settings({"TORCH_INDUCTOR_INSTALL_GXX": "1"}) == {"env.TORCH_INDUCTOR_INSTALL_GXX": "1"}
    assert p.probe_settings({"TORCH_INDUCTOR_INSTALL_GXX": ""}) == {}  # torch tests it for truth


GCC_SEARCH_ENV = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH", "LIBRARY_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH")


@pytest.mark.parametrize("name", GCC_SEARCH_ENV)
def test_where_gcc_looks_for_headers_and_libraries_is_a_fact_when_set(name):
    # torch keys a C++ build by its source and command line; g++ also reads these, so the same
    # command line builds another .so. Set but empty counts: gcc then searches ./ (LIBRARY_PATH,
    # COMPILER_PATH) or a relative exec prefix.
    assert p.probe_settings({name: "/opt/x"}) == {f"env.{name}": "/opt/x"}
    assert p.probe_settings({name: ""}) == {f"env.{name}": ""}
    assert p.probe_settings({}) == {}  # unset: no fact, so keys of machines without them stay as they were



def test_the_edits_clang_makes_to_every_command_line_are_a_fact_when_set():
    # CCC_OVERRIDE_OPTIONS="+-ffast-math" adds the flag to every clang command: torch's key (the
    # command line it passes) stays, the kernels change. No clang here to measure: clang's driver
    # documents it (Driver.cpp applyOverrideOptions).
    assert p.probe_settings({"CCC_OVERRIDE_OPTIONS": "+-ffast-math"}) == {"env.CCC_OVERRIDE_OPTIONS": "+-ffast-math"}
    assert p.probe_settings({"CCC_OVERRIDE_OPTIONS": ""}) == {}  # nothing to apply: keys stay

def test_cpath_changes_what_the_same_gxx_command_builds_and_the_key(tmp_path):
    """Measured with this machine's g++: one command line, two CPATHs, two programs."""
    from kcache import fingerprint

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    (tmp_path / "k.cpp").write_text('#include "kernel_width.h"\nint width() { return WIDTH; }\n')
    built = {}
    for width in ("8", "16"):
        inc = tmp_path / f"inc{width}"
        inc.mkdir()
        (inc / "kernel_width.h").write_text(f"#define WIDTH {width}\n")
        env = {**os.environ, "CPATH": str(inc)}
        subprocess.run([gxx, "-E", "-P", "k.cpp", "-o", f"k{width}.i"], cwd=tmp_path, env=env, check=True)
        built[width] = ((tmp_path / f"k{width}.i").read_text(), fingerprint.compute(p.probe_settings(env)).bundle_key)
    assert built["8"][0] != built["16"][0]
    assert built["8"][1] != built["16"][1]


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
        # "²".isdigit() is true and int() refuses it, as it refuses more than 4300 digits: not numbers
        ({"OMP_NUM_THREADS": "\u00b2"}, 4),
        ({"OMP_NUM_THREADS": "9" * 4400}, 4),
        ({"MKL_NUM_THREADS": "\u00b2"}, 1),
        # MKL reads digits as a 32-bit int, however many (THREAD_CASES measures it): not as junk
        ({"MKL_NUM_THREADS": "9" * 4400}, 4),
        ({"MKL_NUM_THREADS": "00", "OMP_NUM_THREADS": "3"}, 3),  # zero is unset to MKL
        ({"MKL_NUM_THREADS": " 2"}, 1),  # a blank is junk to MKL: one thread
    ],
)
def test_thread_count_rule(env, expected):
    assert p.default_threads(env, cores=4, mkl=True) == expected  # a torch built with MKL (x86 wheels)


def test_dynamic_threads_leave_the_count_out():
    assert p.probe_threads({"TORCHINDUCTOR_CPP_DYNAMIC_THREADS": "1", "OMP_NUM_THREADS": "2"}) == {
        "cpu.threads": "dynamic",
        "env.OMP_NUM_THREADS": "2",
    }


@pytest.mark.parametrize("env", [{}, {"OMP_NUM_THREADS": "1"}, {"MKL_NUM_THREADS": "1"}, {"MKL_NUM_THREADS": "00"},
                                 {"MKL_NUM_THREADS": " 2"}, {"OMP_NUM_THREADS": "+1"}])  # fmt: skip
def test_thread_count_matches_torch(env):  # through `import torch`, as Inductor asks it
    pytest.importorskip("torch")
    full = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")} | env
    code = "import torch; print(torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, check=True)
    assert int(out.stdout) == p.default_threads(full)


# Odd values of the thread settings, each measured against torch's own library below. Under MKL (x86
# wheels) MKL parses MKL_NUM_THREADS (digits only, else one thread; 0 as unset) and libgomp
# OMP_NUM_THREADS (strtoul items); without MKL (aarch64 wheels) ATen's std::stoi parses both.
_ODD = ["1", "3", " 3", "3 ", "\t3", "+3", "03", "3abc", "3,5", "3,", "3, 5", " 3 ,5", "3,0", "-3", "-0", "0", "00",
        "", "abc", ",3", "3.5", "0x3", "\u00b2", "99999999999", "2147483647", "2147483648", "4294967296",
        "4294967299", "18446744073709551615", "18446744073709551616", "9" * 4400]  # fmt: skip
THREAD_CASES = (
    [{}]
    + [{"OMP_NUM_THREADS": v} for v in _ODD if v != "\u00b2"]
    + [{"MKL_NUM_THREADS": v} for v in _ODD]
    + [{"MKL_NUM_THREADS": m, "OMP_NUM_THREADS": o} for m, o in
       [(" 2", "1"), ("00", "1"), ("0", "3"), ("abc", "3"), ("2147483648", "3"), ("", "3"), ("1", "3")]]
    + [{"MKL_DYNAMIC": d, **s} for d in ("false", " FALSE", "0", "no") for s in
       ({"MKL_NUM_THREADS": "3"}, {"OMP_NUM_THREADS": "3"}, {"MKL_NUM_THREADS": "99999999999"},
        {"OMP_NUM_THREADS": "2147483648"}, {"OMP_NUM_THREADS": "6442450944"})]
)  # fmt: skip


def test_thread_count_agrees_with_torch_for_odd_values():
    """MKL_NUM_THREADS=00 gave torch the core count where kcache keyed 1, and " 2" gave torch 1 where
    kcache keyed 2: each a key shared by pods whose kernels differ. Every case is run in a fresh process
    of torch's own library: at::get_num_threads() (what Inductor keys) and at::intraop_default_num_threads(),
    which a torch without MKL (aarch64 wheels) sizes its pool by."""
    torch_dir = p.engines.package_dir("torch")
    lib = None if torch_dir is None else torch_dir / "lib" / "libtorch_cpu.so"
    if lib is None or not lib.is_file():
        pytest.skip("no torch CPU library")
    from concurrent.futures import ThreadPoolExecutor

    code = ("import ctypes, sys; lib = ctypes.CDLL(sys.argv[1]); "
            "print(lib._ZN2at15get_num_threadsEv(), lib._ZN2at27intraop_default_num_threadsEv())")  # fmt: skip
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC")}

    def measure(env):
        run = subprocess.run([sys.executable, "-c", code, str(lib)], env={**base, **env}, capture_output=True,
                             text=True, check=True)  # fmt: skip
        return tuple(map(int, run.stdout.split()))

    with ThreadPoolExecutor(2) as pool:
        measured = list(pool.map(measure, THREAD_CASES))
    with_mkl = p.torch_uses_mkl(torch_dir)
    ours = [(p.default_threads({**base, **env}, mkl=with_mkl), p.default_threads({**base, **env}, mkl=False))
            for env in THREAD_CASES]  # fmt: skip
    assert [(env, m) for env, m in zip(THREAD_CASES, measured)] == [(env, o) for env, o in zip(THREAD_CASES, ours)]


def test_thread_count_under_an_affinity_mask_agrees_with_torch():
    """MKL counts the cores this process may run on; ATen without MKL asks cpuinfo, which counts the
    machine's (a pod pinned to some cores of a bigger node). Measured with torch's library in one process."""
    torch_dir = p.engines.package_dir("torch")
    lib = None if torch_dir is None else torch_dir / "lib" / "libtorch_cpu.so"
    if lib is None or not lib.is_file() or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("no torch CPU library, or one CPU only")
    code = """import ctypes, json, os, sys
from kcache import probes
env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC")}
ours = [probes.default_threads(env, mkl=probes.torch_uses_mkl()), probes.default_threads(env, mkl=False)]
lib = ctypes.CDLL(sys.argv[1])
print(json.dumps([ours, [lib._ZN2at15get_num_threadsEv(), lib._ZN2at27intraop_default_num_threadsEv()]]))"""
    one = {min(os.sched_getaffinity(0))}
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", code, str(lib)], env=env, capture_output=True, text=True,
                         check=True, preexec_fn=lambda: os.sched_setaffinity(0, one))  # fmt: skip
    ours, torch_says = json.loads(out.stdout)
    assert ours == torch_says


def test_which_thread_rule_follows_how_torch_was_built(tmp_path):
    config = tmp_path / "include" / "ATen" / "Config.h"
    config.parent.mkdir(parents=True)
    mkl = "#define AT_MKL_ENABLED() 1\n#define AT_MKL_SEQUENTIAL() 0\n#define AT_PARALLEL_OPENMP 1\n"
    config.write_text(mkl)
    assert p.torch_uses_mkl(tmp_path)
    config.write_text(mkl.replace("AT_MKL_ENABLED() 1", "AT_MKL_ENABLED() 0"))  # aarch64 wheels: no MKL
    assert not p.torch_uses_mkl(tmp_path)
    config.write_text(mkl.replace("SEQUENTIAL() 0", "SEQUENTIAL() 1"))  # ATen then sizes its pool itself
    assert not p.torch_uses_mkl(tmp_path)
    # the same setting, two counts: MKL reads " 2" as one thread, std::stoi as two
    assert p.default_threads({"MKL_NUM_THREADS": " 2"}, cores=4, mkl=True) == 1
    assert p.default_threads({"MKL_NUM_THREADS": " 2"}, cores=4, mkl=False) == 2
    # without MKL, MKL_DYNAMIC caps nothing and MKL_DOMAIN_NUM_THREADS is no one's setting
    assert p.default_threads({"OMP_NUM_THREADS": "16"}, cores=4, mkl=False) == 16
    assert p.probe_threads({"MKL_DOMAIN_NUM_THREADS": "MKL_DOMAIN_ALL=1", "OMP_NUM_THREADS": "3"}, mkl=False) == {
        "cpu.threads": "3", "env.MKL_DOMAIN_NUM_THREADS": "MKL_DOMAIN_ALL=1", "env.OMP_NUM_THREADS": "3"}


def test_torch_facts_are_read_without_importing_it():
    pytest.importorskip("torch")  # the metadata probe needs an installed torch to compare with
    code = "import torch, json; print(json.dumps([torch.__version__, torch.version.git_version]))"
    version, git = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout)  # fmt: skip
    facts = p.probe_torch(os.environ)
    assert facts["torch.version"] == version and facts["torch.git"] == git


def test_torch_path_is_the_path_torch_compiles_with_through_a_symlinked_site_packages(tmp_path):
    """torch puts -I<torch>/include and -L<torch>/lib on every C++ build (cpp_extension._TORCH_PATH:
    os.path.abspath of its own file, symlinks kept). Keyed through resolve(), a pod importing torch
    through a symlinked site-packages shared the key of one that did not, and its hit rebuilt every kernel."""
    torch_dir = p.engines.package_dir("torch")
    if torch_dir is None:
        pytest.skip("no torch")
    link = tmp_path / "site"
    link.symlink_to(torch_dir.resolve().parent, target_is_directory=True)
    code = """import json, os
from kcache import probes
import torch.utils.cpp_extension as ce
print(json.dumps([probes.probe_torch(os.environ)["torch.path"], ce.include_paths()[0], ce.TORCH_LIB_PATH]))"""
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(link)])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    fact, include, lib = json.loads(out.stdout)
    assert include == os.path.join(str(link), "torch", "include")  # torch compiles with the link's path
    assert fact == str(link)
    assert (include, lib) == (os.path.join(fact, "torch", "include"), os.path.join(fact, "torch", "lib"))
    # without a symlink the fact is what it always was: the resolved install's parent
    assert p.probe_torch(os.environ)["torch.path"] == str(torch_dir.resolve().parent)


def test_a_debug_python_is_another_python():
    """A debug build (sys.abiflags "d") lays objects out differently: extension modules, Triton's
    launchers and torch's extension builds (named py311d_...) of a normal build do not load in it."""
    debug = next(filter(None, map(shutil.which, ("python3.11d", "python3-dbg", "python3d"))), None)
    if debug is None:
        pytest.skip("no debug build of Python here (apt-get install python3.11-dbg)")
    code = "import json, platform, sys; print(json.dumps([platform.python_version_tuple()[:2], sys.abiflags]))"
    (major, minor), abiflags = json.loads(subprocess.run([debug, "-c", code], capture_output=True, text=True,
                                                         check=True).stdout)  # fmt: skip
    assert "d" in abiflags
    assert p.python_fact(f"{major}.{minor}", abiflags) == f"{major}.{minor}{abiflags}"
    assert p.python_fact(f"{major}.{minor}", abiflags) != p.python_fact(f"{major}.{minor}", "")


def test_a_normal_python_keeps_its_fact():
    assert sys.abiflags == ""  # the venv's Python is a normal build
    assert p.probe_platform({})["python"] == "{}.{}".format(*sys.version_info[:2])


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
    facts = p.probe_cpu({}, {"model name": "Some CPU", "flags": POORER}, arch="x86_64")
    assert facts == {"cpu.features": " ".join(sorted(POORER.split())), "cpu.isa": "avx512_vnni"}
    arm = p.probe_cpu({}, {"CPU part": "0xd40", "Features": "fp asimd"}, arch="aarch64", sve_bits=lambda: 0)
    assert "cpu.model" not in arm


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
# XSAVES is a supervisor instruction (CPL 0): user code that names it faults, so no kernel uses it; a
# znver2 VM's gcc enables -mxsaves although the hypervisor hides the flag.
GCC_INTRINSIC_ONLY = {"rdseed", "monitor", "user_shstk", "xsaves"}


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("gcc"), reason="needs gcc on x86_64")
def test_every_feature_gcc_march_native_enables_is_keyed():
    out = subprocess.run(["gcc", "-march=native", "-Q", "--help=target"], capture_output=True, text=True).stdout
    enabled = re.findall(r"^\s+-m([\w.-]+)\s+\[enabled\]", out, re.M)
    wanted = {GCC_TO_CPUINFO.get(opt, opt) for opt in enabled if opt not in GCC_NOT_ISA}
    keyed = set(p.probe_cpu(os.environ)["cpu.features"].split())
    assert wanted - keyed - GCC_INTRINSIC_ONLY == set()
    assert "amx_fp16" in p._X86_FEATURES


# ---- what the compiler's -march=native turns on --------------------------------------------------

# `g++ -### -march=native` on two x86 CPUs whose /proc/cpuinfo flags agree: Linux lists AVX-NE-CONVERT,
# AVX10 (and its version) only for KVM (arch/x86/kvm/reverse_cpuid.h) and shows no flag whose
# cpufeatures.h comment names none (APX), while gcc reads CPUID and turns them on. torch 2.13's
# ATen/cpu/vec/vec512/vec512_float8.h, which Inductor's CPU kernels include, uses AVX10.2 instructions
# under __AVX10_2__: a kernel built on the first CPU dies with SIGILL on the second.
GCC_DRIVER = (
    'Using built-in specs.\nCOLLECT_GCC=g++\nTarget: x86_64-linux-gnu\ngcc version 15.1.0 (GCC)\n'
    ' /usr/libexec/gcc/x86_64-linux-gnu/15/cc1plus -E -quiet -imultiarch x86_64-linux-gnu -D_GNU_SOURCE'
    ' /dev/null "-march=graniterapids" -mmmx -mpopcnt -msse -msse2 -mavx -mavx2 -mavx512f -mavx512bf16'
    ' -mno-fma4 {extra} -mamx-tile --param "l1-cache-size=48" --param "l2-cache-size=2048"'
    ' "-mtune=graniterapids" -dumpbase null\n'
)  # fmt: skip
AVX10_2 = "-mavx10.2 -mapxf -mavxneconvert"
AVX10_1 = "-mno-avx10.2 -mno-apxf -mno-avxneconvert"


def fake_compiler(directory, driver_text: str):
    """A `g++` that answers `-v` as one compiler and `-###` with `driver_text`, as gcc writes both (stderr)."""
    directory.mkdir()
    tool = directory / "g++"
    said = directory / "driver.txt"
    said.write_text(driver_text)
    tool.write_text('#!/bin/sh\ncase "$1" in -v) echo "gcc version 15.1.0 (GCC)" >&2 ;; '
                    f'-\\#\\#\\#) cat "{said}" >&2 ;; esac\n')  # fmt: skip
    tool.chmod(0o755)
    return directory


def test_what_the_compilers_march_native_turns_on_is_keyed(tmp_path, monkeypatch):
    rich = fake_compiler(tmp_path / "avx10.2", GCC_DRIVER.format(extra=AVX10_2))
    poor = fake_compiler(tmp_path / "avx10.1", GCC_DRIVER.format(extra=AVX10_1))
    seen = {}
    for cpu in (rich, poor):
        monkeypatch.setenv("PATH", f"{cpu}{os.pathsep}{os.environ['PATH']}")  # its g++ first
        seen[cpu] = p.probe_compiler({}, arch="x86_64")
    assert {n for n in seen[rich] if seen[rich][n] != seen[poor][n]} == {"cxx.native"}
    native = set(seen[rich]["cxx.native"].split())
    assert {"avx10.2", "apxf", "avxneconvert", "avx512f", "amx-tile"} <= native
    assert not {"no-fma4", "march=graniterapids", "tune=graniterapids"} & native  # neither off nor tuning
    assert set(seen[rich]["cxx.native"].split()) - set(seen[poor]["cxx.native"].split()) == {
        "avx10.2", "apxf", "avxneconvert"}  # fmt: skip


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc/cpuinfo is Linux's")
def test_a_cpuinfo_that_cannot_be_read_is_refused_not_keyed_as_a_cpu_without_features(tmp_path, monkeypatch):
    """An unreadable /proc/cpuinfo gave cpu.features and cpu.isa `none`, facts every such machine shares
    (torch reads CPUID itself and still builds AVX-512 kernels there), so an AVX-512 node's kernels were
    filed under a key an AVX2 node restores. The node check of a facts file still takes nothing from it."""
    monkeypatch.setattr(p, "CPUINFO", tmp_path / "cpuinfo")  # a path that is not there
    with pytest.raises(ConfigError) as caught:
        p.probe_cpu({})
    assert "cpuinfo" in str(caught.value)
    assert p.check_cpu({}) == {}


def compiler_that_cannot_answer(directory, how: str):
    """A `g++` on PATH that is found but gives no answer: one whose interpreter is missing (exec fails),
    or one that is still starting when the probe gives up (a lazily pulled image's first exec)."""
    directory.mkdir()
    tool = directory / "g++"
    tool.write_text("#!/nonexistent/sh\n" if how == "unrunnable" else "#!/bin/sh\nexec /bin/sleep 30\n")
    tool.chmod(0o755)
    return directory


@pytest.mark.parametrize("how", ["unrunnable", "too slow"])
def test_a_compiler_that_gives_no_answer_is_refused_not_keyed_as_any_other(tmp_path, monkeypatch, how):
    """The probe kept "" as the `-v` text and `none` as -march=native's ISA when the compiler could not be
    run or timed out: any two compilers that failed so (gcc 12 and gcc 14 images, an AVX10.2 node and an
    AVX10.1 one with the same cpuinfo flags) shared cxx.version, cxx.v_hash and cxx.native, so one's
    kernels were published under a key the other restores."""
    monkeypatch.setattr(p, "COMPILER_PROBE_TIMEOUT_S", 0.5)
    monkeypatch.setenv("PATH", str(compiler_that_cannot_answer(tmp_path / "cc", how)))  # the only g++
    with pytest.raises(ConfigError) as caught:
        p.probe_compiler({}, arch="x86_64")
    assert "g++" in str(caught.value) and "-v" in str(caught.value)
    with pytest.raises(ConfigError):
        p.probe_compiler({"CXX": "g++"}, arch="aarch64")  # -v alone is keyed off x86


def test_clang_names_what_march_native_turns_on_as_target_features():
    clang = (' "/usr/lib/llvm-18/bin/clang" "-cc1" "-triple" "x86_64-pc-linux-gnu" "-E" "-mrelocation-model" "pic"'
             ' "-target-cpu" "znver4" "-target-feature" "+avx512f" "-target-feature" "-avx10.2-512"'
             ' "-target-feature" "+avxvnni" "-x" "c++" "/dev/null"\n')  # fmt: skip
    assert p.native_isa(clang) == "avx512f avxvnni"
    assert p.native_isa("") == p.NONE  # a compiler that cannot say: no vector code either


def test_off_x86_the_cpuinfo_features_are_what_march_native_reads(tmp_path, monkeypatch):
    """gcc reads /proc/cpuinfo on aarch64 and s390x (cpu.features), the model on ppc64le (cpu.model)."""
    monkeypatch.setenv("PATH", str(fake_compiler(tmp_path / "cc", GCC_DRIVER.format(extra=AVX10_2))))
    assert "cxx.native" not in p.probe_compiler({}, arch="aarch64")


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("g++"), reason="needs g++ on x86_64")
def test_cxx_native_is_what_this_gcc_turns_on_here():
    out = subprocess.run(["g++", "-march=native", "-Q", "--help=target"], capture_output=True, text=True).stdout
    enabled = set(re.findall(r"^\s+-m([\w.-]+)\s+\[enabled\]", out, re.M))
    native = set(p.probe_compiler({"CXX": "g++"})["cxx.native"].split())
    assert native <= enabled  # only instruction sets the driver turned on, no ABI switch or tuning
    # every AVX extension /proc/cpuinfo shows here, gcc turns on (under its own name)
    shown = {f for f in p.probe_cpu({})["cpu.features"].split() if f.startswith("avx")}
    assert shown <= {GCC_TO_CPUINFO.get(opt, opt) for opt in native}


@pytest.mark.parametrize("setting", ["MKL_DOMAIN_ALL=1", "MKL_DOMAIN_ALL=2", "MKL_DOMAIN_BLAS=8"])
def test_an_mkl_domain_setting_keys_the_cores_it_depends_on(setting):
    """torch takes MKL's count, which MKL_DOMAIN_NUM_THREADS changes (ALL=1 on 2 CPUs gave 1 thread; with
    OMP_NUM_THREADS=1, ALL=2 gave 2; MKL_DYNAMIC=false, ALL=8 gave 8), where the rule above gave the
    cores: machines whose torch ran different counts could share a key. It is not worked out: the raw
    setting and the cores it is read against are keyed, so only the same machine shape shares one."""
    env = {"MKL_DOMAIN_NUM_THREADS": setting, "OMP_NUM_THREADS": "1"}
    threads = p.probe_threads(env)["cpu.threads"]
    assert threads != str(p.default_threads({"OMP_NUM_THREADS": "1"}))
    usable, machine = p.physical_cores()
    assert str(usable) in threads and str(machine) in threads
    assert p.probe_threads(env) == p.probe_threads(dict(env))


def test_triton_compiler_settings_are_facts_but_its_places_are_not():
    """Inductor bundles Triton's cubins into its FX graph entries and launches them on a graph-cache
    hit without asking Triton, whose own key holds these settings; torch's key does not. A pod
    with TRITON_FORCE_DISABLE_FP_FUSION set got kernels built with FMA contraction."""
    env = {"TRITON_FORCE_DISABLE_FP_FUSION": "1", "TRITON_OVERRIDE_ARCH": "sm80", "PTXAS_OPTIONS": "-O0",
           "DISABLE_PTXAS_OPT": "1", "DISABLE_LLVM_OPT": "1", "TRITON_F32_DEFAULT": "ieee",
           "TRITON_CACHE_DIR": "/root/triton", "TRITON_HOME": "/root", "TRITON_DUMP_DIR": "/d",
           "TRITON_REDIS_HOST": "redis", "TRITON_PRINT_AUTOTUNING": "1"}  # fmt: skip
    assert p.probe_settings(env) == {f"env.{name}": env[name] for name in (
        "TRITON_FORCE_DISABLE_FP_FUSION", "TRITON_OVERRIDE_ARCH", "PTXAS_OPTIONS", "DISABLE_PTXAS_OPT",
        "DISABLE_LLVM_OPT", "TRITON_F32_DEFAULT")}  # fmt: skip


def test_every_setting_triton_keys_its_cache_by_is_a_fact_unless_it_only_dumps_or_times():
    """Against the installed triton: what it names as cache-invalidating, set, is keyed here too,
    except switches that only write dumps, timings or diagnostics."""
    import subprocess
    import sys

    # Every setting triton's knobs read, and those only its C++ reads (not knobs), each set to "1".
    probe = """
import json, os, subprocess, sys
from triton import knobs
names = {d.key for c in vars(knobs).values() if isinstance(c, type) and issubclass(c, knobs.base_knobs)
         for d in c.__dict__.values() if isinstance(d, knobs.env_base)}
names |= set(sys.argv[1:])
done = subprocess.run([sys.executable, "-c", "from triton._C.libtriton import get_cache_invalidating_env_vars as g;"
                       "import json; print(json.dumps(sorted(g())))"], env={**{n: "1" for n in names},
                      "PATH": os.environ["PATH"]}, capture_output=True, text=True, check=True)
print(json.dumps([sorted(names), json.loads(done.stdout)]))
"""
    cxx_only = ["DISABLE_MMA_V3", "DISABLE_MMA_V5", "DISABLE_LLVM_OPT", "LLVM_PASS_PLUGIN_PATH",
                "ALLOW_LHS_TMEM_LAYOUT_CONVERSION", "TRITON_PLUGIN_PATHS", "MLIR_ENABLE_DUMP"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", probe, *cxx_only], capture_output=True, text=True, check=True)
    names, invalidating = json.loads(done.stdout)
    assert "TRITON_FORCE_DISABLE_FP_FUSION" in invalidating, "the installed triton names other settings"
    # Settings Triton keys its cache by that only write dumps, timings or diagnostics: the binaries are the same.
    words = ("DUMP", "TIMING", "DIAGNOSTICS", "MLIR_DISABLE_MULTITHREADING", "LLVM_DEBUG")
    diagnostic = {n for n in invalidating if any(word in n for word in words)}
    keyed = {k.removeprefix("env.") for k in p.probe_settings(dict.fromkeys(names, "1"))}
    assert set(invalidating) - diagnostic <= keyed


def test_an_empty_triton_setting_that_triton_reads_as_false_is_refused():
    """Measured against the installed triton: TRITON_DEFAULT_FP_FUSION set to "" turns FP fusion off
    (`--fmad=false`), unset leaves it on. kcache read both as unset, one bundle key, and Inductor launches
    the cubins bundled in its graph entries without asking Triton: a pod without FMA contraction ran
    kernels built with it. They cannot be keyed apart without a new fact, so "" is refused, as a blank
    --model is; so is every other keyed switch whose knob reads "" otherwise than unset."""
    from kcache.errors import ConfigError

    read = """
import json, sys, warnings
warnings.simplefilter("ignore")
from triton import knobs
switches = {d.key: d.get() for c in vars(knobs).values() if isinstance(c, type) and issubclass(c, knobs.base_knobs)
            for d in c.__dict__.values() if isinstance(d, (knobs.env_bool, knobs.env_opt_bool))}
print(json.dumps([knobs.language.fp_fusion_enabled(None), switches]))
"""
    base = {k: v for k, v in os.environ.items() if k not in p._KEYED_ENV}
    (unset_fusion, unset), (empty_fusion, empty) = [
        json.loads(subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, text=True,
                                  check=True).stdout)
        for env in (base, {**base, **dict.fromkeys(p._KEYED_ENV, "")})]  # fmt: skip
    assert (unset_fusion, empty_fusion) == (True, False), "the installed triton reads an empty value as unset now"
    differ = {name for name in set(unset) & set(p._KEYED_ENV) if unset[name] != empty[name]}
    assert "TRITON_DEFAULT_FP_FUSION" in differ
    for name in differ:
        with pytest.raises(ConfigError, match=name):
            p.probe_settings({name: ""})
    assert p.probe_settings({"TRITON_DEFAULT_FP_FUSION": "0"}) == {"env.TRITON_DEFAULT_FP_FUSION": "0"}


def test_triton_named_settings_that_build_nothing_differently_are_not_facts():
    """The TRITON_ prefix is not Triton's alone: Kubernetes service links of a Service named `triton`,
    the Triton Inference Server image's own variables, profiler settings; and an empty value is
    unset to Triton. Keyed, each split bundle keys between pods that build the same kernels."""
    env = {"TRITON_SERVICE_HOST": "10.0.0.7", "TRITON_PORT_8000_TCP_ADDR": "10.0.0.7", "TRITON_SERVER_VERSION": "2.50",
           "TRITON_PROFILE_BUFFER_SIZE": "64", "TRITON_CUPTI_LIB_PATH": "/usr/lib", "TRITON_ENABLE_ASAN": "",
           "PTXAS_OPTIONS": ""}  # fmt: skip
    assert p.probe_settings(env) == {}


@pytest.mark.parametrize("name, value", [
    ("TRITON_INSTRUMENTATION_MODE", "fpsan"),  # a sanitizer compiled into the kernels (runtime/jit.py)
    ("TRITON_FPSAN_HOMOMORPHIC_CASTS", "1"),
    ("TRITON_PTXAS_BLACKWELL_PATH", "/opt/other/ptxas"),  # which ptxas builds sm_100+ (backends/nvidia)
    ("TRITON_KERNEL_OVERRIDE", "1"),  # IR the user supplies replaces the compiled one
    ("TRITON_SWAP_MIR", "/opt/mir"),
    ("TRITON_AMD_CODEGEN_PATH", "/opt/llc"),
])  # fmt: skip
def test_triton_settings_its_compile_options_take_from_its_knobs_are_facts(name, value):
    assert p.probe_settings({name: value}) == {f"env.{name}": value}


def test_the_compiler_fact_changes_when_torchs_compiler_key_does(tmp_path, monkeypatch):
    """torch keys its ISA probes and headers on `g++ -v` run by name under LC_ALL=C; kcache ran the
    absolute path, so gcc's COLLECT_GCC line differed. A pod reaching g++ through a wrapper script
    (`exec /usr/bin/g++ "$@"`) kept the publisher's bundle key and hit, then rebuilt every ISA probe."""
    cpp_builder = pytest.importorskip("torch._inductor.cpp_builder")
    real = shutil.which("g++")
    if real is None:
        pytest.skip("no g++")
    torch_text = cpp_builder.get_compiler_version_info.__wrapped__  # uncached: PATH changes below
    plain = (torch_text("g++"), p.probe_compiler({})["cxx.v_hash"])
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "g++").write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    (shim / "g++").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")
    wrapped = (torch_text("g++"), p.probe_compiler({})["cxx.v_hash"])
    assert plain[0] != wrapped[0]  # torch's key sees the wrapper
    assert plain[1] != wrapped[1]  # so must the bundle key
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")  # torch runs it under LC_ALL=C whatever the locale
    assert p.probe_compiler({})["cxx.v_hash"] == wrapped[1]


def _toolkit(folder: Path, version: str) -> Path:
    """A CUDA toolkit folder whose bin/nvcc answers `--version` as nvcc does."""
    (folder / "bin").mkdir(parents=True)
    nvcc = folder / "bin" / "nvcc"
    release = ".".join(version.split(".")[:2])
    lines = ["nvcc: NVIDIA (R) Cuda compiler driver", "Copyright (c) 2005-2025",
             f"Cuda compilation tools, release {release}, V{version}", f"Build cuda_{release}.r{release}/compiler.1_0"]
    nvcc.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in lines))
    nvcc.chmod(0o755)
    return folder


def _cuda_torch(monkeypatch) -> None:
    real = p.probe_torch
    monkeypatch.setattr(p, "probe_torch", lambda env: {**real(env), "torch.cuda": "12.8"})


def test_two_cuda_toolkits_under_one_torch_wheel_do_not_share_a_key(tmp_path, monkeypatch):
    """torch keys Inductor's CUTLASS kernels by nvcc's path and a torch extension by its sources and flags,
    never by nvcc's version: two images with one CUDA torch wheel and toolkits 12.4 and 12.8 at one
    path shared every key, and one ran the other's nvcc-built kernels (linked against its runtime)."""
    from kcache import fingerprint

    _cuda_torch(monkeypatch)
    keys = []
    for version in ("12.4.131", "12.8.93"):
        home = _toolkit(tmp_path / version / "cuda", version)
        env = {"CUDA_HOME": str(home)}
        assert version in p.probe_nvcc(env)["cuda.nvcc"]
        keys.append(fingerprint.collect(env=env, probes=p.PROBES).toolchain_key)
    assert keys[0] != keys[1]


def test_nvcc_is_found_where_torch_and_inductor_look(tmp_path, monkeypatch):
    _cuda_torch(monkeypatch)
    on_path, home, cxx = (_toolkit(tmp_path / v, v) for v in ("12.1.105", "12.4.131", "12.6.77"))
    path = {"PATH": str(on_path / "bin")}
    assert "V12.1.105" in p.probe_nvcc(path)["cuda.nvcc"]  # cpp_extension's CUDA_HOME guess and Inductor's "nvcc"
    both = p.probe_nvcc({**path, "CUDA_PATH": str(home)})["cuda.nvcc"]  # extensions from CUDA_PATH, CUTLASS from PATH
    assert "V12.1.105" in both and "V12.4.131" in both
    assert "V12.6.77" in p.probe_nvcc({**path, "CUDACXX": str(cxx / "bin" / "nvcc")})["cuda.nvcc"]
    wrapped = f"{shutil.which('env')} {cxx / 'bin' / 'nvcc'}"  # as with ccache in front
    assert "V12.6.77" in p.probe_nvcc({**path, "PYTORCH_NVCC": wrapped})["cuda.nvcc"]
    # one toolkit reached two ways is one text: the fact does not depend on how many ways lead to it
    assert p.probe_nvcc({**path, "CUDA_HOME": str(on_path)}) == p.probe_nvcc(path)


def test_no_nvcc_or_no_cuda_torch_adds_no_fact(tmp_path, monkeypatch):
    """Only where a CUDA torch could build with a toolkit: every other machine keeps its key."""
    home = _toolkit(tmp_path / "cuda", "12.8.93")
    assert p.probe_nvcc({"CUDA_HOME": str(home), "PATH": str(home / "bin")}, cuda=p.NONE) == {}
    _cuda_torch(monkeypatch)
    assert p.probe_nvcc({"CUDA_HOME": str(tmp_path / "absent"), "PATH": str(tmp_path)}) == {}


NVCC_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN",
            "INCLUDES", "SYSTEM_INCLUDES", "LIBRARIES", "CUDAFE_FLAGS", "PTXAS_FLAGS")  # fmt: skip


@pytest.mark.parametrize("name, value", [("NVCC_PREPEND_FLAGS", "-ccbin=/opt/conda/bin/x86_64-conda-linux-gnu-c++"),
                                         ("NVCC_APPEND_FLAGS", "--use_fast_math"), ("NVCC_CCBIN", "g++-11")])
def test_what_nvcc_reads_from_the_environment_splits_the_key(tmp_path, monkeypatch, name, value):
    """nvcc adds NVCC_PREPEND_FLAGS and NVCC_APPEND_FLAGS to every command line it is given, and runs
    the host compiler NVCC_CCBIN names: torch keys a CUTLASS kernel or a torch extension (FlashInfer's
    JIT ops) by the command line it passes, and ninja judges a restored build by it, so one built with
    --use_fast_math, or with another host compiler, was a hit for a pod that builds without."""
    from kcache import fingerprint

    _cuda_torch(monkeypatch)
    env = {"CUDA_HOME": str(_toolkit(tmp_path / "cuda", "12.8.93"))}
    plain, flagged = (fingerprint.collect(env=e, probes=p.PROBES) for e in (env, {**env, name: value}))
    assert flagged.facts[f"env.{name}"] == value
    assert plain.toolchain_key != flagged.toolchain_key
    assert p.probe_nvcc({**env, name: " "}) == p.probe_nvcc(env)  # no flag, no compiler named: nvcc as unset


@pytest.mark.parametrize("name, value", [("NVCC_APPEND_FLAGS", "-DWIDTH=5"), ("NVCC_PREPEND_FLAGS", "-DWIDTH=5"),
                                         ("INCLUDES", "-DWIDTH=5"), ("SYSTEM_INCLUDES", "-DWIDTH=5"),
                                         ("PTXAS_FLAGS", "-O0")])
def test_what_nvcc_reads_changes_what_the_same_nvcc_command_builds_and_the_key(tmp_path, monkeypatch, name, value):
    """Measured with this machine's nvcc: one command line, with and without the setting, two cubins."""
    from kcache import fingerprint

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    _cuda_torch(monkeypatch)
    (tmp_path / "k.cu").write_text("#ifndef WIDTH\n#define WIDTH 1\n#endif\n"
                                   "__global__ void k(int* x) { x[threadIdx.x] = WIDTH; }\n")  # fmt: skip
    built = []
    for env in ({**os.environ}, {**os.environ, name: value}):
        out = tmp_path / f"k{len(built)}.cubin"
        subprocess.run([nvcc, "-cubin", "-arch=sm_90", "k.cu", "-o", str(out)], cwd=tmp_path, env=env, check=True)
        built.append((out.read_bytes(), fingerprint.compute(p.probe_nvcc(env)).toolchain_key))
    assert built[0][0] != built[1][0]
    assert built[0][1] != built[1][1]


def test_nvcc_settings_add_no_fact_where_nothing_builds_with_nvcc(tmp_path, monkeypatch):
    """A CPU torch, or no toolkit: no nvcc runs, so those machines keep their keys whatever is set."""
    flags = {name: "--use_fast_math" for name in NVCC_ENV}
    home = _toolkit(tmp_path / "cuda", "12.8.93")
    assert p.probe_nvcc({"CUDA_HOME": str(home), **flags}, cuda=p.NONE) == {}
    _cuda_torch(monkeypatch)
    assert p.probe_nvcc({"CUDA_HOME": str(tmp_path / "absent"), "PATH": str(tmp_path), **flags}) == {}


def test_an_nvcc_that_cannot_say_its_version_is_a_config_error(tmp_path, monkeypatch):
    _cuda_torch(monkeypatch)
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "bin" / "nvcc").write_text("#!/bin/sh\nexit 1\n")
    (home / "bin" / "nvcc").chmod(0o755)
    with pytest.raises(ConfigError, match="nvcc"):
        p.probe_nvcc({"CUDA_HOME": str(home), "PATH": str(tmp_path)})


def test_a_pytorch_nvcc_that_is_no_command_line_is_a_config_error(monkeypatch):
    _cuda_torch(monkeypatch)
    with pytest.raises(ConfigError, match="PYTORCH_NVCC"):
        p.probe_nvcc({"PYTORCH_NVCC": 'ccache "nvcc'})
