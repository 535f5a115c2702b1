"""Probes: what this machine is, as the facts a fingerprint keys on. Key computation is in fingerprint.py.

Each probe takes the environment and returns {fact name: string value}. None imports torch or
triton: versions are read from their files, GPUs through kcache.gpus (NVML, else nvidia-smi).

    PROBES  every fact of the machine that runs the model (`kcache fingerprint` there)
    CHECKS  the few facts an init container can vouch for itself: node facts, not image facts
"""

from __future__ import annotations

import ast
import ctypes
import logging
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from kcache import canonical, engines, gpus
from kcache.errors import ConfigError

NONE = gpus.NONE  # one spelling for an absent fact
log = logging.getLogger(__name__)

Probe = Callable[[Mapping[str, str]], dict[str, str]]
X86 = ("x86_64", "AMD64")  # platform.machine() on Linux, Windows

# Settings that name places or runs rather than behaviour: they differ between identical replicas,
# so keying on them would make every pod miss. Torch leaves all of these out of its own keys
# (torch 2.13 config modules). TORCH_COMPILE_CACHE_KEY_TAG is not here: it is in torch's FX key,
# so a tag the user sets is a fact like any other.
_NOT_KEYED_ENV = {
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_CUTLASS_DIR",
    "TORCHINDUCTOR_COMPILE_THREADS",  # how many compile workers, not what they produce
    "TORCHINDUCTOR_FX_GRAPH_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_CACHE",
    "TORCHINDUCTOR_REDIS_HOST",
    "TORCHINDUCTOR_REDIS_PORT",
    "TORCH_COMPILE_DEBUG",
    "TORCH_COMPILE_DEBUG_DIR",
    "TORCH_COMPILE_JOB_ID",
    "TORCH_COMPILE_STICKY_PGO_KEY",
}
_KEYED_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_")
# Keyed whatever their prefix: Inductor reads each when compiling, and it changes what is built.
# TORCH_INDUCTOR_INSTALL_GXX (any non-empty value) has it compile with a conda g++ that it installs
# itself (cpp_builder.cpp_compiler_search) instead of the `cxx.*` one probed here.
#
# Triton's compiler settings: Triton keys its own cache by them, but Inductor bundles Triton's
# binaries into its FX graph entries and, on a graph-cache hit, launches them without asking
# Triton (torch 2.13 triton_bundler, codecache), and torch's key does not hold them: unkeyed, a pod
# with TRITON_FORCE_DISABLE_FP_FUSION=1 ran cubins built with FMA contraction. Named one by one: the
# TRITON_ prefix is not Triton's alone (Kubernetes service links of a Service named `triton`, the
# Triton Inference Server image's variables), and its profiler, cache-location and dump settings
# build nothing differently. The list is triton 3.9's get_cache_invalidating_env_vars() less its
# dump, timing and debug-output switches, plus the compiler paths and knobs its compiler key covers.
_KEYED_ENV = (
    "TORCH_INDUCTOR_INSTALL_GXX",
    # clang's driver edits every command line it is given by this list ("+-ffast-math", "x-O2"...): where
    # CXX is clang++ (torch picks it by CXX), the same command line torch keys on builds other code.
    "CCC_OVERRIDE_OPTIONS",
    "TRITON_DEFAULT_FP_FUSION",
    "TRITON_FORCE_DISABLE_FP_FUSION",
    "TRITON_F32_DEFAULT",
    "TRITON_OVERRIDE_ARCH",
    "TRITON_ENABLE_ASAN",
    "TRITON_DISABLE_LINE_INFO",
    "TRITON_CONSAN_INIT_ALLOCATIONS",
    "TRITON_ENABLE_EXPERIMENTAL_CONSAN",
    "TRITON_PLUGIN_PATHS",
    "TRITON_PLUGIN_VERSION_CHECK",
    "TRITON_HIP_USE_ASYNC_COPY",
    "TRITON_HIP_USE_BLOCK_PINGPONG",
    "TRITON_HIP_USE_COEXEC_SCHEDULER",
    "TRITON_HIP_USE_EXPERT_SCHEDULING",
    "TRITON_HIP_USE_IN_THREAD_TRANSPOSE",
    "TRITON_PTXAS_PATH",
    "TRITON_LIBDEVICE_PATH",
    "TRITON_MOCK_PTX_VERSION",
    "TRITON_DEBUG",
    "TRITON_INTERPRET",
    "TRITON_INSTRUMENTATION_MODE",  # compile options from knobs (runtime/jit.py), not in that list
    "TRITON_FPSAN_HOMOMORPHIC_CASTS",
    "TRITON_PTXAS_BLACKWELL_PATH",
    "TRITON_KERNEL_OVERRIDE",
    "TRITON_SWAP_MIR",
    "TRITON_AMD_CODEGEN_PATH",
    "PTXAS_OPTIONS",
    "DISABLE_PTXAS_OPT",
    "DISABLE_LLVM_OPT",
    "DISABLE_MMA_V3",
    "DISABLE_MMA_V5",
    "ALLOW_LHS_TMEM_LAYOUT_CONVERSION",
    "LLVM_PASS_PLUGIN_PATH",
    "LLVM_EXTRACT_DI_LOCAL_VARIABLES",
    "USE_IR_LOC",
    "AMDGCN_USE_BUFFER_OPS",
    "AMDGCN_USE_BUFFER_ATOMICS",
    "AMDGCN_ANALYZE_SMALL_TENSOR_RANGE",
    "AMDGCN_SCALARIZE_PACKED_FOPS",
)
# What g++ reads besides its command line: where it finds headers (CPATH, CPLUS_INCLUDE_PATH,
# C_INCLUDE_PATH), libraries (LIBRARY_PATH) and its own programs (GCC_EXEC_PREFIX, COMPILER_PATH).
# torch keys a C++ build (Inductor's kernels, torch extensions) by its source and command line only,
# so two pods differing in these shared torch's keys and ours while g++ built other code. Keyed
# whenever set, empty included: gcc 12 reads an empty LIBRARY_PATH or COMPILER_PATH as ./ and an empty
# GCC_EXEC_PREFIX as a relative prefix. Unset adds no fact, so no other machine's key changes.
COMPILER_ENV = ("CPATH", "CPLUS_INCLUDE_PATH", "C_INCLUDE_PATH", "LIBRARY_PATH", "GCC_EXEC_PREFIX", "COMPILER_PATH")
# What nvcc reads besides its command line: flags it puts before and after every command line it is
# given, and the host compiler it runs (nvcc's documented environment); and the variables its
# bin/nvcc.profile extends (`INCLUDES += ...`), whose values from the environment it passes on to the
# preprocessor, cudafe++, ptxas and the linker (measured with nvcc 13.0: `INCLUDES=-DWIDTH=5` and
# `PTXAS_FLAGS=-O0` each built another cubin from one command line). torch keys a CUTLASS kernel and a
# torch extension by the command line it passes, and ninja judges a restored build by that command, so a
# pod building with NVCC_APPEND_FLAGS=--use_fast_math shared both with one building without. Keyed only
# where `cuda.nvcc` is (a CUDA torch, an nvcc found) and non-blank: nvcc adds nothing for a blank value.
NVCC_ENV = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "NVCC_CCBIN",
            "INCLUDES", "SYSTEM_INCLUDES", "LIBRARIES", "CUDAFE_FLAGS", "PTXAS_FLAGS")  # fmt: skip
