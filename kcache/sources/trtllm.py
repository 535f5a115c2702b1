"""TensorRT-LLM's autotuner cache: one file of chosen tactics per op and shape bucket.

    $TLLM_AUTOTUNER_CACHE_PATH (no default: unset, nothing persists)  -> ROOT/trtllm_autotuner/cache.json

Read in TensorRT-LLM's _torch/pyexecutor/model_engine.py and autotuner.py (main of 2025):
`autotune(cache_path=os.environ.get("TLLM_AUTOTUNER_CACHE_PATH"))` loads the file before profiling
and saves it after; one file holds shared and per-rank entries. Its bootstrap sets the variable to
$TRTLLM_CACHE_DIR/autotuner/cache.json. The file records the library version and device, but the
loader does not refuse a mismatch, so the facts it depends on (engine.tensorrt_llm, GPU name and
SM, TP size via --extra) must be in the bundle key; the layer is all-or-nothing under it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from kcache.sources.base import FileInfo, Source

FILE = "cache.json"


class TrtllmAutotunerSource(Source):
    """A single file: carried under one fixed name whatever it was called, so the export can name it."""

    name = "trtllm_autotuner"
    subdir = "trtllm_autotuner"
    env_var = "TLLM_AUTOTUNER_CACHE_PATH"

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        configured = env.get("TLLM_AUTOTUNER_CACHE_PATH")
        return [Path(configured)] if configured else []  # the file itself; walk() takes either form

    def walk(self, top: Path) -> Iterator[FileInfo]:
        path = top if not top.is_dir() else top / FILE  # live: the file; ROOT's layout: its directory
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return
        if stat.S_ISREG(st.st_mode):
            yield FileInfo(FILE, path, stat.S_IMODE(st.st_mode) & 0o777, st.st_size, st.st_mtime_ns,
                           st.st_ctime_ns, st.st_ino)  # fmt: skip

    def exports(self, root: Path) -> dict[str, str]:
        return {"TLLM_AUTOTUNER_CACHE_PATH": str(self.restore_dir(root) / FILE)}
