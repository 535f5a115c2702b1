"""Fingerprints: the named facts that decide whether a cached kernel is safe to run here.

    facts (dotted names, string values)
      ├── toolchain facts: machine, drivers, compilers, torch/triton, Inductor settings
      │     toolchain_key = xxh3_128(canonical {"schema", "facts": toolchain facts})
      └── workload facts: names starting model. / workload. / extra.
            workload_key  = xxh3_128(canonical {"schema", "facts": workload facts})
    bundle_key = xxh3_128(canonical {"schema", "toolchain": toolchain_key, "workload": workload_key})

Torch's own cache keys leave out facts that change what a kernel does (the CPU ISA) or where it
links from (the torch install path): serving such a hit gives NaNs or heap corruption, so those
facts are here. Facts that differ between identical replicas (host names, IPs, HOME, the
cache directories themselves) are never here, or no replica would ever hit.

Nothing here imports torch or triton: versions are read from their files, GPUs from NVML or
nvidia-smi. Every probe can be overridden with `--fact name=value`.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kcache import canonical, engines
from kcache.errors import ConfigError

log = logging.getLogger(__name__)

SCHEMA = 1
WORKLOAD_PREFIXES = ("model.", "workload.", "extra.")
NONE = "none"

# Settings that name places or runs rather than behaviour: they differ between identical replicas
# (or are set by kcache's own env file), so keying on them would make every pod miss.
# Torch leaves all of these out of its own keys (torch 2.13 config modules).
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
    "TORCH_COMPILE_CACHE_KEY_TAG",  # kcache's env file sets it from the toolchain key
}
_KEYED_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_")
# x86 flags behind Inductor's ISA choice (torch/_inductor/cpu_vec_isa.py) and ATen's kernels.
_X86_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
                  "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")  # fmt: skip
# Volatile fields of a Hugging Face config.json that do not change the compiled graph.
_CONFIG_VOLATILE = {"_name_or_path", "transformers_version", "_commit_hash"}


@dataclass(frozen=True)
class Fingerprint:
    facts: Mapping[str, str]
    toolchain_key: str
    workload_key: str
    bundle_key: str

    def as_dict(self) -> dict:
        return {
            "bundle_key": self.bundle_key,
            "toolchain_key": self.toolchain_key,
            "workload_key": self.workload_key,
            "facts": dict(sorted(self.facts.items())),
        }


def is_workload_fact(name: str) -> bool:
    return name.startswith(WORKLOAD_PREFIXES)


def compute(facts: Mapping[str, str]) -> Fingerprint:
    """Keys for a set of facts. Pure: the same facts give the same keys on any machine."""
    toolchain = {k: v for k, v in facts.items() if not is_workload_fact(k)}
    workload = {k: v for k, v in facts.items() if is_workload_fact(k)}
    toolchain_key = canonical.xxh3({"schema": SCHEMA, "facts": toolchain})
    workload_key = canonical.xxh3({"schema": SCHEMA, "facts": workload})
    bundle_key = canonical.xxh3({"schema": SCHEMA, "toolchain": toolchain_key, "workload": workload_key})
    return Fingerprint(dict(facts), toolchain_key, workload_key, bundle_key)


def parse_assignments(pairs: Iterable[str], flag: str) -> dict[str, str]:
    """`name=value` strings from the command line."""
    result = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError(flag, pair, "expected NAME=VALUE")
        result[name.strip()] = value
    return result


def collect(
    *,
    model: str | None = None,
    model_config: Path | None = None,
    extra: Mapping[str, str] | None = None,
    overrides: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    probes: Iterable[Callable[[Mapping[str, str]], dict[str, str]]] | None = None,
    facts_file: Path | None = None,
) -> Fingerprint:
    """Probe this machine, add the workload, apply overrides, and compute the keys.

    With `facts_file` (what `kcache fingerprint --json` printed on the machine that runs the
    model), nothing is probed: an init container without torch, g++ or a GPU then computes the
    model container's fingerprint. Workload flags and overrides still apply on top.
    """
    env = os.environ if env is None else env
    facts: dict[str, str] = {}
    if facts_file is not None:
        facts.update(load_facts_file(Path(facts_file)))
    else:
        for probe in PROBES if probes is None else probes:
            facts.update(probe(env))
    if facts_file is None or model or model_config or extra:
        facts.update(workload_facts(model, model_config, extra or {}))
    facts.update(overrides or {})
    return compute(facts)


def load_facts_file(path: Path) -> dict[str, str]:
    """Facts from `kcache fingerprint --json` output, or a flat JSON object of name -> value."""
    doc = _read_json(path, "--facts-file")
    facts = doc.get("facts", doc) if isinstance(doc, dict) else None
    if not isinstance(facts, dict) or not all(isinstance(v, str) for v in facts.values()):
        raise ConfigError("--facts-file", str(path), "expected `kcache fingerprint --json` output or {name: value}")
    return {str(k): v for k, v in facts.items()}


# ---- workload ---------------------------------------------------------------------------------


def workload_facts(model: str | None, config_path: Path | None, extra: Mapping[str, str]) -> dict[str, str]:
    facts = {"model.id": model or NONE}
    if config_path is not None:
        facts.update(_model_config_facts(Path(config_path)))
    facts.update({f"extra.{k}": v for k, v in extra.items()})
    return facts


def _read_json(path: Path, flag: str):
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(flag, str(path), f"cannot be read: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigError(flag, str(path), f"is not JSON: {exc}") from None


def _model_config_facts(path: Path) -> dict[str, str]:
    config = _read_json(path, "--model-config")
    if not isinstance(config, dict):
        raise ConfigError("--model-config", str(path), "is not a JSON object")
    kept = {k: v for k, v in config.items() if k not in _CONFIG_VOLATILE}
    facts = {"model.config": canonical.xxh3(kept)}
    if isinstance(config.get("architectures"), list):
        facts["model.arch"] = ",".join(map(str, config["architectures"]))
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype:
        facts["model.dtype"] = str(dtype)
    return facts


# ---- probes -----------------------------------------------------------------------------------


def probe_platform(env: Mapping[str, str]) -> dict[str, str]:
    libc, libc_version = platform.libc_ver()
    return {
        "os": platform.system().lower(),
        "arch": platform.machine(),
        "libc": f"{libc} {libc_version}".strip() or NONE,
        "python": "{}.{}".format(*platform.python_version_tuple()[:2]),
    }


def _package_dir(name: str) -> Path | None:
    """Where a package would be imported from, without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


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
        "torch.path": str(pkg.resolve().parent),
    }