# Triton switches that an empty value does not leave at their default: its knobs read "" as false,
# and unset as true (FP fusion, buffer ops) or as the backend's choice (the HIP ones). Measured in
# triton 3.9 (tests/test_probes.py); older releases read TRITON_DEFAULT_FP_FUSION="" as off too.
_EMPTY_IS_FALSE = (
    "TRITON_DEFAULT_FP_FUSION",
    "AMDGCN_USE_BUFFER_OPS",
    "AMDGCN_USE_BUFFER_ATOMICS",
    "TRITON_HIP_USE_ASYNC_COPY",
    "TRITON_HIP_USE_BLOCK_PINGPONG",
    "TRITON_HIP_USE_COEXEC_SCHEDULER",
    "TRITON_HIP_USE_EXPERT_SCHEDULING",
    "TRITON_HIP_USE_IN_THREAD_TRANSPOSE",
)

# x86 /proc/cpuinfo flags that name an instruction-set extension: the features `-march=native`
# (which Inductor passes to g++) may enable, each one also a `__FEATURE__` macro that ATen's and
# Inductor's headers test. Kernel spellings; the gcc option is in the comment where it differs.
# Checked against gcc 12.2 `-march=native -Q --help=target` on this AMD EPYC (znver3): every
# enabled ISA option maps to a flag here. rdseed, mwait (`monitor`) and shstk (`user_shstk`) are
# enabled by gcc from CPUID but hidden from /proc/cpuinfo by this VM's kernel; compilers emit them
# only through intrinsics, never from -march=native code generation, so their absence is harmless.
# -march=native also sets -mtune and cache-size parameters: those change speed, not legality.
# The init container has no compiler to ask, hence a list rather than gcc's answer; where the compiler
# is (the model container), `cxx.native` keys gcc's answer too, which sees what cpuinfo hides (AVX10.2).
_X86_FEATURES = frozenset("""
    mmx mmxext 3dnow 3dnowext 3dnowprefetch fxsr sse sse2 pni ssse3 sse4_1 sse4_2 sse4a
    avx avx2 fma fma4 xop tbm f16c bmi1 bmi2 abm popcnt movbe adx cx16 lahf_lm
    aes pclmulqdq vaes vpclmulqdq gfni sha_ni sha512 sm3 sm4 rdrand rdseed
    fsgsbase xsave xsaveopt xsavec xsaves clflushopt clwb clzero monitor mwaitx rdpid rdtscp
    pku ospke ptwrite movdiri movdir64b enqcmd serialize tsxldtrk waitpkg cldemote uintr hreset
    wbnoinvd sgx pconfig rtm hle user_shstk prefetchwt1 lwp
    avx512f avx512cd avx512dq avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni
    avx512_bitalg avx512_vpopcntdq avx512_bf16 avx512_fp16 avx512_vp2intersect avx512er avx512pf
    avx512_4vnniw avx512_4fmaps avx_vnni avx_vnni_int8 avx_vnni_int16 avx_ifma avx_ne_convert cmpccxadd
    amx_tile amx_bf16 amx_int8 amx_fp16 amx_complex avx10 apx
""".split())  # fmt: skip
# abm = lzcnt, pni = sse3, lahf_lm = sahf, 3dnowprefetch = prfchw, sha_ni = sha, monitor = mwait,
# user_shstk = shstk; crc32 comes with sse4_2.
# aarch64's Features line lists only ISA features (-mcpu=native reads the same hwcaps), except these.
_AARCH64_NOT_ISA = frozenset({"evtstrm", "cpuid"})
# prctl(2): the calling thread's SVE vector length in bytes, in the low 16 bits (linux/prctl.h).
_PR_SVE_GET_VL = 51
_PR_SVE_VL_LEN_MASK = 0xFFFF


