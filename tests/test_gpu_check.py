"""scripts/gpu_check runs anywhere: without a GPU it prints one JSON object saying it skipped, exit 0."""

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check"


def gpu_check(*args: str, path: str | None = None) -> tuple[int, dict]:
    env = {**os.environ, "PYTHON": sys.executable}
    if path is not None:
        env["PATH"] = path
    proc = subprocess.run([str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout + proc.stderr  # one JSON object, nothing else on stdout
    return proc.returncode, json.loads(lines[0])


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_without_a_driver_it_skips(tmp_path):
    code, result = gpu_check("--wheels", str(tmp_path))  # kcache's deps are installed: nothing to fetch
    assert code == 0 and result["status"] == "skipped" and "nvidia-smi" in result["reason"]


def test_with_a_driver_but_no_cuda_torch_it_skips(tmp_path):
    pytest.importorskip("torch")
    torch_cuda = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                                capture_output=True, text=True)  # fmt: skip
    if torch_cuda.stdout.strip() == "True":
        pytest.skip("this machine has a usable GPU")
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    code, result = gpu_check(path=f"{fake.parent}:{os.environ['PATH']}")
    assert code == 0 and result["status"] == "skipped", result
    assert "cuda" in result["reason"] or "triton" in result["reason"]


def test_a_missing_wheel_dir_is_an_error():
    proc = subprocess.run([str(SCRIPT), "--wheels", "/nonexistent/wheels"], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert proc.returncode == 2 and "--wheels" in proc.stderr


def test_ptx_kernel_is_deterministic():
    """The ComputeCache key is the PTX text: cold and restored runs must load the very same bytes."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check
    finally:
        sys.path.pop(0)
    ptx = gpu_check.ptx_source(8)
    assert ptx == gpu_check.ptx_source(8) and ptx.endswith(b"\0") and b".entry kcache_check" in ptx
