"""A torch C++ extension built with cpp_extension.load() (ninja), restored under another ROOT and HOME.

Acceptance for mtimes: ninja judges "up to date" by .ninja_log and modification times, so a restore
that wrote every file "now" would relink (or recompile) in the model container. Proof of use is the
compiler itself: a `c++` wrapper on PATH logs every call, and the restored run must make no call
that compiles (-c) or links (-shared).
"""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kcache import envfile

pytest.importorskip("torch")
pytest.importorskip("ninja")
pytestmark = pytest.mark.torch

SOURCE = """
#include <torch/extension.h>
torch::Tensor twice(torch::Tensor x) { return x * 2; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("twice", &twice); }
"""
LOAD = """
import sys, torch
from torch.utils.cpp_extension import load
ext = load("kc_twice", [sys.argv[1]])
print(ext.twice(torch.arange(3.0)).tolist())
"""


def wrapper(directory: Path, log: Path) -> Path:
    """A `c++` that appends its arguments to `log`, then runs the real compiler."""
    directory.mkdir(parents=True)
    real = shutil.which("c++")
    script = directory / "c++"
    script.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\nexec {real} "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return directory


def builds(log: Path) -> list[str]:
    calls = log.read_text().splitlines() if log.exists() else []
    return [c for c in calls if " -c " in f" {c} " or " -shared" in f" {c}"]


def env_for(base: Path, side: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCH_EXTENSIONS", "KCACHE_", "XDG_"))}
    wrap = wrapper(base / side / "bin", base / side / "c++.log")
    env.update(HOME=str(base / side / "home"), PATH=f"{wrap}:{Path(sys.executable).parent}:{env['PATH']}",
               CXX="c++", KCACHE_HOME=str(base / "kcache-home"))  # fmt: skip
    return env


def run(args, env, *, cwd=None) -> str:
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_restored_extension_loads_without_calling_the_compiler(tmp_path):
    source = tmp_path / "image/ext.cpp"  # where the image keeps it: the same path in both pods
    source.parent.mkdir()
    source.write_text(SOURCE)
    built = env_for(tmp_path, "builder")
    assert run([sys.executable, "-c", LOAD, str(source)], built).strip() == "[0.0, 2.0, 4.0]"
    assert builds(tmp_path / "builder/c++.log"), "the cold build did not go through the wrapper"
    kcache = [sys.executable, "-m", "kcache"]
    pub = json.loads(run(kcache + ["publish", "--layers", "torch_extensions", "--model", "m", "--json"], built))
    assert pub["files"] >= 4  # build.ninja, .ninja_log, .ninja_deps, ext.o, kc_twice.so
    shutil.rmtree(tmp_path / "builder/home")

    pod = env_for(tmp_path, "pod")
    root = tmp_path / "pod/cache"
    restored = json.loads(run(kcache + ["restore", "--into", str(root), "--model", "m", "--json"], pod))
    assert restored["status"] == "hit"
    exports = envfile.read(root / "kcache.env")
    assert exports["TORCH_EXTENSIONS_DIR"] == str(root / "torch_extensions")
    assert run([sys.executable, "-c", LOAD, str(source)], {**pod, **exports}).strip() == "[0.0, 2.0, 4.0]"
    assert builds(tmp_path / "pod/c++.log") == [], "the restored extension was rebuilt"


INLINE = """
import torch
from torch.utils.cpp_extension import load_inline
ext = load_inline("kc_inline", "torch::Tensor thrice(torch::Tensor x) { return x * 3; }", functions=["thrice"])
print(ext.thrice(torch.arange(3.0)).tolist())
"""


@pytest.mark.parametrize("serve_at", ["builder/cache", "pod/elsewhere"])
def test_restored_inline_extension_loads_without_calling_the_compiler(tmp_path, serve_at):
    """load_inline writes its sources into the build directory, and build.ninja, .ninja_log's command
    hashes and .ninja_deps name them by absolute path: restored into the ROOT it was built under (the
    warmup job's --into is the Deployment's) it loads as is; under another ROOT restore rewrites the
    three (kcache.ninjabuild), where every pod had rebuilt it."""
    built = {**env_for(tmp_path, "builder"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "builder/cache/torch_extensions")}
    assert run([sys.executable, "-c", INLINE], built).strip() == "[0.0, 3.0, 6.0]"
    assert builds(tmp_path / "builder/c++.log"), "the cold build did not go through the wrapper"
    kcache = [sys.executable, "-m", "kcache"]
    run(kcache + ["publish", "--layers", "torch_extensions", "--model", "m", "--json"], built)
    shutil.rmtree(tmp_path / "builder/cache")

    pod = env_for(tmp_path, "pod")
    root = tmp_path / serve_at
    assert json.loads(run(kcache + ["restore", "--into", str(root), "--model", "m", "--json"], pod))["status"] == "hit"
    exports = envfile.read(root / "kcache.env")
    assert run([sys.executable, "-c", INLINE], {**pod, **exports}).strip() == "[0.0, 3.0, 6.0]"
    assert builds(tmp_path / "pod/c++.log") == [], "the restored extension was rebuilt"