# ---- platform and software -----------------------------------------------------------------------


def probe_platform(env: Mapping[str, str]) -> dict[str, str]:
    libc, libc_version = platform.libc_ver()
    return {
        "os": platform.system().lower(),
        "arch": platform.machine(),
        "libc": f"{libc} {libc_version}".strip() or NONE,
        "python": python_fact("{}.{}".format(*platform.python_version_tuple()[:2]), getattr(sys, "abiflags", "")),
    }


def python_fact(major_minor: str, abiflags: str) -> str:
    """`3.11`, or `3.11d` for a debug build (`t` free-threaded): another ABI, whose extension modules
    (Triton's launchers, torch extensions, which torch builds under py311d_...) a normal build's are not.
    A normal build's abiflags are empty, so its fact, and every key, is what it always was."""
    return major_minor + abiflags


def _package_dir(name: str) -> Path | None:
    """Where a package would be imported from, without importing it."""
    return engines.package_dir(name)


def _assignments(source: str) -> dict[str, object]:
    """Top-level `NAME = literal` assignments of a Python file, without running it."""
    values: dict[str, object] = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            try:
                value = ast.literal_eval(node.value) if node.value is not None else None
            except ValueError:
                continue
            for target in targets:
                if isinstance(target, ast.Name):
                    values[target.id] = value
    return values


def probe_torch(env: Mapping[str, str]) -> dict[str, str]:
    pkg = _package_dir("torch")
    if pkg is None or not (pkg / "version.py").is_file():
        return {"torch.version": NONE}
    v = _assignments((pkg / "version.py").read_text())
    return {
        "torch.version": str(v.get("__version__", NONE)),
        "torch.git": str(v.get("git_version", NONE)),
        "torch.cuda": str(v.get("cuda") or NONE),
        "torch.hip": str(v.get("hip") or NONE),
        # Compiled kernels link with absolute -I/-L paths into the install: a different path rebuilds them.
        # As torch spells it (cpp_extension._TORCH_PATH, cpp_builder's: os.path.abspath of its own file,
        # symlinks kept): resolved, a pod importing torch through a symlinked site-packages shared the
        # key of one that did not, and every C++ kernel of its hit rebuilt.
        "torch.path": os.path.dirname(os.path.abspath(pkg)),
    }


def probe_triton(env: Mapping[str, str]) -> dict[str, str]:
    pkg = _package_dir("triton")
    if pkg is None or not (pkg / "__init__.py").is_file():
        return {"triton.version": NONE}
    match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", (pkg / "__init__.py").read_text(), re.M)
    return {"triton.version": match.group(1) if match else NONE}


def probe_gpu(env: Mapping[str, str], read: Callable[[], gpus.Reading | None] = gpus.read,
              present: Callable[[], bool] = gpus.devices_present) -> dict[str, str]:
    """The GPUs this process would use (CUDA_VISIBLE_DEVICES applied); `read` lists the node's.
    GPU device nodes that nothing could read give `unknown` facts, never a CPU machine's."""
    reading = read()
    if reading is None and not gpus.hides_every_device(env) and present():
        log.warning("this container has GPU device nodes (/dev/nvidia*) but neither NVML (pynvml) nor nvidia-smi "
                    "could read them: the GPU facts are unknown, so restore misses and publish refuses; install "
                    "kcache[gpu] or nvidia-smi, or pass --facts-file from the model container")  # fmt: skip
        return dict(gpus.UNKNOWN_FACTS)
    return gpus.facts(reading, env)


def probe_compiler(env: Mapping[str, str], arch: str | None = None) -> dict[str, str]:
    """The C++ compiler Inductor would call, its `-v` text (part of torch's header keys), and on x86
    what its `-march=native` turns on here (`cxx.native`)."""
    name = env.get("CXX") or "g++"
    path = shutil.which(name)
    if not path:
        return {"cxx.name": name, "cxx.version": NONE}
    # As torch runs it for its keys (cpp_builder.get_compiler_version_info): by name, under LC_ALL=C.
    # gcc names itself as it was called (COLLECT_GCC=...): the absolute path here kept one bundle key
    # where torch's keys told a wrapper script from the compiler, and a hit rebuilt every ISA probe.
    run_env = {**os.environ, **env, "LC_ALL": "C"}
    text = _stderr([name, "-v"], path, env=run_env)
    lines = [line for line in text.splitlines() if " version " in line]
    facts = {"cxx.name": name, "cxx.version": lines[-1].strip() if lines else NONE, "cxx.v_hash": canonical.xxh3(text)}
    if (platform.machine() if arch is None else arch) in X86:
        # gcc on x86 asks CPUID, not /proc/cpuinfo, which hides some of what it turns on: only the
        # compiler can say what -march=native (every Inductor CPU kernel's flag) means here.
        # By name too, as Inductor compiles: exec passes over a g++ on PATH that cannot run to the next one.
        facts["cxx.native"] = native_isa(_stderr([name, "-###", "-march=native", "-x", "c++", "-E", os.devnull], path,
                                                 env=run_env))  # fmt: skip
    return facts


