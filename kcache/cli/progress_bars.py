"""Progress bars for long commands (publish, restore, verify, prefetch), drawn on stderr with rich.

A bar appears only when stderr is a terminal: an init container's log, a pipe or `--json`
output gets nothing extra. rich is imported only then, so restore's start-up does not pay for
it. The library reports through kcache.progress; this module turns its updates into one line
per phase:

    restoring  ━━━━━━━━━━━━━╸━━━━━━━━━━  612.4/1073.7 MB 41/64 files  475.0 MiB/s  1 s left
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kcache.cli import format as fmt
from kcache.progress import Report, Update


def wanted(as_json: bool = False) -> bool:
    """Bars only for a person at a terminal, never mixed into machine output, and only where the
    `progress` extra (rich) is installed: the init image leaves it out, its stderr is no terminal."""
    return not as_json and sys.stderr.isatty() and importlib.util.find_spec("rich") is not None


@contextmanager
def bars(enabled: bool) -> Iterator[Report | None]:
    """A `report` callback that draws, or None (draw nothing) when not `enabled`."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    # Rate and time left are the mean since the phase began: rich's own columns need several
    # samples, and a phase that finishes within one refresh would show only '?'.
    progress = Progress(
        TextColumn("{task.description:<10}"),
        BarColumn(),
        DownloadColumn(),
        TextColumn("{task.fields[files]}  {task.fields[rate]}  {task.fields[left]}"),
        console=Console(file=sys.stderr),
    )
    tasks: dict[str, tuple[int, float]] = {}
    lock = threading.Lock()

    def report(update: Update) -> None:
        with lock:  # updates come from worker threads; each phase gets one bar
            if update.task not in tasks:
                task = progress.add_task(update.task, total=update.bytes_total or None, files="", rate="", left="")
                tasks[update.task] = (task, time.monotonic())
            task, started = tasks[update.task]
        progress.update(task, completed=update.bytes, total=update.bytes_total or None,
                        **_fields(update, time.monotonic() - started))  # fmt: skip

    with progress:
        yield report


def _fields(update: Update, elapsed: float) -> dict[str, str]:
    rate = update.bytes / elapsed if elapsed > 0 else 0.0
    left = "done" if update.done else "left ?"
    if rate > 0 and not update.done:
        left = f"{(update.bytes_total - update.bytes) / rate:.0f} s left"
    done = f"{update.files}/{update.files_total} {update.unit}"
    return {"files": done, "rate": f"{fmt.size(int(rate))}/s", "left": left}
