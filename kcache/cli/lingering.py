"""Threads a command leaves running, and how long the process waits for them once the command ended.

Python's exit joins every thread that is not a daemon, before it runs the atexit hooks: a request
still under way on a warmup's thread pool (up to --request-timeout), or a thread the user's
entrypoint started and never ends (a server loop, a prefetcher), held `kcache warmup` for that
long, or for ever, after its report and marker were written. A command that runs such threads says
so (`bound`); `settle`, called by `kcache.cli.run` once the command returned, gives them the grace,
then runs the atexit hooks itself (the user's too) and ends the process with the command's exit code.
Only the process's own entry settles: a caller of `main` (tests, an embedding program) keeps its threads.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

_bound: tuple[frozenset[threading.Thread], float] | None = None


def bound(before: Iterable[threading.Thread], grace: float) -> None:
    """At the process's end, wait at most `grace` seconds for the threads started since `before`
    (threading.enumerate() then) that are no daemons. Called again, the last grace holds."""
    global _bound
    _bound = (frozenset(before), grace)


def left_running(before: frozenset[threading.Thread]) -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t not in before and not t.daemon and t is not threading.main_thread() and t.is_alive()]  # fmt: skip


def settle(code: int | str | None) -> None:
    """Return once the threads `bound` named ended within their grace; else end the process here,
    with `code` (SystemExit's), after the atexit hooks."""
    if _bound is None:
        return
    before, grace = _bound
    deadline = time.monotonic() + grace
    for thread in left_running(before):
        thread.join(max(0.0, deadline - time.monotonic()))
    left = left_running(before)
    if not left:
        return
    log.warning("%d thread(s) still running %g s after the command ended (%s); exiting without them",
                len(left), grace, ", ".join(sorted({t.name for t in left}))[:200])  # fmt: skip
    atexit._run_exitfuncs()  # the hooks Python's exit would have run after joining them (logging's too)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or its reader gone: nothing more to say
            pass
    os._exit(code if isinstance(code, int) else 0 if code is None else 1)