def probe_nvcc(env: Mapping[str, str], cuda: str | None = None) -> dict[str, str]:
    """`cuda.nvcc`: the version of every nvcc a CUDA torch would build with here, only where there is one.

    torch keys Inductor's CUTLASS kernels by nvcc's path, and a torch extension (FlashInfer's JIT ops
    among them) by its sources and flags, never by nvcc's version: two images with one CUDA torch wheel
    and toolkits 12.4 and 12.8 at /usr/local/cuda shared every key, and one loaded the other's kernels,
    built and linked against another toolkit. `cuda` is torch's CUDA version (read from torch when None):
    a CPU or ROCm torch builds nothing with nvcc, and a machine without a toolkit has no fact, so their
    keys are what they were. A found nvcc that cannot say its version is a config error, as g++ is.
    With it, the NVCC_ENV settings that are set (`env.NVCC_APPEND_FLAGS`...): nvcc reads them too.
    """
    if (probe_torch(env).get("torch.cuda", NONE) if cuda is None else cuda) == NONE:
        return {}
    run_env = {**os.environ, **env}
    texts = {_nvcc_version(command, run_env) for command in nvcc_commands(run_env)}
    if not texts:
        return {}
    settings = {f"env.{name}": env[name] for name in NVCC_ENV if env.get(name, "").strip()}
    return {"cuda.nvcc": " | ".join(sorted(texts)), **settings}


def nvcc_commands(env: Mapping[str, str]) -> list[list[str]]:
    """Each nvcc torch 2.13 may run, once per file: PYTORCH_NVCC and CUDA_HOME's (cpp_extension, whose
    CUDA_HOME is CUDA_HOME, CUDA_PATH, the folder above nvcc on PATH or /usr/local/cuda), CUDACXX and
    nvcc on PATH (Inductor's CUTLASS compiler, cuda/compile_utils._cuda_compiler)."""
    search = env.get("PATH", os.defpath)
    on_path = shutil.which("nvcc", path=search)
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if not home:
        home = os.path.dirname(os.path.dirname(on_path)) if on_path else "/usr/local/cuda"
    found = [os.path.join(home, "bin", "nvcc"), shutil.which(env.get("CUDACXX") or "", path=search), on_path]
    commands, seen = [], set()
    if env.get("PYTORCH_NVCC"):
        try:
            commands.append(shlex.split(env["PYTORCH_NVCC"]))
        except ValueError as exc:
            raise ConfigError("PYTORCH_NVCC", env["PYTORCH_NVCC"], f"is not a command line ({exc})") from None
    for path in found:
        if path and os.path.isfile(path) and os.path.realpath(path) not in seen:
            seen.add(os.path.realpath(path))
            commands.append([path])
    return commands


def _nvcc_version(command: list[str], env: Mapping[str, str]) -> str:
    """nvcc's own version lines (`release 12.8, V12.8.93`, `Build cuda_12.8.r12.8/compiler...`), joined."""
    why = "printed no version"
    try:
        out = subprocess.run([*command, "--version"], capture_output=True, text=True,
                             timeout=COMPILER_PROBE_TIMEOUT_S, env=env).stdout  # fmt: skip
    except subprocess.TimeoutExpired:
        why = f"did not finish within {COMPILER_PROBE_TIMEOUT_S:g} s"
    except (OSError, subprocess.SubprocessError) as exc:
        why = f"could not be run ({getattr(exc, 'strerror', None) or type(exc).__name__})"
    else:
        lines = [line.strip() for line in out.splitlines() if line.startswith(("Cuda compilation tools", "Build "))]
        if any(line.startswith("Cuda compilation tools") for line in lines):
            return "; ".join(lines)
    raise ConfigError("nvcc", " ".join(command), f"`nvcc --version` {why}, so the CUDA compiler a CUDA torch builds "
                      "with cannot be keyed; fix it or point CUDA_HOME, CUDACXX or PATH at a working nvcc")  # fmt: skip


# How long one compiler probe may take (torch waits for `g++ -v` as long as it takes; a restore has a budget).
COMPILER_PROBE_TIMEOUT_S = 10.0


def _stderr(command: list[str], path: str, env: Mapping[str, str] | None = None) -> str:
    """What the compiler at `path` wrote to stderr. ConfigError when it could not be run or did not finish:
    "" and `none` would be every failed compiler's facts (gcc 12's and gcc 14's, an AVX10.2 node's and an
    AVX10.1 one's), so kernels one built would be filed under a key the other restores."""
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=COMPILER_PROBE_TIMEOUT_S,
                              env=env).stderr  # fmt: skip
    except subprocess.TimeoutExpired:
        why = f"did not finish within {COMPILER_PROBE_TIMEOUT_S:g} s"
    except OSError as exc:
        why = f"could not be run ({exc.strerror or type(exc).__name__})"
    except subprocess.SubprocessError as exc:
        why = f"could not be run ({type(exc).__name__})"
    raise ConfigError("CXX", command[0], f"`{' '.join(command[1:3])}` {why}, so the compiler's "
                      f"facts cannot be keyed; fix {path} or set CXX to a working compiler")  # fmt: skip


