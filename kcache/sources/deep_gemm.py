"""DeepGEMM's JIT kernels, and TensorRT-LLM's DeepGEMM fork.

    SGLang's $SGL_DG_CACHE_DIR, else its $SGLANG_DG_CACHE_DIR, else $DG_JIT_CACHE_DIR, else DeepGEMM's
    older $DG_CACHE_DIR, else ~/.cache/deep_gemm (SGLang) and ~/.deep_gemm
        cache/kernel.<name>.<hash>/{kernel.cu,kernel.cubin}     -> ROOT/deep_gemm/cache/...
        tmp/                                                     not carried (compiles in flight)
    $TRTLLM_DG_CACHE_DIR, else $HOME/.tensorrt_llm                -> ROOT/trtllm_deep_gemm/

Read in DeepGEMM's csrc/jit/compiler.hpp (main of 2025): the cache is $DG_JIT_CACHE_DIR, else
$HOME/.deep_gemm; a kernel's directory hashes its name, the library's headers, the compiler and
its flags (which hold the GPU arch and the include path), so a stale entry is never picked up.
DeepGEMM before 2025-05-07 (deep_gemm/jit/compiler.py) read $DG_CACHE_DIR instead, same layout.
SGLang sets DeepGEMM's variable at import, whatever it held, from its own: SGL_DG_CACHE_DIR until
its rename (2025-10), SGLANG_DG_CACHE_DIR since (python/sglang/srt/environ.py, which still copies a
set SGL_DG_CACHE_DIR over it), default ~/.cache/deep_gemm. So every one of these names is exported.
TensorRT-LLM's bootstrap (TRTLLM_CACHE_DIR) sets TRTLLM_DG_CACHE_DIR for its own fork (which FlashInfer
vendors too, csrc/nv_internal/tensorrt_llm/deep_gemm/compiler.cuh: unset, $HOME/.tensorrt_llm) and may append
deep_gemm_rank<r>_gpu<g> to DG_JIT_CACHE_DIR: a subdirectory, carried with the rest.
Facts it depends on: DeepGEMM version and install path, CUDA (nvcc/NVRTC) version, GPU SM.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from kcache.sources.base import COMMON_JUNK, Source, home_dir, temp_dir

# The variables naming the cache, the one that wins first: SGLang overrides DeepGEMM's at import.
_READ_FROM = ("SGL_DG_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "DG_JIT_CACHE_DIR", "DG_CACHE_DIR")


class DeepGemmSource(Source):
    name = "deep_gemm"
    subdir = "deep_gemm"
    env_var = "DG_JIT_CACHE_DIR"
    junk = COMMON_JUNK + ("tmp",)  # DeepGEMM's own staging directory for cubins being written

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        for var in _READ_FROM:
            if env.get(var):
                return [Path(env[var])]
        home = home_dir(env)
        return [home / ".cache" / "deep_gemm", home / ".deep_gemm"]  # merged: kernel dirs are hash-named

    def exports(self, root: Path) -> dict[str, str]:
        place = str(self.restore_dir(root))
        return dict.fromkeys(_READ_FROM, place)


class TrtllmDeepGemmSource(Source):
    name = "trtllm_deep_gemm"
    subdir = "trtllm_deep_gemm"
    env_var = "TRTLLM_DG_CACHE_DIR"
    junk = COMMON_JUNK + ("tmp",)

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        # The fork's compiler.cuh (getDefaultUserDir): $TRTLLM_DG_CACHE_DIR, else $HOME/.tensorrt_llm, else
        # <temp dir>/tensorrt_llm; it reads cache/ and stages into tmp/ there.
        if env.get("TRTLLM_DG_CACHE_DIR"):
            return [Path(env["TRTLLM_DG_CACHE_DIR"])]
        return [Path(env["HOME"]) / ".tensorrt_llm" if env.get("HOME") else temp_dir(env) / "tensorrt_llm"]
