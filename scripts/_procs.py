"""Child processes shared by ``scripts/demo.py`` and ``scripts/bench_coldstart.py``.

Every step runs as a fresh process, because that is what a restarting pod pays for: interpreter
start, ``import torch``, the kcache CLI's own imports. Each helper returns the step's JSON payload
and the wall seconds the whole process took, measured from just before it was started.

    kcache restore --into ROOT --json   -> ({"status": ...}, wall)
    kcache publish --from ROOT --json   -> ({"bundle_id": ...}, wall)
    python -m kcache.torch.workload --json    -> ({"seconds": ..., "fxgraph_hit": ...}, wall)

Call ``compile_kcache()`` first: the children must load kcache as an installed image does.
"""

from __future__ import annotations

import compileall
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kcache import envfile

Payload = dict[str, Any]
ISOLATED = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "TMPDIR",
    "TORCH_COMPILE_CACHE_KEY_TAG",
    "KCACHE_STORE",
    "KCACHE_INDEX",
)
STDERR_TAIL = 2000  # enough for a traceback's last frames without flooding the terminal


class StepFailed(Exception):
    """A child process failed or printed no JSON; carries what is needed to report it precisely."""

    def __init__(self, argv: Sequence[str], returncode: int, stdout: str, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"`{' '.join(self.argv)}` exited {returncode}")

    def details(self) -> str:
        return f"{self}\nstdout: {self.stdout.strip()[-STDERR_TAIL:]}\nstderr: {self.stderr.strip()[-STDERR_TAIL:]}"


def compile_kcache() -> None:
    """Write kcache's bytecode, as installing its wheel does (pip compiles what it installs).

    An editable install (``pip install -e .``) leaves kcache's modules uncompiled, and under
    PYTHONDONTWRITEBYTECODE=1 no child ever writes their bytecode: every timed kcache process would
    compile all its modules from source, 0.1-0.2 s that no pod with an installed kcache pays.
    """
    import kcache

    if not compileall.compile_dir(Path(kcache.__file__).parent, quiet=1):
        raise RuntimeError(f"could not compile kcache's modules under {Path(kcache.__file__).parent}")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (for a server a benchmark starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kcache_command() -> list[str]:
    """The kcache console script of this interpreter's environment.

    kcache/cli has no ``__main__``, so ``python -m kcache.cli`` does not run; the script installed
    next to ``sys.executable`` is the one that belongs to the same kcache and torch.
    """
    beside = Path(sys.executable).with_name("kcache")
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("kcache")
    if found is None:
        raise FileNotFoundError(f"no kcache script next to {sys.executable} or on PATH; pip install -e .")
    return [found]


def run_json(argv: Sequence[str], env: Mapping[str, str]) -> tuple[Payload, float]:
    """Run ``argv``; return the last JSON object it printed on stdout and its wall seconds."""
    started = time.perf_counter()
    proc = subprocess.run(list(argv), env=dict(env), capture_output=True, text=True)
    wall = time.perf_counter() - started
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise StepFailed(argv, proc.returncode, proc.stdout, proc.stderr)
    return json.loads(lines[-1]), wall


def restore(root: Path, model: str, env: Mapping[str, str], index: str | None = None) -> tuple[Payload, float]:
    """``kcache restore --into ROOT``; kcache is fail-open, so an "error" status is raised here.

    ``index`` is passed as ``--index`` ("none": the store's signed refs, as the example init container).
    """
    argv = kcache_command() + ["restore", "--into", str(root), "--model", model, "--json"]
    argv += ["--index", index] if index is not None else []
    payload, wall = run_json(argv, env)
    if payload.get("status") not in ("hit", "miss"):
        raise StepFailed(argv, 0, json.dumps(payload), payload.get("reason") or "")
    return payload, wall


def publish(root: Path, model: str, env: Mapping[str, str]) -> tuple[Payload, float]:
    argv = kcache_command() + ["publish", "--from", str(root), "--model", model, "--json"]
    return run_json(argv, env)


def env_for(root: Path, base: Mapping[str, str]) -> dict[str, str]:
    """``base`` plus the exports of ROOT/kcache.env, as a model container would source them."""
    env = dict(base)
    env.update(envfile.read(root / envfile.NAME))
    return env


def workload_argv(blocks: int, dim: int, seq: int) -> list[str]:
    return [sys.executable, "-m", "kcache.torch.workload", "--blocks", str(blocks), "--dim", str(dim),
            "--seq", str(seq), "--json"]  # fmt: skip


def run_workload(env: Mapping[str, str], blocks: int, dim: int, seq: int) -> tuple[Payload, float]:
    return run_json(workload_argv(blocks, dim, seq), env)


def model_id(blocks: int, dim: int, seq: int) -> str:
    # The shape is part of the name so that bundles of different demo sizes never shadow each other.
    return f"kcache-demo/transformer-b{blocks}-d{dim}-s{seq}"


def base_env(home: Path) -> dict[str, str]:
    """This process's environment with an isolated kcache store and no inherited cache locations.

    An inherited cache dir or TMPDIR would leak the caller's caches into a "cold" run, and an
    inherited KCACHE_STORE/KCACHE_INDEX would point past the isolated KCACHE_HOME.
    """
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED}
    env["KCACHE_HOME"] = str(home)
    return env