def native_isa(driver_text: str) -> str:
    """The instruction sets a compiler driver's `-### -march=native` passes on, sorted (or none).

    gcc expands -march=native into `-march=<cpu> -m<isa>... -mno-<isa>... --param ... -mtune=<cpu>`,
    an option for every extension it knows; clang into `-target-feature +<isa>` / `-<isa>`. Only
    those turned on are kept: the CPU name and tuning change speed, not which instructions run.
    """
    for line in driver_text.splitlines():
        if not line.startswith(" "):
            continue  # the driver's own lines (specs, COLLECT_GCC_OPTIONS); the commands it runs are indented
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue
        if "-target-feature" in tokens:
            found = {f[1:] for flag, f in zip(tokens, tokens[1:]) if flag == "-target-feature" and f.startswith("+")}
        else:
            start = next((i for i, t in enumerate(tokens) if t.startswith("-march=")), len(tokens))
            found = {t[2:] for t in tokens[start + 1 :]
                     if t.startswith("-m") and not t.startswith(("-mno-", "-mtune=", "-march="))}  # fmt: skip
        if found:
            return " ".join(sorted(found))
    return NONE


def probe_settings(env: Mapping[str, str]) -> dict[str, str]:
    """Every Inductor / torch.compile setting, Triton compiler setting and g++ search path from the
    environment (they change torch's keys or the code built)."""
    facts = {
        f"env.{name}": value
        for name, value in env.items()
        if name.startswith(_KEYED_ENV_PREFIXES) and name not in _NOT_KEYED_ENV
    }
    # Only when non-empty: torch tests these for truth, and Triton reads an empty value as unset,
    # except its switches in _EMPTY_IS_FALSE. Keyed as unset, TRITON_DEFAULT_FP_FUSION="" (fusion off)
    # shared a key with fusion on, and the cubins Inductor bundles run without Triton's own key check.
    for name in _EMPTY_IS_FALSE:
        if env.get(name) == "":
            raise ConfigError(name, "", "is set but empty, which Triton reads as false (0), not as unset (its "
                              "default); set it to 0 or 1, or unset it")  # fmt: skip
    facts.update({f"env.{name}": env[name] for name in _KEYED_ENV if env.get(name)})
    facts.update({f"env.{name}": env[name] for name in COMPILER_ENV if name in env})
    return facts



# Triton's switches that build kernels from files the user supplies. With TRITON_KERNEL_OVERRIDE on, it
# builds each kernel from the IR it finds under TRITON_OVERRIDE_DIR (default TRITON_HOME or ~, then
# .triton/override) and files the result under the key of its own build; TRITON_SWAP_MIR (AMD) names a
# folder of MIR it assembles instead of its own. The switches are facts (env.*), the files were not: two
# pods with TRITON_KERNEL_OVERRIDE=1 and different override files shared every key, and one ran the
# other's kernels. So where a switch is on, what the folder holds is a fact (a digest of each file's
# path and content); a machine without the switch keeps its keys.
_OFF = ("", "0", "false", "off", "no", "n")  # triton 3.9 reads 1/true/on/yes/y as on: anything else is hashed
MAX_IR_FILES = 10_000  # override folders hold a few IR files per kernel; a folder past these is refused
MAX_IR_BYTES = 256 * 1024 * 1024


def probe_triton_files(env: Mapping[str, str]) -> dict[str, str]:
    """`triton.override_files` where TRITON_KERNEL_OVERRIDE is on, `triton.swap_mir_files` where
    TRITON_SWAP_MIR is set: a digest of the folder Triton reads ("absent" when it has none). ConfigError
    where that folder cannot be told (a relative path: the model's working directory) or read."""
    facts = {}
    if env.get("TRITON_KERNEL_OVERRIDE", "").strip().lower() not in _OFF:
        facts["triton.override_files"] = _ir_folder_digest("TRITON_OVERRIDE_DIR", _override_dir(env))
    if env.get("TRITON_SWAP_MIR"):
        facts["triton.swap_mir_files"] = _ir_folder_digest("TRITON_SWAP_MIR", env["TRITON_SWAP_MIR"])
    return facts


def _override_dir(env: Mapping[str, str]) -> str:
    """The folder Triton's override manager reads, as triton 3.9's knobs spell it."""
    if "TRITON_OVERRIDE_DIR" in env:
        return env["TRITON_OVERRIDE_DIR"]
    home = env["TRITON_HOME"] if "TRITON_HOME" in env else (env.get("HOME") or os.path.expanduser("~"))
    return os.path.join(home, ".triton", "override")


def _ir_folder_digest(name: str, folder: str) -> str:
    if not os.path.isabs(folder):
        raise ConfigError(name, folder, "is not an absolute path: Triton reads it from the model's working "
                                        "directory, which kcache cannot see; set an absolute path")  # fmt: skip
    if not os.path.isdir(folder):
        return "absent"  # Triton finds no file there
    entries, total, folders = [], 0, 0
    try:
        for top, dirs, files in os.walk(folder, followlinks=True, onerror=_raise):
            dirs.sort()
            folders += 1  # a link to a folder above is walked again: bounded by the count, or by ELOOP
            if folders > MAX_IR_FILES:
                raise ConfigError(name, folder, f"holds more than {MAX_IR_FILES} folders: not an IR folder to key")
            for file in sorted(files):
                path = os.path.join(top, file)
                with open(path, "rb") as f:  # Triton opens what a link names
                    data = f.read(MAX_IR_BYTES + 1 - total)
                total += len(data)
                entries.append([os.path.relpath(path, folder), canonical.sha256(data)])
                if len(entries) > MAX_IR_FILES or total > MAX_IR_BYTES:
                    why = f"holds more than {MAX_IR_FILES} files or {MAX_IR_BYTES >> 20} MiB: not an IR folder to key"
                    raise ConfigError(name, folder, why)
    except OSError as exc:
        raise ConfigError(name, folder, f"cannot be read ({exc.strerror or type(exc).__name__}), so which "
                                        "kernels Triton builds from it cannot be keyed") from None  # fmt: skip
    return canonical.sha256(canonical.dumps(entries))


