"""TensorRT-LLM's autotuner cache: one file of chosen tactics per op and shape bucket.

    $TLLM_AUTOTUNER_CACHE_PATH (no default: unset, nothing persists)  -> ROOT/trtllm_autotuner/cache.json

Read in TensorRT-LLM's _torch/pyexecutor/model_engine.py and autotuner.py (main of 2025):
`autotune(cache_path=os.environ.get("TLLM_AUTOTUNER_CACHE_PATH"))` loads the file before profiling
and saves it after; one file holds shared and per-rank entries. Its bootstrap sets the variable to
$TRTLLM_CACHE_DIR/autotuner/cache.json. The file records the library version and device, but the
loader does not refuse a mismatch, so the facts it depends on (engine.tensorrt_llm, GPU name and
SM, TP size via --extra) must be in the bundle key; the layer is all-or-nothing under it.
Releases between PR #7738 (September 2025) and #10336 (December 2025, ranks merged into one file) never
write the path itself: each rank loads and saves `os.path.splitext(path)[0] + ".rank<r>.json"`. Those
files travel beside it, renamed for the fixed name (cache.rank<r>.json), where such a release looks.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path

from kcache.sources.base import FileInfo, Source

FILE = "cache.json"
FILE_STEM = os.path.splitext(FILE)[0]


class TrtllmAutotunerSource(Source):
    """A single file: carried under one fixed name whatever it was called, so the export can name it."""

    name = "trtllm_autotuner"
    subdir = "trtllm_autotuner"
    env_var = "TLLM_AUTOTUNER_CACHE_PATH"
    one_file = True

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        configured = env.get("TLLM_AUTOTUNER_CACHE_PATH")
        return [Path(configured)] if configured else []  # the file itself; walk() takes either form

    def walk(self, top: Path) -> Iterator[FileInfo]:
        # live: the file (which may not exist, its rank files beside it); ROOT's layout: its directory
        folder, name = (top, FILE) if top.is_dir() else (top.parent, top.name)
        yield from _regular(FILE, folder / name)
        ranks = re.compile(re.escape(os.path.splitext(name)[0]) + r"\.rank(0|[1-9][0-9]{0,5})\.json")
        try:
            names = sorted(n for n in os.listdir(folder) if ranks.fullmatch(n))
        except OSError:  # absent, not a directory, unreadable: no rank files
            return
        for found in names:
            yield from _regular(f"{FILE_STEM}.rank{ranks.fullmatch(found).group(1)}.json", folder / found)

    def exports(self, root: Path) -> dict[str, str]:
        return {"TLLM_AUTOTUNER_CACHE_PATH": str(self.restore_dir(root) / FILE)}


def _regular(rel: str, path: Path) -> Iterator[FileInfo]:
    """`path` as the layer's `rel` if it is a regular file (a link could point anywhere)."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    if stat.S_ISREG(st.st_mode):
        yield FileInfo(rel, path, stat.S_IMODE(st.st_mode) & 0o777, st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                       st.st_ino)  # fmt: skip
