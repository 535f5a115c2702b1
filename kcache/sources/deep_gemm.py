"""DeepGEMM's JIT kernels, and TensorRT-LLM's DeepGEMM fork.

    $DG_JIT_CACHE_DIR, else $SGLANG_DG_CACHE_DIR, else ~/.cache/deep_gemm (SGLang) and ~/.deep_gemm
        cache/kernel.<name>.<hash>/{kernel.cu,kernel.cubin}     -> ROOT/deep_gemm/cache/...
        tmp/                                                     not carried (compiles in flight)
    $TRTLLM_DG_CACHE_DIR                                         -> ROOT/trtllm_deep_gemm/

Read in DeepGEMM's csrc/jit/compiler.hpp (main of 2025): the cache is $DG_JIT_CACHE_DIR, else
$HOME/.deep_gemm; a kernel's directory hashes its name, the library's headers, the compiler and
its flags (which hold the GPU arch and the include path), so a stale entry is never picked up.
SGLang (python/sglang/srt/environ.py) defaults SGLANG_DG_CACHE_DIR to ~/.cache/deep_gemm and copies
it into DG_JIT_CACHE_DIR at import, so both variables are exported. TensorRT-LLM's bootstrap
(TRTLLM_CACHE_DIR) sets TRTLLM_DG_CACHE_DIR for its own fork and may append
deep_gemm_rank<r>_gpu<g> to DG_JIT_CACHE_DIR: a subdirectory, carried with the rest.
Facts it depends on: DeepGEMM version and install path, CUDA (nvcc/NVRTC) version, GPU SM.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, home_dir


class DeepGemmSource(Source):
    name = "deep_gemm"
    subdir = "deep_gemm"
    env_var = "DG_JIT_CACHE_DIR"
    junk = COMMON_JUNK + ("tmp",)  # DeepGEMM's own staging directory for cubins being written

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        for var in ("DG_JIT_CACHE_DIR", "SGLANG_DG_CACHE_DIR"):
            if env.get(var):
                return [Path(env[var])]
        home = home_dir(env)
        return [home / ".cache" / "deep_gemm", home / ".deep_gemm"]  # merged: kernel dirs are hash-named

    def exports(self, root: Path) -> dict[str, str]:
        place = str(self.restore_dir(root))
        return {"DG_JIT_CACHE_DIR": place, "SGLANG_DG_CACHE_DIR": place}


class TrtllmDeepGemmSource(Source):
    name = "trtllm_deep_gemm"
    subdir = "trtllm_deep_gemm"
    env_var = "TRTLLM_DG_CACHE_DIR"
    junk = COMMON_JUNK + ("tmp",)

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        return [Path(env["TRTLLM_DG_CACHE_DIR"])] if env.get("TRTLLM_DG_CACHE_DIR") else []
