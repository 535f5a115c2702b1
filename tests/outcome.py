"""A call run on a thread of its own, so that a test tells a call that hangs from one that answers."""

import threading
from collections.abc import Callable


def outcome_within(call: Callable[[], object], seconds: float = 60, unstick: Callable[[], None] | None = None,
                   hung: str = "hung") -> object:  # fmt: skip
    """`call()`'s result, or the exception it raised. Still running after `seconds` (generous: a hang
    lasts for ever), it fails the test with `hung`, once `unstick()` (say, opening a FIFO's other end)
    has let the thread go, waiting as long again for it."""
    box: list = []

    def run() -> None:
        try:
            box.append(call())
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    stuck = worker.is_alive()
    if stuck and unstick is not None:
        unstick()
        worker.join(seconds)
    assert not stuck, hung
    return box[0]
