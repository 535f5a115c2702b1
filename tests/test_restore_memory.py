"""Restore's memory stays bounded whatever the bundle holds: a file that compresses to almost
nothing is streamed to disk, never decompressed whole in memory.

The bound is measured on a real `kcache restore` child process (its peak RSS), so it covers
everything restore does, not one function.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from click.testing import CliRunner

from kcache.cli import main

MiB = 1024 * 1024
ZEROS = 300 * MiB  # zstd turns this into a few KiB: one small range read, one huge blob
PEAK_RSS_LIMIT = 150 * MiB  # measured 33 MiB; 329 MiB when the file was decompressed in memory
RESTORE_RSS_BOUND = 256 * MiB  # the bound restore keeps for any bundle (issue 11)


# The restore runs under a small launcher that reports its only child's peak RSS: a child forked
# straight from pytest would count pytest's own pages, which it shares until it execs.
LAUNCHER = (
    "import resource, subprocess, sys\n"
    "code = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(code)\n"
)


def restore_peak_rss(*args: str) -> tuple[int, int, str]:
    """Run `kcache restore` as a child; (exit code, peak RSS in bytes, stderr)."""
    proc = subprocess.run([sys.executable, "-c", LAUNCHER, sys.executable, "-m", "kcache", "restore", *args],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    return proc.returncode, int(proc.stdout.split()[-1]) * 1024, proc.stderr  # ru_maxrss is in KiB on Linux


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MiB):
            digest.update(chunk)
    return digest.hexdigest()


def test_a_huge_compressible_file_is_restored_in_bounded_memory(tmp_path):
    src = tmp_path / "src"
    big = src / "vllm/torch_compile_cache/h/rank_0_0/zeros.bin"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        f.truncate(ZEROS)  # sparse: reads as zeros without taking the disk
    store = f"file://{tmp_path / 'store'}"
    published = CliRunner().invoke(main, ["publish", "--from", str(src), "--model", "m", "--store", store],
                                   catch_exceptions=False)  # fmt: skip
    assert published.exit_code == 0, published.output
    assert sum(p.stat().st_size for p in (tmp_path / "store/packs").rglob("*") if p.is_file()) < MiB

    dest = tmp_path / "dest"
    code, peak, stderr = restore_peak_rss("--into", str(dest), "--model", "m", "--store", store, "--index", "none",
                                          "--strict")  # fmt: skip
    assert code == 0, stderr
    restored = dest / "vllm/torch_compile_cache/h/rank_0_0/zeros.bin"
    assert restored.stat().st_size == ZEROS
    assert sha256_file(restored) == sha256_file(big)
    assert peak < PEAK_RSS_LIMIT, f"restore peaked at {peak / MiB:.0f} MiB"


def test_a_large_random_file_fetched_in_parallel_parts_stays_within_the_restore_bound(tmp_path):
    """96 MiB that do not compress: six parts on sixteen threads, each holding at most a MiB or two."""
    src = tmp_path / "src"
    big = src / "vllm/torch_compile_cache/h/rank_0_0/weights.bin"
    big.parent.mkdir(parents=True)
    with open(big, "wb") as f:
        for _ in range(12):
            f.write(os.urandom(8 * MiB))
    store = f"file://{tmp_path / 'store'}"
    published = CliRunner().invoke(main, ["publish", "--from", str(src), "--model", "m", "--store", store],
                                   catch_exceptions=False)  # fmt: skip
    assert published.exit_code == 0, published.output
    dest = tmp_path / "dest"
    code, peak, stderr = restore_peak_rss("--into", str(dest), "--model", "m", "--store", store, "--index", "none",
                                          "--strict", "--jobs", "16")  # fmt: skip
    assert code == 0, stderr
    assert sha256_file(dest / "vllm/torch_compile_cache/h/rank_0_0/weights.bin") == sha256_file(big)
    assert peak < RESTORE_RSS_BOUND, f"restore peaked at {peak / MiB:.0f} MiB"
