"""How many CPUs this process may use, and how many reads a restore runs at once because of it.

A container sees the whole node in os.cpu_count(); what it may use is its affinity mask (a
cpuset) and its CPU quota (a Kubernetes CPU limit: cgroup v2 cpu.max, v1 cpu.cfs_quota_us).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
# Reads in flight per usable CPU. Each read decompresses, hashes and writes what it receives, all
# CPU work: past about two per CPU, threads only trade the GIL and the scheduler's time between
# them (1 GiB of big blobs on 2 CPUs: 1.9-2.1 s on 4 threads, 2.2-2.7 s on 16, with 0.8 against
# 1.0-1.9 s of system time), while two per CPU still keep every CPU busy when reads wait on the network.
READS_PER_CPU = 2
MIN_READS, MAX_READS = 4, 16


def usable(cgroup: Path = CGROUP) -> int:
    """CPUs this process may run on, no more than its quota allows (rounded up), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _quota(cgroup)
    if quota is not None:
        cpus = min(cpus, math.ceil(quota))
    return max(1, cpus)


def read_jobs(cpus: int | None = None) -> int:
    """Parallel pack reads for restore, verify and reindex when --jobs is not given."""
    cpus = usable() if cpus is None else cpus
    return max(MIN_READS, min(MAX_READS, READS_PER_CPU * cpus))


def _quota(cgroup: Path) -> float | None:
    """The CPU limit in CPUs, or None where there is none (or it cannot be read)."""
    v2 = _read(cgroup / "cpu.max")  # "<quota> <period>" or "max <period>"
    if v2 is not None:
        return _ratio(*(v2.split() + ["", ""])[:2])
    return _ratio(_read(cgroup / "cpu" / "cpu.cfs_quota_us"), _read(cgroup / "cpu" / "cpu.cfs_period_us"))


def _ratio(quota: str | None, period: str | None) -> float | None:
    try:
        q, p = int(quota or ""), int(period or "")
    except ValueError:
        return None  # "max", or unreadable
    return q / p if q > 0 and p > 0 else None  # v1 says -1 for no limit


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