def probe_triton(env: Mapping[str, str]) -> dict[str, str]:
    pkg = _package_dir("triton")
    if pkg is None or not (pkg / "__init__.py").is_file():
        return {"triton.version": NONE}
    match = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", (pkg / "__init__.py").read_text(), re.M)
    return {"triton.version": match.group(1) if match else NONE}


def probe_gpu(env: Mapping[str, str]) -> dict[str, str]:
    """GPU name, SM, count and driver: NVML first, then nvidia-smi, else none."""
    return _gpu_from_nvml() or _gpu_from_nvidia_smi() or {
        "gpu.name": NONE, "gpu.sm": NONE, "gpu.count": "0", "gpu.driver": NONE,
    }  # fmt: skip


def _gpu_from_nvml() -> dict[str, str] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound and friends: no driver here
        return None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(handle)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        driver = pynvml.nvmlSystemGetDriverVersion()
        decode = lambda s: s.decode() if isinstance(s, bytes) else str(s)  # noqa: E731
        return {"gpu.name": decode(name), "gpu.sm": f"sm_{major}{minor}", "gpu.count": str(count),
                "gpu.driver": decode(driver)}  # fmt: skip
    except Exception as exc:
        log.debug("NVML query failed: %s", exc)
        return None
    finally:
        pynvml.nvmlShutdown()


