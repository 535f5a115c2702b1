"""file:// specifics the conformance suite cannot state for S3: what the local file system refuses
becomes a StoreError, and a refused write leaves no temporary file behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from outcome import outcome_within

from kcache.errors import StoreError
from kcache.store.local import LocalStore


@pytest.fixture
def blocked(tmp_path) -> LocalStore:
    """A store whose refs/ and packs/ are files: every write below them fails in the file system."""
    store = LocalStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    (tmp_path / "store/refs").write_bytes(b"")
    (tmp_path / "store/packs").write_bytes(b"")
    return store


def test_compare_and_swap_the_file_system_refuses_is_a_store_error(blocked):
    with pytest.raises(StoreError, match="refs/k"):
        blocked.put_if("refs/k", b"{}", None)


def test_a_write_the_file_system_refuses_is_a_store_error(blocked, tmp_path):
    with pytest.raises(StoreError, match="packs/aa/x"):
        blocked.put_bytes("packs/aa/x", b"data")
    src = tmp_path / "src"
    src.write_bytes(b"data")
    with pytest.raises(StoreError):
        blocked.put_file("packs/aa/y", src)


def test_a_ref_the_file_system_cannot_read_is_a_store_error(tmp_path):
    store = LocalStore(tmp_path / "store")
    (tmp_path / "store/refs/k").mkdir(parents=True)  # a directory where the ref should be
    with pytest.raises(StoreError, match="refs/k"):
        store.get_versioned("refs/k")
    with pytest.raises(StoreError, match="refs/k"):
        store.put_if("refs/k", b"two", None)
    assert [p.name for p in (tmp_path / "store/refs").iterdir() if p.name.startswith(".tmp-")] == []


def test_a_store_that_may_not_create_its_root_refuses_a_missing_one(tmp_path):
    with pytest.raises(StoreError, match="does not exist"):
        LocalStore(tmp_path / "nostore", create=False)
    assert not (tmp_path / "nostore").exists()


def test_a_store_that_may_not_create_its_root_still_writes_below_it(tmp_path):
    (tmp_path / "store").mkdir()
    store = LocalStore(tmp_path / "store", create=False)
    assert store.put_bytes("packs/aa/x", b"data") is True
    (tmp_path / "store/packs/aa/x").unlink()
    (tmp_path / "store/packs/aa").rmdir()
    (tmp_path / "store/packs").rmdir()
    (tmp_path / "store").rmdir()  # gone after it was opened: the write must not bring it back
    with pytest.raises(StoreError, match="does not exist"):
        store.put_bytes("packs/aa/x", b"data")
    with pytest.raises(StoreError, match="does not exist"):
        store.put_if("refs/k", b"{}", None)
    assert not (tmp_path / "store").exists()


def test_a_publisher_creates_the_root(tmp_path):
    store = LocalStore(tmp_path / "new" / "store")
    assert store.put_bytes("packs/aa/x", b"data") is True and (tmp_path / "new/store/packs/aa/x").is_file()


@pytest.mark.parametrize("planted", ["fifo", "device", "directory"])
def test_what_is_not_a_regular_file_at_a_key_is_a_store_error_never_read(tmp_path, planted):
    """Whoever writes the store's directory can put a FIFO there: reading it would block every
    command for good (restore for its whole budget)."""
    import os

    from kcache.errors import StoreError

    store = LocalStore(tmp_path / "s")
    store.put_bytes("refs/k", b"x")
    path = store.root / "refs" / "k"
    path.unlink()
    if planted == "fifo":
        os.mkfifo(path)
    elif planted == "device":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    for read in (lambda: store.get_bytes("refs/k"), lambda: store.get_versioned("refs/k"),
                 lambda: store.open_range("refs/k", 0, 10).read(), lambda: store.size("refs/k")):  # fmt: skip
        with pytest.raises(StoreError, match="regular file"):
            read()
    assert not store.exists("refs/k")
    assert [o.key for o in store.list("refs/")] == []


def test_listing_skips_what_no_key_can_name_and_what_is_no_regular_file(tmp_path):

    store = LocalStore(tmp_path / "s")
    store.put_bytes("packs/ab/good", b"x")
    shard = store.root / "packs" / "ab"
    (shard / "loop").symlink_to("loop")  # ELOOP on stat
    (shard / "x y").write_bytes(b"no key has a space")
    (shard / "far").write_bytes(b"year 10000")
    listed = {o.key: o for o in store.list("packs/")}
    assert set(listed) == {"packs/ab/good", "packs/ab/far"}


def test_a_time_no_datetime_holds_lists_as_the_latest(tmp_path):
    import os
    import tempfile

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # tmpfs keeps times ext4 clamps to 2446
    store = LocalStore(Path(tempfile.mkdtemp(dir=shm)) / "s")
    store.put_bytes("manifests/ab/far", b"year 10000")
    far = store.root / "manifests" / "ab" / "far"
    try:
        os.utime(far, (253402300800, 253402300800))
    except OverflowError:
        pytest.skip("this system cannot set the year 10000")
    if far.stat().st_mtime < 253402300800:
        pytest.skip("this file system clamps the year 10000")
    try:
        assert [o.modified.year for o in store.list("manifests/")] == [9999]  # never "old enough" for gc
    finally:
        import shutil

        shutil.rmtree(store.root.parent)


@pytest.mark.parametrize("planted", ["fifo", "directory", "dangling-link"])
def test_what_is_not_a_lock_file_beside_a_ref_does_not_stop_its_writers(tmp_path, planted):
    """Whoever writes the store's directory can put a FIFO where a ref's compare-and-swap lock goes:
    opening it to lock waited for a reader, and every publish, yank and gc of that key hung there for
    good (a directory failed each of them)."""
    import os

    store = LocalStore(tmp_path / "s")
    store.put_bytes("refs/k", b"one")
    lock = store.root / "refs" / ".lock-k"
    if planted == "fifo":
        os.mkfifo(lock)
    elif planted == "directory":
        lock.mkdir()
    else:
        lock.symlink_to(tmp_path / "elsewhere")
    version = store.get_versioned("refs/k")[1]
    assert outcome_within(lambda: store.put_if("refs/k", b"two", version)) is True
    assert store.get_bytes("refs/k") == b"two" and not (tmp_path / "elsewhere").exists()


def test_a_ref_lock_held_for_good_fails_its_writer_instead_of_hanging(tmp_path, monkeypatch):
    """A writer frozen while it held a ref's lock (a stopped container, a hung mount) kept every other
    writer of that ref waiting for ever; past the lock's wait the write is a StoreError."""
    import subprocess
    import sys

    from kcache.store import local

    store = LocalStore(tmp_path / "s")
    store.put_bytes("refs/k", b"one")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys\n"
                               f"f = open({str(store.root / 'refs/.lock-k')!r}, 'a')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\nsys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "locked\n"
        monkeypatch.setattr(local, "REF_LOCK_WAIT", 0.5)
        failed = outcome_within(lambda: store.put_if("refs/k", b"two", store.get_versioned("refs/k")[1]))
        assert isinstance(failed, StoreError) and "refs/k" in str(failed)
    finally:
        holder.stdin.close()
        holder.wait()
    assert store.get_bytes("refs/k") == b"one"
