"""A reference torch.compile workload that reports how warm its start was.

kcache claims a restored cache makes a process start fast *and* skip the compiler. This module is
the measuring stick for that claim: run it as a child process
(``python -m kcache.torch.workload [--blocks N] [--dim D] [--seq S] [--batch B] [--json]``) and it
compiles a small transformer on CPU with Inductor, then reports

* ``seconds``: time to first output, measured from the top of this module so that the cost of
  ``import torch`` is included (that is what a restarting service pays);
* torch's FX-graph and AOTAutograd cache hit/miss counters;
* ``compiled_artifacts``: how many ``.so``/``.gch``/``.pch`` files g++ wrote during the run.
  Torch's counters can report hits while every kernel is rebuilt (e.g. torch installed at another
  path, or the precompiled header missing), so "warm" must be judged by this number too;
* a checksum of the output, so a cache that hits but computes garbage is caught;
* where the time went: ``import_seconds`` (from the top of this module through ``import torch``),
  ``compile_seconds`` (compile and first call), and the child processes the run started
  (``subprocesses``: compiler, python, other), counted by an audit hook when run as a script.

Like a service that integrates kcache, it calls ``kcache.torch.isa.trust_restored_probes()``
before compiling (``restored_probes`` says whether that took effect: only after a restore hit),
and ``kcache.torch.pch.remember_headers()``, which records where torch's precompiled headers are and,
in a restored root, names them without preprocessing (``remembered_headers``: the hook is on).

Torch is imported lazily, inside functions: importing this module must stay cheap and must work
where torch is not installed (the kcache CLI imports it to reuse the helpers).
"""

import time

# Taken before anything else so "time to first output" covers interpreter-level imports too.
_MODULE_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from typing import Any  # noqa: E402

from kcache.sources.base import torch_user  # noqa: E402
from kcache.torch import counters as inductor_counters  # noqa: E402
from kcache.torch.isa import trust_restored_probes  # noqa: E402
from kcache.torch.pch import remember_headers  # noqa: E402

ARTIFACT_SUFFIXES = (".so", ".gch", ".pch")
HEADS = 4

Snapshot = dict[str, tuple[int, int]]
COMPILERS = ("g++", "gcc", "c++", "cc", "clang", "clang++")
_SPAWNED = {"compiler": 0, "python": 0, "other": 0}
_WATCHING: list[bool] = []


def watch_subprocesses() -> None:
    """Count every child process this interpreter starts, by kind (an audit hook: cannot be removed)."""
    if _WATCHING:
        return
    _WATCHING.append(True)

    def hook(event: str, args: tuple) -> None:
        if event == "subprocess.Popen":
            _SPAWNED[spawn_kind(args[0])] += 1

    sys.addaudithook(hook)


def spawn_kind(executable: Any) -> str:
    """compiler, python or other, from the program a child process runs."""
    name = os.path.basename(os.fsdecode(executable)) if isinstance(executable, (str, bytes, os.PathLike)) else ""
    if name in COMPILERS or name.endswith(("-g++", "-gcc")):
        return "compiler"
    return "python" if os.path.realpath(executable or "") == os.path.realpath(sys.executable) else "other"


def default_cache_dir() -> str:
    """Torch's default Inductor cache dir: ``$TMPDIR/torchinductor_<user>``."""
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + torch_user())


def inductor_cache_dir() -> str:
    """The cache dir this process's Inductor will use (absolute, like torch makes it)."""
    return os.path.abspath(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir())


def header_dir() -> str:
    """Where torch keeps precompiled headers.

    Torch deliberately ignores TORCHINDUCTOR_CACHE_DIR here (codecache.py, ``_HEADER_DIR``), so
    the header lives under $TMPDIR even when the cache dir is elsewhere.
    """
    return os.path.join(default_cache_dir(), "precompiled_headers")


def artifact_dirs() -> list[str]:
    """Every directory in which g++ output can appear during a compile."""
    return [inductor_cache_dir(), header_dir()]


def artifact_snapshot(dirs: list[str]) -> Snapshot:
    """Map each compiled artifact under ``dirs`` to ``(size, mtime_ns)``.

    Missing directories are empty, not errors: a cold start has none. Overlapping dirs (the header
    dir sits inside the default cache dir) are harmless because paths are the keys.
    """
    snapshot: Snapshot = {}
    for top in dirs:
        for root, _subdirs, files in os.walk(top):
            for name in files:
                if not name.endswith(ARTIFACT_SUFFIXES):
                    continue
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:  # removed by a concurrent compile between walk and stat
                    continue
                snapshot[path] = (st.st_size, st.st_mtime_ns)
    return snapshot


