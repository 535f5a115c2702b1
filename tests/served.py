"""Run a `kcache` command that serves HTTP in a child process, and find the port it bound."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def kcache_server(*args: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """Yields (process, port); the command must be given --port 0. Killed on exit if still alive."""
    proc = subprocess.Popen([sys.executable, "-m", "kcache", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        line = proc.stdout.readline()  # blocks until the server has bound its port
        bound = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if bound is None:  # it said something else, or exited: show why instead of a TypeError
            proc.kill()
            out, err = proc.communicate()
            raise AssertionError(f"kcache {' '.join(args)} did not start (exit {proc.returncode}): "
                                 f"{line}{out}{err}")  # fmt: skip
        proc.start_line = line  # for commands that name more than one port in it
        yield proc, int(bound[1])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
