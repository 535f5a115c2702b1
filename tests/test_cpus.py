"""CPUs a container may use (affinity and quota) and the restore read count taken from them."""

import os

import pytest

from kcache import cpus


def affinity() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # v2, no limit
        ({"cpu.max": "150000 100000\n"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu.max": "garbage\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no limit
        ({"cpu/cpu.cfs_quota_us": "100000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1),
        ({"cpu/cpu.cfs_quota_us": "300000\n"}, None),  # no period: unreadable, so no limit
        ({}, None),
    ],
)
def test_usable_cpus_follow_the_quota(tmp_path, files, limit):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    expected = affinity() if limit is None else min(affinity(), limit)
    assert cpus.usable(tmp_path) == expected


def test_a_quota_above_the_affinity_changes_nothing(tmp_path):
    (tmp_path / "cpu.max").write_text(f"{(affinity() + 8) * 100000} 100000\n")
    assert cpus.usable(tmp_path) == affinity()


@pytest.mark.parametrize(("n", "jobs"), [(1, 4), (2, 4), (3, 6), (8, 16), (64, 16)])
def test_read_jobs_are_two_per_cpu_within_bounds(n, jobs):
    assert cpus.read_jobs(n) == jobs