def _gpu_from_nvidia_smi() -> dict[str, str] | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    query = [smi, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    if not rows or len(rows[0]) != 3:
        return None
    name, cap, driver = rows[0]
    return {"gpu.name": name, "gpu.sm": "sm_" + cap.replace(".", ""), "gpu.count": str(len(rows)),
            "gpu.driver": driver}  # fmt: skip


def _cpuinfo() -> dict[str, str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    first = text.split("\n\n", 1)[0]
    fields = {}
    for line in first.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def probe_cpu(env: Mapping[str, str]) -> dict[str, str]:
    info = _cpuinfo()
    model = info.get("model name") or info.get("CPU part") or info.get("cpu model") or platform.processor()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    facts = {"cpu.model": model or NONE, "cpu.isa": pick_isa(platform.machine(), flags, env)}
    if platform.machine() in ("x86_64", "AMD64"):
        facts["cpu.flags"] = " ".join(f for f in _X86_ISA_FLAGS if f in flags) or NONE
    return facts


def pick_isa(arch: str, flags: set[str], env: Mapping[str, str]) -> str:
    """The vector ISA Inductor would generate code for (mirrors torch/_inductor/cpu_vec_isa.py).

    Candidates in torch's order, each valid when the CPU has every feature it needs; then
    ATEN_CPU_CAPABILITY picks the first candidate naming it ('default' means no vector code).
    Torch also runs compile probes that could veto a candidate; a compiler that cannot build
    AVX-512 code is already a different `cxx.*` fact.
    """
    if env.get("TORCHINDUCTOR_VEC_ISA_OK") == "0":
        return NONE
    if arch in ("x86_64", "AMD64"):
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
        vnni = avx512 and "avx512_vnni" in flags
        candidates = [
            name
            for name, ok in (
                ("amx", vnni and "amx_tile" in flags),
                ("avx512_vnni", vnni),
                ("avx512", avx512),
                ("avx2", "avx2" in flags),
            )  # fmt: skip
            if ok
        ]
        wanted = env.get("ATEN_CPU_CAPABILITY")
        if wanted == "default":
            return NONE
        if wanted in ("avx2", "avx512"):
            # torch matches on its ISA names, which all contain "avx512" for the AMX/VNNI variants.
            chosen = [c for c in candidates if wanted in c or (wanted == "avx512" and c == "amx")]
            if chosen:
                return chosen[0]
        return candidates[0] if candidates else NONE
    if arch == "aarch64":
        return "sve" if ({"sve", "sve2"} & flags) and "bf16" in flags else "neon"
    return arch


def probe_compiler(env: Mapping[str, str]) -> dict[str, str]:
    """The C++ compiler Inductor would call, and its `-v` text (part of torch's header keys)."""
    name = env.get("CXX") or "g++"
    path = shutil.which(name)
    if not path:
        return {"cxx.name": name, "cxx.version": NONE}
    try:
        text = subprocess.run([path, "-v"], capture_output=True, text=True, timeout=10).stderr
    except (OSError, subprocess.SubprocessError):
        text = ""
    lines = [line for line in text.splitlines() if " version " in line]
    return {"cxx.name": name, "cxx.version": lines[-1].strip() if lines else NONE,
            "cxx.v_hash": canonical.xxh3(text)}  # fmt: skip


# Thread settings read by torch's OpenMP/MKL start-up; kept raw as well, in case the rule below
# misses a combination.
_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MKL_DYNAMIC", "MKL_DOMAIN_NUM_THREADS")


def probe_threads(env: Mapping[str, str]) -> dict[str, str]:
    """The intra-op thread count that Inductor bakes into its CPU graph keys."""
    facts = {f"env.{name}": env[name] for name in _THREAD_ENV if name in env}
    if env.get("TORCHINDUCTOR_CPP_DYNAMIC_THREADS") == "1":
        facts["cpu.threads"] = "dynamic"
    else:
        facts["cpu.threads"] = str(default_threads(env))
    return facts


def default_threads(env: Mapping[str, str], cores: int | None = None) -> int:
    """torch.get_num_threads() of a fresh process started with `env`, without importing torch.

    ATen asks MKL, which takes MKL_NUM_THREADS, then OMP_NUM_THREADS's first item, else the
    physical cores this process may run on; requests are capped at the machine's physical
    cores unless MKL_DYNAMIC is false. Measured against torch 2.13 in 13 configurations.
    """
    usable, machine = physical_cores() if cores is None else (cores, cores)
    requested: int | None = None
    mkl = env.get("MKL_NUM_THREADS", "").strip()
    if mkl and mkl != "0":
        requested = int(mkl) if mkl.isdigit() and int(mkl) > 0 else 1
    elif "OMP_NUM_THREADS" in env:
        first = env["OMP_NUM_THREADS"].split(",")[0].strip()
        requested = int(first) if first.isdigit() and int(first) > 0 else None
    if requested is None:
        return usable
    if env.get("MKL_DYNAMIC", "").strip().lower() == "false":
        return requested
    return min(requested, machine)


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


def probe_settings(env: Mapping[str, str]) -> dict[str, str]:
    """Every Inductor / torch.compile setting from the environment (they change torch's keys)."""
    return {
        f"env.{name}": value
        for name, value in env.items()
        if name.startswith(_KEYED_ENV_PREFIXES) and name not in _NOT_KEYED_ENV
    }


PROBES: tuple[Callable[[Mapping[str, str]], dict[str, str]], ...] = (
    engines.probe_engines,  # vLLM, FlashInfer, TensorRT-LLM...: only those installed (kcache/engines.py)
    probe_platform,
    probe_torch,
    probe_triton,
    probe_gpu,
    probe_cpu,
    probe_compiler,
    probe_threads,
    probe_settings,
)
