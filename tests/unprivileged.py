"""`kcache` in a child process that file modes bind, as a pod's non-root user is bound, though this
suite's CI runs as root."""

from __future__ import annotations

import os
import subprocess
import sys


def without_root_powers() -> None:
    """For a child run as root: drop the capabilities that ignore file modes (CAP_DAC_OVERRIDE,
    CAP_DAC_READ_SEARCH, CAP_FOWNER) from its bounding set before it execs."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def run_kcache(args, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python -m kcache ARGS`, bound by file modes; its output captured."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, "-m", "kcache", *map(str, args)], env=env, capture_output=True,
                          timeout=timeout, preexec_fn=without_root_powers if os.geteuid() == 0 else None)  # fmt: skip