def count_changed(before: Snapshot, after: Snapshot) -> int:
    """Number of artifacts that are new in ``after`` or differ in size or mtime."""
    return sum(1 for path, stat in after.items() if before.get(path) != stat)


def _block_class() -> type:
    # Defined on demand because nn.Module cannot be subclassed before torch is imported.
    import torch
    from torch import nn

    class Block(nn.Module):
        """Pre-norm transformer block; attention uses plain matmul/softmax so Inductor sees it."""

        def __init__(self, dim: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.norm1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.norm2 = nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

        def attention(self, x: torch.Tensor) -> torch.Tensor:
            batch, seq, dim = x.shape
            qkv = self.qkv(x).view(batch, seq, 3, self.heads, dim // self.heads)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
            scores = (q @ k.transpose(-2, -1)) * (dim // self.heads) ** -0.5
            out = torch.softmax(scores, dim=-1) @ v
            return self.proj(out.transpose(1, 2).reshape(batch, seq, dim))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.attention(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    return Block


def build_model(blocks: int = 4, dim: int = 256, heads: int = HEADS) -> Any:
    """A deterministic (seed 0), eval-mode stack of ``blocks`` transformer blocks.

    There is deliberately no final LayerNorm: it would make every row sum to zero, and the output
    checksum (a plain sum) would then be 0.0 whatever the kernels computed.
    """
    import torch
    from torch import nn

    if dim % heads:
        raise ValueError(f"dim={dim} is not divisible by heads={heads}")
    block = _block_class()
    torch.manual_seed(0)
    return nn.Sequential(*(block(dim, heads) for _ in range(blocks))).eval()


def make_input(batch: int, seq: int, dim: int) -> Any:
    """A deterministic input that does not disturb the global RNG."""
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randn(batch, seq, dim, generator=generator)


def run(blocks: int = 4, dim: int = 256, seq: int = 64, batch: int = 2, start: float | None = None) -> dict[str, Any]:
    """Compile and run the workload once; return the measurements described in the docstring.

    ``start`` defaults to this module's import time, which is right for a child process; callers
    running it in-process should pass their own ``time.perf_counter()`` reference.
    """
    # Snapshot before torch is imported: importing torch may already trigger compiles elsewhere.
    dirs = artifact_dirs()
    before = artifact_snapshot(dirs)

    origin = _MODULE_START if start is None else start
    import torch

    imported = time.perf_counter()
    restored_probes = trust_restored_probes()
    headers_hook = remember_headers()
    model = torch.compile(build_model(blocks, dim), dynamic=False)
    with torch.no_grad():
        output = model(make_input(batch, seq, dim))
    seconds = time.perf_counter() - origin

    result: dict[str, Any] = {"seconds": round(seconds, 3)}
    result["import_seconds"] = round(imported - origin, 3)
    result["compile_seconds"] = round(seconds - (imported - origin), 3)
    result["restored_probes"] = restored_probes
    result["remembered_headers"] = headers_hook
    if _WATCHING:
        result["subprocesses"] = dict(_SPAWNED)
    result.update(inductor_counters())
    result["compiled_artifacts"] = count_changed(before, artifact_snapshot(dirs))
    result["output_checksum"] = round(float(output.sum()), 4)
    result["cache_dir"] = inductor_cache_dir()
    return result


def format_summary(result: dict[str, Any]) -> str:
    """A short human-readable report of one run."""
    return (
        f"first output after {result['seconds']:.2f} s\n"
        f"fx graph cache:     {result['fxgraph_hit']} hit / {result['fxgraph_miss']} miss\n"
        f"aot autograd cache: {result['aotautograd_hit']} hit / {result['aotautograd_miss']} miss\n"
        f"compiled artifacts: {result['compiled_artifacts']} new or rebuilt\n"
        f"output checksum:    {result['output_checksum']}\n"
        f"cache dir:          {result['cache_dir']}"
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kcache.torch.workload",
        description="Compile a small transformer with torch.compile and report cache behaviour.",
    )
    parser.add_argument("--blocks", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--dim", type=int, default=256, help=f"model width, divisible by {HEADS}")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=2, help="batch size (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    args = parser.parse_args(argv)
    if min(args.blocks, args.dim, args.seq, args.batch) < 1 or args.dim % HEADS:
        parser.error(f"sizes must be positive and --dim divisible by {HEADS}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    watch_subprocesses()
    result = run(args.blocks, args.dim, args.seq, args.batch)
    print(json.dumps(result) if args.json else format_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
