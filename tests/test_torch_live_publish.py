"""A bundle published from a plain run (default cache locations, no kcache.env) restores warm.

The publisher never had TORCH_COMPILE_CACHE_KEY_TAG, and torch puts that tag into its FX graph
keys; a restore that sets one would make every graph miss. Proof of a warm start: FX graph and
AOTAutograd hits, and no compiler call that builds anything (a g++ wrapper on PATH counts them,
in every run, so the compiler facts are the same for publisher and restorer).

Measured here (torch 2.13 CPU, 2 shared cores, the tiny model): see the report printed with -s.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kcache import envfile

pytest.importorskip("torch")
pytestmark = pytest.mark.torch

TINY = ["--blocks", "1", "--dim", "64", "--seq", "16"]
# Logs every call that builds something. Not `-E`: torch preprocesses its header on every start,
# warm or cold, to key the precompiled header; that builds nothing.
WRAPPER = """#!/bin/sh
case " $* " in *" -E "*) ;; *" -o "*) echo "$*" >> "$KCACHE_TEST_CXX_LOG" ;; esac
exec {real} "$@"
"""


def plain_env(base: Path, tmpdir: Path) -> dict:
    """A clean environment: no kcache or torch cache settings, private HOME and TMPDIR, g++ wrapped."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "KCACHE_", "TORCH_COMPILE_", "CUDA_CACHE"))}  # fmt: skip
    tmpdir.mkdir(parents=True, exist_ok=True)
    env.update(KCACHE_HOME=str(base / "kcache-home"), HOME=str(base / "home"), TMPDIR=str(tmpdir),
               PATH=f"{base / 'bin'}:{env['PATH']}", KCACHE_TEST_CXX_LOG=str(base / "cxx.log"))  # fmt: skip
    return env


def run_workload(env: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "kcache.torch.workload", *TINY, "--json"], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def kcache(*args: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "kcache", *args, "--json"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def compiler_calls(base: Path) -> list[str]:
    log = base / "cxx.log"
    return log.read_text().splitlines() if log.exists() else []


def test_bundle_published_from_live_locations_restores_warm(tmp_path):
    real = subprocess.run(["sh", "-c", "command -v g++"], capture_output=True, text=True).stdout.strip()
    if not real:
        pytest.skip("no g++ here")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin/g++").write_text(WRAPPER.format(real=real))
    (tmp_path / "bin/g++").chmod(0o755)

    publisher = plain_env(tmp_path, tmp_path / "tmp-publisher")
    cold = run_workload(publisher)  # torch's defaults: $TMPDIR/torchinductor_<user>
    assert cold["fxgraph_miss"] >= 1 and compiler_calls(tmp_path)
    assert cold["cache_dir"].startswith(str(tmp_path / "tmp-publisher"))
    published = kcache("publish", "--model", "tiny", env=publisher)  # from the live directories
    assert published["files"] > 0

    pod = plain_env(tmp_path, tmp_path / "tmp-pod")  # a new container: nothing under its TMPDIR
    root = tmp_path / "root"
    restored = kcache("restore", "--into", str(root), "--model", "tiny", env=pod)
    assert restored["status"] == "hit" and {"inductor", "inductor-pch"} <= set(restored["layers"])
    before = compiler_calls(tmp_path)
    warm = run_workload({**pod, **envfile.read(root / envfile.NAME)})
    assert warm["cache_dir"] == str(root / "inductor")
    assert warm["fxgraph_hit"] >= 1 and warm["fxgraph_miss"] == 0, warm
    assert warm["aotautograd_miss"] == 0, warm
    built = compiler_calls(tmp_path)[len(before) :]
    assert not built, f"the restored pod ran the compiler: {built}"
    assert warm["compiled_artifacts"] == 0
    assert warm["output_checksum"] == cold["output_checksum"]
    print(f"cold {cold['seconds']:.2f} s, restored {warm['seconds']:.2f} s")
