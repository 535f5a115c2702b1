"""A real torch.compile on CPU: cold in one directory, restored into another, warm there.

Proof of use is torch's own counters (FX graph and AOTAutograd hits) plus the compiled-artifact
count: hits with rebuilt .so files or a rebuilt precompiled header would not be a warm start.
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

KCACHE = [sys.executable, "-m", "kcache"]
TINY = ["--blocks", "1", "--dim", "64", "--seq", "16"]


def kcache(*args, env):
    out = subprocess.run(KCACHE + list(args) + ["--json"], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def workload(root: Path, base_env: dict) -> dict:
    env = {**base_env, **envfile.read(root / "kcache.env")}
    out = subprocess.run([sys.executable, "-m", "kcache.torch.workload", *TINY, "--json"], env=env,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A cold compile in A (laid out by a missing restore), published from A."""
    base = tmp_path_factory.mktemp("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_", "KCACHE_"))}
    env.update(KCACHE_HOME=str(base / "home"), TMPDIR=str(base / "outer-tmp"))
    (base / "outer-tmp").mkdir()
    first = kcache("restore", "--into", str(base / "A"), "--model", "tiny", env=env)
    assert first["status"] == "miss"
    cold = workload(base / "A", env)
    pub = kcache("publish", "--from", str(base / "A"), "--model", "tiny", env=env)
    return base, env, cold, pub


def test_cold_run_compiled(published):
    _base, _env, cold, pub = published
    assert cold["fxgraph_miss"] >= 1 and cold["compiled_artifacts"] > 0
    assert pub["files"] > 0 and pub["new_blobs"] > 0


def test_restore_elsewhere_hits_and_compiles_nothing(published):
    base, env, cold, _pub = published
    restored = kcache("restore", "--into", str(base / "B"), "--model", "tiny", env=env)
    assert restored["status"] == "hit"
    layers = set(restored["layers"])
    assert {"inductor", "inductor-pch"} <= layers
    warm = workload(base / "B", env)
    assert warm["cache_dir"] == str(base / "B" / "inductor")
    assert warm["fxgraph_hit"] >= 1 and warm["fxgraph_miss"] == 0
    assert warm["aotautograd_hit"] >= 1 and warm["aotautograd_miss"] == 0
    assert warm["compiled_artifacts"] == 0, "a restored pod rebuilt C++ kernels or the precompiled header"
    assert warm["output_checksum"] == cold["output_checksum"]


def test_other_isa_gets_no_bundle(published):
    base, env, _cold, _pub = published
    # An ISA no machine reports: "avx2" was this machine's own on an AVX2-only host, and hit.
    restored = kcache("restore", "--into", str(base / "C"), "--model", "tiny", "--fact", "cpu.isa=other-isa", env=env)
    assert restored["status"] == "miss"
    assert not any((base / "C" / "inductor").iterdir())


def test_restore_never_imports_torch(published):
    base, env, _cold, _pub = published
    code = (
        "import sys\nfrom kcache.cli import main\n"
        f"try:\n    main(['restore', '--into', {str(base / 'D')!r}, '--model', 'tiny'])\n"
        "except SystemExit:\n    pass\n"
        "print('TORCH' if any(m.split('.')[0] in ('torch', 'triton') for m in sys.modules) else 'CLEAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "hit" in out.stdout and out.stdout.strip().endswith("CLEAN")


def counting_compiler(bin_dir: Path, log: Path) -> dict:
    """A `g++` first on PATH that logs each call and runs the real one by the same name: torch keys on
    the name and on `g++ -v`, whose COLLECT_GCC line repeats the name the compiler was started by."""
    bin_dir.mkdir()
    wrapper = bin_dir / "g++"
    path = os.environ["PATH"]
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {str(log)!r}\nPATH={path!r} exec g++ "$@"\n')
    wrapper.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{path}"}


def preprocessings(log: Path) -> list[str]:
    """Logged calls that only preprocess: torch's precompiled-header lookup."""
    calls = log.read_text().splitlines() if log.exists() else []
    return [call for call in calls if " -E " in f" {call} "]


def compiles(log: Path) -> list[str]:
    """Logged calls that build something: not the version queries, not the header's preprocessing (-E)."""
    calls = log.read_text().splitlines() if log.exists() else []
    return [call for call in calls if " -o " in f" {call} " and " -E " not in f" {call} "]


def test_restored_process_answers_isa_probes_without_children_or_compiles(published):
    base, env, cold, _pub = published
    assert cold["subprocesses"]["python"] > 0, "torch 2.13 probes each vector ISA in a child interpreter"
    assert kcache("restore", "--into", str(base / "E"), "--model", "tiny", env=env)["status"] == "hit"
    log = base / "gxx-E.log"
    warm = workload(base / "E", {**env, **counting_compiler(base / "bin-E", log)})
    assert warm["restored_probes"] is True
    assert warm["subprocesses"]["python"] == 0, "an ISA probe started an interpreter in a restored pod"
    assert log.exists() and compiles(log) == [], "a restored pod ran the compiler to build something"
    # The precompiled header is named from the file the cold run recorded: no g++ -E, no openssl.
    assert warm["remembered_headers"] is True and preprocessings(log) == [] and warm["subprocesses"]["other"] == 0
    assert warm["fxgraph_hit"] >= 1 and warm["fxgraph_miss"] == 0 and warm["compiled_artifacts"] == 0
    assert warm["output_checksum"] == cold["output_checksum"]


def test_probes_outside_a_restored_root_run_as_torch_does(published):
    base, env, cold, _pub = published
    log = base / "gxx-A.log"
    # Warm in place: A was laid out by a miss, nothing vouches for its files.
    again = workload(base / "A", {**env, **counting_compiler(base / "bin-A", log)})
    assert again["restored_probes"] is False
    assert preprocessings(log), "outside a restored root torch must find its precompiled header itself"
    assert again["subprocesses"]["python"] == cold["subprocesses"]["python"]
    assert again["fxgraph_hit"] >= 1 and again["output_checksum"] == cold["output_checksum"]
