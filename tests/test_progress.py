"""kcache.progress: counts from many threads add up; the callback hears the start, some steps, the end."""

from __future__ import annotations

import threading

from kcache.progress import Meter, Update


def test_counts_from_many_threads_add_up_and_the_last_update_says_done():
    updates: list[Update] = []
    with Meter("fetching", files=8000, bytes=8000 * 3, report=updates.append) as meter:
        threads = [threading.Thread(target=lambda: [meter.add(files=1, bytes=3) for _ in range(1000)])
                   for _ in range(8)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert meter.counts == (8000, 24000)
    assert updates[0] == Update("fetching", 0, 8000, 0, 24000)
    assert updates[-1] == Update("fetching", 8000, 8000, 24000, 24000, done=True)
    assert len(updates) < 8000  # steps closer together than MIN_INTERVAL are folded
    assert [u.bytes for u in updates] == sorted(u.bytes for u in updates)


def test_without_a_callback_a_meter_only_counts():
    meter = Meter("hashing", files=2, bytes=10)
    meter.add(files=2, bytes=10)
    meter.close()
    assert meter.counts == (2, 10)
