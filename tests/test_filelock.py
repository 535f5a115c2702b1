"""flock with a deadline, and locks that stay exclusive when their lock file is deleted and made again."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from kcache import filelock


def blocked_on(inode: int) -> bool:
    """True once some process waits (blocked, "->") for a lock on this inode (see proc(5), /proc/locks)."""
    return any("->" in line and f":{inode} " in line for line in Path("/proc/locks").read_text().splitlines())


def test_shared_locks_coexist_and_exclude_an_exclusive_one(tmp_path):
    path = tmp_path / ".lock-x"
    first = filelock.acquire(path, filelock.SHARED, None)
    second = filelock.acquire(path, filelock.SHARED, 0.0)
    assert first and second
    assert filelock.acquire(path, filelock.EXCLUSIVE, time.monotonic() + 0.05) is None  # gives up at the deadline
    first.release()
    second.release()
    with filelock.acquire(path, filelock.EXCLUSIVE, 0.0) as held:
        assert held is not None
        assert filelock.acquire(path, filelock.SHARED, 0.0) is None


def test_a_waiter_on_a_deleted_lock_file_locks_the_new_one(tmp_path):
    if not Path("/proc/locks").exists():
        pytest.skip("needs /proc/locks to see the waiter block")
    path = tmp_path / ".lock-x"
    remover = filelock.acquire(path, filelock.EXCLUSIVE, None)
    old_inode = os.fstat(remover.fd).st_ino
    got: list[filelock.FileLock] = []
    waiter = threading.Thread(target=lambda: got.append(filelock.acquire(path, filelock.EXCLUSIVE, None)))
    waiter.start()
    deadline = time.monotonic() + 30
    while not blocked_on(old_inode):
        assert time.monotonic() < deadline, "the waiter never blocked"
        threading.Event().wait(0.01)
    path.unlink()  # as eviction does: delete the lock file while holding it
    remover.release()
    waiter.join(30)
    (held,) = got
    assert os.fstat(held.fd).st_ino == os.stat(path).st_ino  # (the freed inode number may be reused)
    assert filelock.acquire(path, filelock.EXCLUSIVE, 0.0) is None, "a newcomer must not get the lock too"
    held.release()


def test_a_lock_file_that_is_a_symlink_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    (tmp_path / ".lock-x").symlink_to(target)
    with pytest.raises(OSError):
        filelock.acquire(tmp_path / ".lock-x", filelock.SHARED, 0.0)
    assert not target.exists()


def test_a_fifo_at_the_lock_path_is_refused_without_waiting_for_a_writer(tmp_path):
    """Opened for reading without O_NONBLOCK (a reader that may not write the file), a FIFO blocked
    until some writer came; it is no lock file: ENXIO, for the node cache to replace."""
    path = tmp_path / ".lock-x"
    os.mkfifo(path, 0o644)
    for mode in (filelock.SHARED, filelock.EXCLUSIVE):
        with pytest.raises(OSError) as raised:
            filelock.acquire(path, mode, 0.0)
        assert raised.value.errno == errno.ENXIO
