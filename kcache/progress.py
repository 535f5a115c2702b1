"""Progress of long work (publish, restore, verify, prefetch): counted by the library, drawn by the CLI.

The library never draws. A long operation takes an optional `report` callback and hands it
`Update`s through a `Meter`, which many worker threads may advance at once. The CLI decides
what to do with them (kcache.cli.progress draws a bar only when stderr is a terminal); with no
callback a Meter costs a lock and an addition per step, so restore's hot path stays as it was.

    meter = Meter("fetching", files=len(entries), bytes=total, report=report)
    ... meter.add(files=1, bytes=entry.size)   # from any thread
    meter.close()                              # a last update with done=True
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# Updates closer together than this are folded into the next one: 20k small files would
# otherwise cost 20k calls into the drawing library.
MIN_INTERVAL = 0.05


@dataclass(frozen=True)
class Update:
    """How far one phase of an operation has come (raw units: files and bytes)."""

    task: str  # the phase, e.g. "hashing", "uploading", "fetching", "reading"
    files: int
    files_total: int
    bytes: int
    bytes_total: int
    done: bool = False
    unit: str = "files"  # what `files` counts: prefetch counts packs


Report = Callable[[Update], None]


class Meter:
    """Counts files and bytes done from any thread; reports to `report` at most every MIN_INTERVAL."""

    def __init__(self, task: str, *, files: int, bytes: int, report: Report | None = None, unit: str = "files"):
        self.task, self.files_total, self.bytes_total, self.unit = task, files, bytes, unit
        self._report = report
        self._lock = threading.Lock()
        self._files = self._bytes = 0
        self._last = 0.0
        if report is not None:
            report(self._update(False))

    def add(self, files: int = 0, bytes: int = 0) -> None:
        with self._lock:
            self._files += files
            self._bytes += bytes
            if self._report is None:
                return
            now = time.monotonic()
            if now - self._last < MIN_INTERVAL:
                return
            self._last = now
            # Under the lock: the callback sees counts that only grow, one update at a time.
            self._report(self._update(False))

    def close(self) -> None:
        """The final update (done=True): the drawing side may finish its bar."""
        if self._report is not None:
            with self._lock:
                self._report(self._update(True))

    @property
    def counts(self) -> tuple[int, int]:
        with self._lock:
            return self._files, self._bytes

    def _update(self, done: bool) -> Update:
        return Update(self.task, self._files, self.files_total, self._bytes, self.bytes_total, done, self.unit)

    def __enter__(self) -> Meter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
