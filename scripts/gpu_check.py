"""The GPU acceptance check behind scripts/gpu_check: does a restored pod compile nothing on CUDA?

    WORK/
      store/ index.db home/             kcache's store, index and KCACHE_HOME for this run
      A/                                cold: restore (a miss) lays out ROOT, the children compile into it
      B/                                restored: a fresh ROOT, restored from what A published
      tmp-A/ tmp-B/                     each side's own TMPDIR and HOME, as two pods would have

Two children run on each side, each a fresh process with ROOT/kcache.env in its environment:
  compile   torch.compile of a small MLP on CUDA: first-call latency, torch's cache counters, and the
            files the process added to the Triton cache (restored: must be 0)
  ptx       a generated PTX kernel loaded with the driver API under CUDA_FORCE_PTX_JIT=1: load time and
            the files the process added to the CUDA ComputeCache (restored: must be 0)
Files are counted by this driver process before and after each child has exited.

Prints one JSON object. Without a GPU (no nvidia-smi, or torch without CUDA) it prints
{"status": "skipped", ...} and exits 0, so CI can run it anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD_TIMEOUT = 240  # seconds; the whole check must stay under ten minutes
MODEL = "kcache-gpu-check/mlp"
PTX_FMAS = 20_000  # enough instructions that the driver's PTX->SASS JIT takes measurable time


# ---- children (run in fresh processes, with ROOT/kcache.env in the environment) ------------------


def files_under(top: str | None) -> set[str]:
    if not top or not os.path.isdir(top):
        return set()
    return {os.path.relpath(os.path.join(d, f), top) for d, _, names in os.walk(top) for f in names}


def child_compile() -> dict:
    import torch
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(
            torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512), torch.nn.LayerNorm(512)
        )
        .cuda()
        .half()
    )
    compiled = torch.compile(model, dynamic=False)
    x = torch.randn(64, 512, device="cuda", dtype=torch.half)
    torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.no_grad():
        out = compiled(x)
    torch.cuda.synchronize()
    first_call = time.perf_counter() - started
    return {
        "first_call_s": round(first_call, 4),
        "inductor_counters": dict(counters["inductor"]),
        "aot_autograd_counters": dict(counters["aot_autograd"]),
        "checksum": float(out.float().sum().item()),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }


def ptx_source(fmas: int) -> bytes:
    body = "\n".join(f"  fma.rn.f32 %f1, %f1, 0f3F8{i % 4096:05X}, 0f3F800000;" for i in range(fmas))
    return (
        ".version 7.0\n.target sm_50\n.address_size 64\n"
        ".visible .entry kcache_check(.param .u64 p)\n{\n  .reg .f32 %f<2>;\n  .reg .u64 %rd<2>;\n"
        "  ld.param.u64 %rd1, [p];\n  cvta.to.global.u64 %rd1, %rd1;\n  ld.global.f32 %f1, [%rd1];\n"
        f"{body}\n  st.global.f32 [%rd1], %f1;\n  ret;\n}}\n"
    ).encode() + b"\0"


def child_ptx() -> dict:
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")

    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed with CUDA error {status}")

    dev, ctx, module, function = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
    check(cuda.cuInit(0), "cuInit")
    check(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    ptx = ptx_source(PTX_FMAS)
    started = time.perf_counter()
    check(cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(ptx)), "cuModuleLoadData")
    load = time.perf_counter() - started
    check(cuda.cuModuleGetFunction(ctypes.byref(function), module, b"kcache_check"), "cuModuleGetFunction")
    check(cuda.cuModuleUnload(module), "cuModuleUnload")
    return {"load_s": round(load, 4)}


# ---- the driver (no torch import here) -------------------------------------------------------------


def run_json(argv: list[str], env: dict) -> dict:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"`{' '.join(argv[:4])} ...` exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return json.loads(lines[-1])


def kcache(args: list[str], env: dict) -> dict:
    return run_json([sys.executable, "-m", "kcache", *args, "--model", MODEL, "--json"], env)


def side(work: Path, name: str, base: dict) -> tuple[Path, dict]:
    """ROOT for one side and the environment its children get (fresh TMPDIR and HOME, ROOT/kcache.env)."""
    from kcache import envfile

    own = work / f"tmp-{name}"
    (own / "home").mkdir(parents=True)
    env = {**base, "TMPDIR": str(own), "HOME": str(own / "home")}
    restored = kcache(["restore", "--into", str(work / name)], env)
    env.update(envfile.read(work / name / envfile.NAME))
    return work / name, {**env, "_restore": json.dumps(restored)}


def child(kind: str, env: dict, watched: str, count_as: str) -> dict:
    """Run one child; count the files it added under `watched`, from outside: the driver may write
    its ComputeCache only when the process exits."""
    before = files_under(env.get(watched))
    report = run_json([sys.executable, os.path.abspath(__file__), "--child", kind], env)
    new = sorted(files_under(env.get(watched)) - before)
    return {**report, count_as: len(new), f"{count_as}_examples": new[:5]}


def children(env: dict) -> dict:
    clean = {k: v for k, v in env.items() if not k.startswith("_")}
    return {
        "compile": child("compile", clean, "TRITON_CACHE_DIR", "triton_new_files"),
        "ptx": child("ptx", {**clean, "CUDA_FORCE_PTX_JIT": "1"}, "CUDA_CACHE_PATH", "compute_cache_new_files"),
    }


def gpu_missing() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return "no nvidia-smi on PATH: this machine has no NVIDIA driver"
    probe = "import torch, triton; print(torch.cuda.is_available())"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    if proc.returncode != 0:
        return f"torch or triton is not importable: {proc.stderr.strip().splitlines()[-1:]}"
    return None if proc.stdout.strip() == "True" else "torch.cuda.is_available() is False"


def check(work: Path) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "CUDA_CACHE",
                                                                      "KCACHE_", "TORCH_COMPILE_"))}  # fmt: skip
    base.update(KCACHE_HOME=str(work / "home"), KCACHE_STORE=f"file://{work / 'store'}",
                KCACHE_INDEX=f"sqlite:///{work / 'index.db'}")  # fmt: skip
    root_a, env_a = side(work, "A", base)
    cold = children(env_a)
    published = kcache(["publish", "--from", str(root_a)], base)
    shutil.rmtree(root_a)  # the first pod is gone; only the store remains
    _root_b, env_b = side(work, "B", base)
    warm = children(env_b)
    restore_b = json.loads(env_b["_restore"])
    checks = {
        "restore_hit": restore_b.get("status") == "hit",
        "triton_compiles_after_restore_zero": warm["compile"]["triton_new_files"] == 0,
        "fxgraph_hit_after_restore": warm["compile"]["inductor_counters"].get("fxgraph_cache_hit", 0) > 0,
        "compute_cache_new_after_restore_zero": warm["ptx"]["compute_cache_new_files"] == 0,
        "cold_run_compiled": cold["compile"]["triton_new_files"] > 0 and cold["ptx"]["compute_cache_new_files"] > 0,
        "same_output": cold["compile"]["checksum"] == warm["compile"]["checksum"],
    }
    return {
        "status": "ok" if all(checks.values()) else "failed",
        "checks": checks,
        "gpu": warm["compile"]["gpu"],
        "torch": warm["compile"]["torch"],
        "first_call_s": {"cold": cold["compile"]["first_call_s"], "restored": warm["compile"]["first_call_s"]},
        "ptx_load_s": {"cold": cold["ptx"]["load_s"], "restored": warm["ptx"]["load_s"]},
        "cold": cold,
        "restored": warm,
        "publish": {k: published.get(k) for k in ("bundle_id", "files", "bytes", "layers")},
        "restore": {k: restore_b.get(k) for k in ("status", "files", "bytes", "seconds", "layers")},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["compile", "ptx"], help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help="Where to work (default: a fresh temp dir, removed after).")
    parser.add_argument("--keep", action="store_true", help="Keep the work dir.")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_compile() if args.child == "compile" else child_ptx()))
        return 0
    started = time.perf_counter()
    missing = gpu_missing()
    if missing:
        print(json.dumps({"status": "skipped", "reason": missing}))
        return 0
    work = Path(tempfile.mkdtemp(prefix="kcache-gpu-check-", dir=args.workdir))
    try:
        result = check(work)
        code = 0 if result["status"] == "ok" else 1
    except (RuntimeError, subprocess.TimeoutExpired, OSError, KeyError, ValueError) as exc:
        result, code = {"status": "error", "reason": str(exc)[-2000:]}, 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = round(time.perf_counter() - started, 2)
    result["workdir"] = str(work) if args.keep else None
    print(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