def _raise(exc: OSError) -> None:
    raise exc


# ---- CPU -------------------------------------------------------------------------------------------


CPUINFO = Path("/proc/cpuinfo")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields. ConfigError on Linux when they cannot be read: no features and
    no ISA would be every such machine's facts, while torch reads CPUID itself and still builds for
    what it finds (AVX-512 kernels filed under a key an AVX2 machine restores)."""
    try:
        text = CPUINFO.read_text()
    except OSError as exc:
        if platform.system() != "Linux":
            return {}
        raise ConfigError("CPU facts", str(CPUINFO), f"cannot be read ({exc.strerror or type(exc).__name__}), so "
                          "this machine's CPU features cannot be keyed; run where /proc is mounted and readable, "
                          "or pass --facts-file from the model container") from None  # fmt: skip
    first = text.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_features(arch: str, flags: set[str]) -> str:
    """The ISA features `-march=native` can use here, sorted and space-separated (or none)."""
    if arch in X86:
        kept = flags & _X86_FEATURES
    elif arch == "aarch64":
        kept = flags - _AARCH64_NOT_ISA
    elif arch == "s390x":
        kept = flags  # hwcaps only (vx, vxe, vxe2, nnpa...), each a facility code may use
    else:
        kept = set()
    return " ".join(sorted(kept)) or NONE


def cpu_model(arch: str, info: Mapping[str, str]) -> str:
    """What `-mcpu=native` (ppc64le) or `-march=native` (s390x) picks the ISA level from (or none).

    ppc64le shows no feature line; its 'cpu' line names the model (POWER9, POWER10). On s390x gcc
    takes -march from the 'machine = TYPE' of a 'processor N' line; that line's identification is
    the machine's serial, so only the type is kept.
    """
    if arch == "ppc64le":
        return info.get("cpu") or NONE
    if arch == "s390x":
        for key, value in info.items():
            match = re.search(r"\bmachine\s*=\s*([0-9A-Fa-f]+)", value) if key.startswith("processor") else None
            if match:
                return match.group(1).upper()
    return NONE


def sve_vector_bits() -> int:
    """This process's SVE vector length in bits, as cpuinfo (so torch) reads it: prctl(PR_SVE_GET_VL).

    0 where prctl refuses (no SVE, not aarch64), as cpuinfo then reports. A fresh process runs
    with /proc/sys/abi/sve_default_vector_length, so the model's process reads what this one does.
    """
    try:
        vl = ctypes.CDLL(None, use_errno=True).prctl(_PR_SVE_GET_VL, 0, 0, 0, 0)
    except (OSError, AttributeError):
        return 0
    return (vl & _PR_SVE_VL_LEN_MASK) * 8 if vl >= 0 else 0


def probe_cpu(
    env: Mapping[str, str],
    info: Mapping[str, str] | None = None,
    arch: str | None = None,
    sve_bits: Callable[[], int] = sve_vector_bits,
) -> dict[str, str]:
    """cpu.features, the vector ISA Inductor picks from them, and cpu.model where the ISA needs it.

    No cpu.model on x86 and aarch64: once every feature is keyed, the model only changes
    -march=native's tuning (scheduling, cache sizes), which makes code faster or slower but never
    illegal; keying it would split caches between SKUs and cloud VMs that report the same ISA under
    other names. ppc64le and s390x derive the ISA level from the model (`cpu_model`).
    """
    info = _cpuinfo() if info is None else info
    arch = platform.machine() if arch is None else arch
    # x86 says 'flags', aarch64 'Features', s390x 'features'; ppc64le has none.
    flags = set((info.get("flags") or info.get("Features") or info.get("features") or "").split())
    bits = sve_bits() if arch == "aarch64" else 0
    facts = {"cpu.features": cpu_features(arch, flags), "cpu.isa": pick_isa(arch, flags, env, bits)}
    model = cpu_model(arch, info)
    if model != NONE:
        facts["cpu.model"] = model
    return facts


def pick_isa(arch: str, flags: set[str], env: Mapping[str, str], sve_bits: int = 0) -> str:
    """The vector ISA Inductor would generate code for (mirrors torch/_inductor/cpu_vec_isa.py).

    Candidates in torch's order, each valid when the CPU has every feature it needs; then
    ATEN_CPU_CAPABILITY picks the first candidate naming it ('default' means no vector code, on
    every architecture). Torch also runs compile probes that could veto a candidate; a compiler
    that cannot build AVX-512 code is already a different `cxx.*` fact.
    """
    if env.get("TORCHINDUCTOR_VEC_ISA_OK") == "0":
        return NONE
    candidates = _isa_candidates(arch, flags, sve_bits)
    wanted = env.get("ATEN_CPU_CAPABILITY")
    if not candidates or wanted == "default":
        return NONE
    if wanted in ("avx2", "avx512"):
        # torch matches on its ISA names, which all contain "avx512" for the AMX/VNNI variants.
        chosen = [c for c in candidates if wanted in c or (wanted == "avx512" and c == "amx")]
        if chosen:
            return chosen[0]
    # Any other value: torch ignores a name it does not know (sve256 included), and vsx or zvector
    # is the one candidate wherever it is valid.
    return candidates[0]


def _isa_candidates(arch: str, flags: set[str], sve_bits: int) -> list[str]:
    if arch in X86:
        return _x86_candidates(flags)
    if arch == "aarch64":
        # cpuinfo's bf16 is the BF16 or the SVEBF16 hwcap. Torch builds VecSVE(128) only for a 128-bit
        # length and VecSVE(256) for any other (0 included): -msve-vector-bits and the lane counts.
        if {"sve", "sve2"} & flags and {"bf16", "svebf16"} & flags:
            return ["sve128" if sve_bits == 128 else "sve256"]
        return ["neon"]
    if arch == "ppc64le":
        return ["vsx"]
    if arch == "s390x":
        # torch's regex wants vxe between spaces; the kernel ends every feature with one, and
        # the line starts with esan3, so it matches wherever vxe is listed.
        return ["zvector"] if "vxe" in flags else []
    return []


def _x86_candidates(flags: set[str]) -> list[str]:
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    vnni = avx512 and "avx512_vnni" in flags
    return [
        name
        for name, ok in (
            ("amx", vnni and "amx_tile" in flags),
            ("avx512_vnni", vnni),
            ("avx512", avx512),
            ("avx2", "avx2" in flags),
        )  # fmt: skip
        if ok
    ]


# Thread settings read by torch's OpenMP/MKL start-up; kept raw as well, in case the rule below
# misses a combination.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC", "MKL_DOMAIN_NUM_THREADS")
_C_SPACE = " \t\n\v\f\r"  # isspace() in the C locale, which strtoul and std::stoi skip
_STOI = re.compile(rf"[{_C_SPACE}]*([+-]?)([0-9]+)")
_GOMP_ITEM = re.compile(rf"[{_C_SPACE}]*([+-]?)([0-9]+)[{_C_SPACE}]*")
_U32, _U64 = 1 << 32, 1 << 64


def probe_threads(env: Mapping[str, str], mkl: bool | None = None) -> dict[str, str]:
    """The intra-op thread count that Inductor bakes into its CPU graph keys (`mkl`: see default_threads)."""
    mkl = torch_uses_mkl() if mkl is None else mkl
    facts = {f"env.{name}": env[name] for name in _THREAD_ENV if name in env}
    if env.get("TORCHINDUCTOR_CPP_DYNAMIC_THREADS") == "1":
        facts["cpu.threads"] = "dynamic"
    elif mkl and env.get("MKL_DOMAIN_NUM_THREADS", "").strip():
        # MKL reads it before the rest (ALL=1 on 2 CPUs gave torch 1 thread; with OMP_NUM_THREADS=1,
        # ALL=2 gave 2). Not worked out here: the raw setting is keyed above, with the cores it is
        # read against, so only the same setting on the same machine shape shares a key.
        usable, machine = physical_cores()
        facts["cpu.threads"] = f"mkl-domain cores={usable}/{machine}"
    else:
        facts["cpu.threads"] = str(default_threads(env, mkl=mkl))
    return facts


def torch_uses_mkl(pkg: Path | None = None) -> bool:
    """Whether ATen sizes its OpenMP pool by MKL: the torch install's ATen/Config.h says it was built
    with MKL, threaded, on OpenMP (x86 wheels; aarch64 wheels have no MKL). Without the header (no
    torch here, an install without headers): by architecture, as the wheels are built."""
    pkg = _package_dir("torch") if pkg is None else pkg
    try:
        text = (pkg / "include" / "ATen" / "Config.h").read_text() if pkg is not None else None
    except (OSError, UnicodeDecodeError):
        text = None
    if text is None:
        return platform.machine() in X86
    macros = dict(re.findall(r"^#define (AT_\w+?)(?:\(\))? (\d+)$", text, re.M))
    return (macros.get("AT_MKL_ENABLED"), macros.get("AT_MKL_SEQUENTIAL"), macros.get("AT_PARALLEL_OPENMP")) == (
        "1", "0", "1")  # fmt: skip


def default_threads(env: Mapping[str, str], cores: int | None = None, mkl: bool | None = None) -> int:
    """torch.get_num_threads() of a fresh process started with `env`, without importing torch.

    ATen's init_num_threads (torch 2.13): built with MKL (`mkl`, default `torch_uses_mkl()`), the
    count is mkl_get_max_threads(), else intraop_default_num_threads(). Measured against torch's own
    library for every case in tests/test_probes.py (THREAD_CASES); `cores` stands for both core counts.
    """
    usable, machine = physical_cores() if cores is None else (cores, cores)
    if not (torch_uses_mkl() if mkl is None else mkl):
        # std::stoi of each, MKL_NUM_THREADS winning when positive; else cpuinfo's physical cores of
        # the machine (not the affinity mask), and nothing caps a request.
        return _stoi_count(env.get("MKL_NUM_THREADS")) or _stoi_count(env.get("OMP_NUM_THREADS")) or machine
    dynamic = env.get("MKL_DYNAMIC", "").strip().lower() != "false"
    text = env.get("MKL_NUM_THREADS", "")
    if text and not (text.isascii() and text.isdigit()):
        return 1  # MKL runs one thread for anything but digits: " 2", "+2", "2,4", "abc"
    requested = _wrap32(text)  # MKL's count is a 32-bit int: "4294967299" is 3
    if not 0 < requested < _U32 // 2:  # "", "00", or negative as an int: as if unset
        omp = _gomp_count(env.get("OMP_NUM_THREADS"))  # MKL then asks libgomp, which parsed it
        if omp is None:
            return usable
        if omp == 0:
            return 1
        if not dynamic and omp >= _U32 // 2:
            return 1  # negative as an int
        requested = omp
    return min(requested, machine) if dynamic else requested


def _wrap32(digits: str) -> int:
    value = 0
    for digit in digits:
        value = (value * 10 + ord(digit) - 48) % _U32
    return value


def _gomp_count(text: str | None) -> int | None:
    """libgomp's OMP_NUM_THREADS as omp_get_max_threads() gives it, 32-bit unsigned; None when libgomp
    refuses it: every comma-separated item an strtoul number in 1..LONG_MAX, blanks around it only."""
    if text is None:
        return None
    values = []
    for item in text.split(","):
        match = _GOMP_ITEM.fullmatch(item)
        digits = match.group(2).lstrip("0") if match else ""
        if not digits or len(digits) > 20 or int(digits) >= _U64:
            return None  # no number, 0, or past ULONG_MAX (strtoul's ERANGE)
        value = (-int(digits) if match.group(1) == "-" else int(digits)) % _U64
        if not 0 < value < _U64 // 2:
            return None  # (long) value <= 0
        values.append(value)
    return values[0] % _U32


def _stoi_count(text: str | None) -> int | None:
    """A count as ATen's get_env_num_threads reads it (std::stoi, then > 0), else None."""
    match = _STOI.match(text or "")
    if not match:
        return None
    digits = match.group(2).lstrip("0")
    if match.group(1) == "-" or not digits or len(digits) > 10:
        return None  # not positive, or past an int (std::out_of_range)
    value = int(digits)
    return value if value < _U32 // 2 else None


def physical_cores() -> tuple[int, int]:
    """(physical cores within this process's CPU affinity, physical cores of the machine)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        allowed = set(range(os.cpu_count() or 1))
    cores: dict[int, tuple[str, str]] = {}
    base = Path("/sys/devices/system/cpu")
    for cpu_dir in base.glob("cpu[0-9]*"):
        try:
            topo = cpu_dir / "topology"
            cores[int(cpu_dir.name[3:])] = ((topo / "physical_package_id").read_text().strip(),
                                            (topo / "core_id").read_text().strip())  # fmt: skip
        except (OSError, ValueError):
            continue
    if not cores:
        return len(allowed), os.cpu_count() or len(allowed)
    usable = len({core for cpu, core in cores.items() if cpu in allowed}) or len(allowed)
    return usable, len(set(cores.values()))


PROBES: tuple[Probe, ...] = (
    engines.probe_engines,  # vLLM, FlashInfer, TensorRT-LLM...: only those installed (kcache/engines.py)
    probe_platform,
    probe_torch,
    probe_triton,
    probe_gpu,
    probe_cpu,
    probe_compiler,
    probe_nvcc,
    probe_threads,
    probe_settings,
    probe_triton_files,
)


# ---- checks: what an init container can see of the node its model container runs on ------------------
#
# The init container shares the node (CPU, kernel, GPUs and driver) with the model container, not
# its image: python, libc, torch and the compiler are the model image's and differ from kcache's own
# image by design (the example facts file says glibc 2.35; kcache's image has 2.36), so they are
# never checked. cpu.isa and cpu.threads depend on the model container's environment and limits.


def _pick(facts: Mapping[str, str], *names: str) -> dict[str, str]:
    return {n: facts[n] for n in names if facts.get(n, NONE) != NONE}


def check_platform(env: Mapping[str, str]) -> dict[str, str]:
    return _pick(probe_platform(env), "os", "arch")


def check_cpu(env: Mapping[str, str], info: Mapping[str, str] | None = None, arch: str | None = None) -> dict[str, str]:
    try:
        return _pick(probe_cpu(env, info, arch), "cpu.features", "cpu.model")
    except ConfigError as exc:  # nothing to check the facts file against, as where no GPU can be read
        log.warning("the facts file's CPU facts are not checked: %s", exc)
        return {}


def check_gpu(env: Mapping[str, str], read: Callable[[], gpus.Reading | None] = gpus.read,
              present: Callable[[], bool] = gpus.devices_present) -> dict[str, str]:
    """GPU name, SM and driver, when this container sees a GPU at all (not its count: an init
    container may be given fewer GPUs than the model container) and could read it."""
    facts = probe_gpu(env, read, present)
    return _pick(facts, "gpu.name", "gpu.sm", "gpu.driver") if facts["gpu.count"] not in ("0", gpus.UNKNOWN) else {}


CHECKS: tuple[Probe, ...] = (check_platform, check_cpu, check_gpu)
