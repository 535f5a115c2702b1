"""Restore and publish under real faults: damaged range reads, dead and hanging S3 endpoints,
SIGKILL mid-restore and mid-publish, a full disk.

Every fault is injected for real (a wrapping store, a TCP server, a signal, a tmpfs). Where a test
must wait for a child process it waits on something that cannot move on by itself (a FIFO the
child blocks on, a SQLite write lock the test holds) and only then looks at the filesystem.
"""

from __future__ import annotations

import errno
import fcntl
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from faulty import corrupting, raising, truncating
from hanging_server import S3FaultProxy, SilentServer
from sqlalchemy import text
from trees import read_tree, write_tree

from kcache import sources
from kcache.cli import main
from kcache.errors import IntegrityError, KcacheError, StoreError
from kcache.publish import publish
from kcache.restore import STAGING_PREFIX, read_state, restore
from kcache.store.local import LocalStore

MODEL = "fault-model"
RESTORE_CMD = importlib.import_module("kcache.cli.restore_cmd")  # the CLI loads commands lazily
TIMEOUT = 2  # --timeout given to restore where the endpoint misbehaves
MARGIN = 10  # botocore timeouts and process start-up on top of it
OLD = {"inductor/old": b"previous"}


def cli(*args, ok: bool = True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output + result.stderr
    return result


def kcache_child(*args, env: dict | None = None, **popen) -> subprocess.Popen:
    """A real `python -m kcache` process, as the init container runs it."""
    return subprocess.Popen(
        [sys.executable, "-m", "kcache", *[str(a) for a in args]],
        env={**os.environ, **(env or {})},
        text=True,
        **{"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen},
    )


def finish(proc: subprocess.Popen, limit: float) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds); fails the test if the child outlives `limit`."""
    started = time.monotonic()
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"kcache was still running after {limit} s; stderr: {err[-1500:]}")
    return proc.returncode, out, err, time.monotonic() - started


def wait_until(condition, proc: subprocess.Popen, what: str, limit: float = 20.0) -> None:
    """Observe the filesystem until `condition()` holds. The child is parked on something only the
    test releases, so the state cannot pass by; the loop is bounded and fails if the child died."""
    deadline = time.monotonic() + limit
    while not condition():
        if proc.poll() is not None:
            pytest.fail(f"child exited ({proc.returncode}) before {what}: {proc.stderr.read()[-1500:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no {what} after {limit} s")
        time.sleep(0.002)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("kcache: restore failed")]


def assert_started_cold(root: Path, stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert len(error_lines(stderr)) == 1, stderr
    assert (root / "kcache.env").is_file()
    assert read_state(root)["status"] == "error"


# ---- damaged range reads, through a wrapping store ----------------------------------------------

FAULTS = {
    "bit-flip": (corrupting, IntegrityError, 6),
    "truncated": (truncating, IntegrityError, 6),
    "store-error-mid-stream": (lambda s: raising(s, lambda: StoreError(s.url, "connection reset (injected)")),
                               StoreError, 4),
    # file:// on NFS: a read() that fails with EIO halfway through a pack.
    "io-error-mid-stream": (lambda s: raising(s, lambda: OSError(errno.EIO, "Input/output error")), StoreError, 4),
}  # fmt: skip
FAULT_PARAMS = list(FAULTS)


def _assert_untouched(root: Path) -> None:
    assert read_tree(root / "inductor") == {"old": (b"previous", 0o644)}
    assert not list(root.glob(STAGING_PREFIX + "*"))


@pytest.mark.parametrize("fault", FAULT_PARAMS)
def test_damaged_range_read_is_refused_before_root_changes(tmp_path, store, sqlite_index, fp, fault):
    wrap, expected, _code = FAULTS[fault]
    files = {f"inductor/k/{i}": os.urandom(3000) for i in range(20)}
    write_tree(tmp_path / "src", files)
    publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    root = tmp_path / "dst"
    write_tree(root, OLD)
    damaged = wrap(store)
    with pytest.raises(expected):
        restore(damaged, sqlite_index, fp, root, jobs=4)
    assert damaged.reads >= 1
    _assert_untouched(root)
    assert read_state(root)["status"] == "error"
    assert restore(store, sqlite_index, fp, root).status == "hit"  # the undamaged store still works


@pytest.mark.parametrize("fault", FAULT_PARAMS)
def test_damaged_range_read_fails_open_through_the_cli(tmp_path, monkeypatch, fault):
    wrap, _expected, code = FAULTS[fault]
    write_tree(tmp_path / "src", {f"inductor/k/{i}": os.urandom(2000) for i in range(10)})
    cli("publish", "--from", tmp_path / "src", "--model", MODEL)
    real_open = RESTORE_CMD.open_store
    monkeypatch.setattr(RESTORE_CMD, "open_store", lambda *a, **k: wrap(real_open(*a, **k)))
    root = tmp_path / "dst"
    write_tree(root, OLD)
    result = cli("restore", "--into", root, "--model", MODEL)
    assert_started_cold(root, result.stderr)
    _assert_untouched(root)
    strict = cli("restore", "--into", root, "--model", MODEL, "--strict", ok=False)
    assert strict.exit_code == code and "failing (--strict)" in strict.stderr
    _assert_untouched(root)


# ---- S3 endpoints that refuse, hang, stall or cut -----------------------------------------------

TUNED = {"KCACHE_S3_CONNECT_TIMEOUT": "1", "KCACHE_S3_READ_TIMEOUT": "1", "KCACHE_S3_MAX_ATTEMPTS": "1"}
AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def restore_child(root: Path, endpoint: str, store_url: str = "s3://bucket/cache", env: dict | None = None):
    proc = kcache_child("restore", "--into", root, "--model", MODEL, "--timeout", TIMEOUT, "--store", store_url,
                        "--s3-endpoint-url", endpoint, "--index", "none", env={**AWS, **(env or {})})  # fmt: skip
    return finish(proc, TIMEOUT + MARGIN)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("env", [TUNED, {}], ids=["tuned", "defaults"])
def test_refused_connection_starts_cold_within_the_timeout(tmp_path, env):
    root = tmp_path / "dst"
    code, _out, err, seconds = restore_child(root, f"http://127.0.0.1:{free_port()}", env=env)
    assert code == 0 and seconds < TIMEOUT + MARGIN, err[-1500:]
    assert_started_cold(root, err)


@pytest.mark.parametrize("env", [TUNED, {}], ids=["tuned", "defaults"])
def test_silent_endpoint_starts_cold_within_the_timeout(tmp_path, env):
    root = tmp_path / "dst"
    with SilentServer() as server:
        code, _out, err, seconds = restore_child(root, server.url, env=env)
        assert server.accepted.is_set()  # the request really went to the hanging endpoint
    assert code == 0 and seconds < TIMEOUT + MARGIN, err[-1500:]
    assert_started_cold(root, err)
    assert "timed out" in err or "did not finish" in err


@pytest.fixture
def s3_published(tmp_path, s3_bucket):
    """A bundle for MODEL in a moto bucket; returns (store URL, moto endpoint)."""
    url, endpoint = s3_bucket
    write_tree(tmp_path / "src", {f"inductor/k/{i}": os.urandom(5000) for i in range(8)})
    cli("publish", "--from", tmp_path / "src", "--model", MODEL, "--store", url, "--s3-endpoint-url", endpoint,
        "--index", f"sqlite:///{tmp_path / 'pub.db'}")  # fmt: skip
    return url, endpoint


def test_pack_read_that_hangs_starts_cold_within_the_timeout(tmp_path, s3_published):
    url, endpoint = s3_published
    root = tmp_path / "dst"
    write_tree(root, OLD)
    with S3FaultProxy(endpoint, "stall-headers") as proxy:
        code, out, err, seconds = restore_child(root, proxy.url, url)  # botocore defaults: 60 s read timeout
        assert proxy.pack_requests.is_set()
    assert code == 0 and seconds < TIMEOUT + MARGIN, err[-1500:]
    assert_started_cold(root, err)
    _assert_untouched(root)


@pytest.mark.parametrize("mode", ["cut", "stall-body"])
def test_pack_body_cut_or_stalled_mid_stream_fails_open(tmp_path, s3_published, mode):
    url, endpoint = s3_published
    root = tmp_path / "dst"
    write_tree(root, OLD)
    with S3FaultProxy(endpoint, mode) as proxy:
        code, out, err, seconds = restore_child(root, proxy.url, url, env=TUNED)  # read timeout 1 s
        assert proxy.pack_requests.is_set()
    assert code == 0 and seconds < TIMEOUT + MARGIN, err[-1500:]
    assert_started_cold(root, err)
    _assert_untouched(root)
    assert "store" in error_lines(err)[0]


# ---- SIGKILL in the middle ------------------------------------------------------------------------


def home_store(home: Path) -> LocalStore:
    return LocalStore(home / "store")


def pack_keys(store: LocalStore) -> set[str]:
    return {o.key for o in store.list("packs/")}


def test_sigkill_mid_restore_leaves_old_content_and_rerun_cleans_up(tmp_path, isolated_home):
    v1 = {"inductor/a": b"old a" * 100, "inductor/keep": b"kept" * 100}
    write_tree(tmp_path / "v1", v1)
    cli("publish", "--from", tmp_path / "v1", "--model", MODEL)
    root = tmp_path / "dst"
    cli("restore", "--into", root, "--model", MODEL)
    before = read_tree(root / "inductor")
    store = home_store(isolated_home)
    old_packs = pack_keys(store)

    v2 = {**v1, "inductor/a": b"new a" * 100, "triton/k/kernel.cubin": os.urandom(4000)}
    v2.update({f"inductor/many/{i}": os.urandom(1000) for i in range(50)})
    write_tree(tmp_path / "v2", v2)
    cli("publish", "--from", tmp_path / "v2", "--model", MODEL)
    (new_pack,) = pack_keys(store) - old_packs
    # A peer node-cache reader holds the new pack's fill lock: the child waits on it, while
    # "inductor/keep" (in the old pack) is staged. A deterministic point mid-restore.
    held = hold_fill_lock(tmp_path / "node-cache", new_pack)
    child = kcache_child("restore", "--into", root, "--model", MODEL, "--node-cache", tmp_path / "node-cache")
    try:

        def keep_staged() -> bool:
            return any((s / "files/inductor/keep").is_file() for s in root.glob(STAGING_PREFIX + "*"))

        wait_until(keep_staged, child, "staged file")
        child.send_signal(signal.SIGKILL)
        child.communicate()
    finally:
        if child.poll() is None:
            child.kill()
        release(held)
    assert child.returncode == -signal.SIGKILL
    assert read_tree(root / "inductor") == before  # the old bundle, whole
    (stale,) = root.glob(STAGING_PREFIX + "*")
    assert stale.name.startswith(f"{STAGING_PREFIX}{child.pid}-")

    rerun = cli("restore", "--into", root, "--model", MODEL, "--json")
    assert json.loads(rerun.output)["status"] == "hit"
    assert read_tree(root / "inductor") == read_tree(tmp_path / "v2/inductor")  # the new bundle, whole
    assert not list(root.glob(STAGING_PREFIX + "*"))


def hold_fill_lock(node_cache: Path, pack: str):
    """Hold a node cache's lock on `pack` (packs/<hh>/<id>) as a peer filling it would: a restore
    through that node cache waits on it (up to half its budget) before it reads that pack."""
    pack_id = pack.rsplit("/", 1)[-1]
    path = node_cache / "packs" / pack_id[:2] / f".lock-{pack_id}"
    path.parent.mkdir(parents=True, exist_ok=True)
    held = open(path, "a")
    fcntl.flock(held, fcntl.LOCK_EX)
    return held


def parked_restore(tmp_path: Path, isolated_home: Path):
    """Publish v1, then v2; start a restore of v2 through a node cache whose lock on v2's new pack
    a peer holds, so it parks while holding ROOT. Returns (child, root, the held lock, v1 bundle id,
    v1 tree); the caller releases."""
    v1 = {"inductor/a": b"old a" * 100, "inductor/keep": b"kept" * 100}
    write_tree(tmp_path / "v1", v1)
    first = json.loads(cli("publish", "--from", tmp_path / "v1", "--model", MODEL, "--json").output)
    store = home_store(isolated_home)
    old_packs = pack_keys(store)
    write_tree(tmp_path / "v2", {**v1, "inductor/a": b"new a" * 100, "inductor/b": os.urandom(4000)})
    cli("publish", "--from", tmp_path / "v2", "--model", MODEL)
    (new_pack,) = pack_keys(store) - old_packs
    held = hold_fill_lock(tmp_path / "node-cache", new_pack)
    root = tmp_path / "dst"
    child = kcache_child("restore", "--into", root, "--model", MODEL, "--json", "--node-cache", tmp_path / "node-cache")

    def keep_staged() -> bool:
        return any((s / "files/inductor/keep").is_file() for s in root.glob(STAGING_PREFIX + "*"))

    wait_until(keep_staged, child, "staged file")
    return child, root, held, first["bundle_id"], read_tree(tmp_path / "v1/inductor")


def release(held) -> None:
    """Let the parked restore go on: it reads the pack and finishes."""
    fcntl.flock(held, fcntl.LOCK_UN)
    held.close()


def test_concurrent_restores_into_one_root_take_turns(tmp_path, isolated_home):
    first, root, held, v1_id, v1_tree = parked_restore(tmp_path, isolated_home)
    try:
        (staging,) = root.glob(STAGING_PREFIX + "*")
        # A second restore with a short budget gives up on ROOT, fails open, and touches nothing.
        code, _out, err, _s = finish(kcache_child("restore", "--into", root, "--model", MODEL, "--bundle", v1_id,
                                                  "--timeout", "1"), 60)  # fmt: skip
        assert code == 0 and "another restore into" in err, err
        assert staging.is_dir() and read_state(root) is None
        # One with time to spare waits for the first, then lays out its own bundle.
        second = kcache_child("restore", "--into", root, "--model", MODEL, "--bundle", v1_id, "--json",
                              stderr=open(tmp_path / "second.err", "w"))  # fmt: skip
        wait_until(lambda: "waiting for it" in (tmp_path / "second.err").read_text(), second, "second waiting")
        assert staging.is_dir()  # the waiting restore did not take the first one's staging away
        release(held)
        first_out, _ = first.communicate(timeout=60)
        second_out, _ = second.communicate(timeout=60)
    finally:
        for child in (first, locals().get("second")):
            if child is not None and child.poll() is None:
                child.kill()
                child.wait()
    assert json.loads(first_out)["status"] == "hit"  # the peer let go: it read the pack and laid out v2 first
    assert json.loads(second_out)["status"] == "hit"
    state = read_state(root)  # the marker names the bundle that is laid out
    assert state["status"] == "hit" and state["bundle_id"] == v1_id
    assert read_tree(root / "inductor") == v1_tree
    assert not list(root.glob(STAGING_PREFIX + "*"))


def test_sigkill_mid_publish_leaves_no_bundle_without_blobs(tmp_path, isolated_home, pg_index):
    index = ("--index", pg_index.url)
    write_tree(tmp_path / "v1", {"inductor/a": b"one" * 100})
    cli("publish", "--from", tmp_path / "v1", "--model", MODEL, *index)
    store = home_store(isolated_home)
    old_packs = pack_keys(store)
    write_tree(tmp_path / "v2", {"inductor/a": b"two" * 100, "inductor/b": os.urandom(5000)})

    # Lock the packs table against writes: the child takes its publish lease and uploads its pack,
    # then waits to record it (step 2), so it cannot reach the bundle row (step 4) before it is killed.
    lock = pg_index.engine.connect()
    lock.execute(text("BEGIN"))
    lock.execute(text("LOCK TABLE packs IN EXCLUSIVE MODE"))
    child = kcache_child("publish", "--from", tmp_path / "v2", "--model", MODEL, *index)
    try:
        wait_until(lambda: pack_keys(store) - old_packs, child, "uploaded pack")
        child.send_signal(signal.SIGKILL)
        child.communicate()
    finally:
        if child.poll() is None:
            child.kill()
        lock.rollback()
        lock.close()
    assert child.returncode == -signal.SIGKILL

    bundles = pg_index.list_bundles()
    assert len(bundles) == 1
    for bundle in bundles:  # every committed bundle still restores in full
        out = cli("restore", "--into", tmp_path / f"check-{bundle.id[:8]}", "--model", MODEL, "--bundle", bundle.id,
                  "--strict", "--json", *index)  # fmt: skip
        assert json.loads(out.output)["status"] == "hit"
    via_refs = cli("restore", "--into", tmp_path / "refs", "--model", MODEL, "--index", "none", "--strict")
    assert via_refs.exit_code == 0 and (tmp_path / "refs/inductor/a").read_bytes() == b"one" * 100

    # Its lease lapses unrenewed (a minute); a rerun that finds it held waits no longer than --peer-wait.
    again = json.loads(cli("publish", "--from", tmp_path / "v2", "--model", MODEL, "--json", "--peer-wait", "0",
                           *index).output)  # fmt: skip
    assert again["files"] == 2
    cli("restore", "--into", tmp_path / "dst", "--model", MODEL, "--strict", *index)
    assert read_tree(tmp_path / "dst/inductor") == read_tree(tmp_path / "v2/inductor")


# ---- a full disk ------------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path, tmpfs):
    """A 2 MiB tmpfs; skipped where this process may not mount one."""
    return tmpfs(tmp_path / "small")


@pytest.fixture
def big_bundle(tmp_path, store, sqlite_index, fp):
    """4.5 MiB of incompressible files: more than the small disk holds."""
    write_tree(tmp_path / "src", {f"inductor/big/{i}": os.urandom(1536 * 1024) for i in range(3)})
    return publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})


def test_disk_full_cleans_staging_and_keeps_old_content(small_disk, big_bundle, store, sqlite_index, fp):
    root = small_disk / "root"
    write_tree(root, OLD)
    with pytest.raises((KcacheError, OSError)):
        restore(store, sqlite_index, fp, root)
    _assert_untouched(root)
    assert os.statvfs(small_disk).f_bfree > 0.9 * os.statvfs(small_disk).f_blocks  # the space came back


def test_disk_full_is_a_clear_error_and_fails_open(small_disk, big_bundle, store, sqlite_index, fp, monkeypatch):
    root = small_disk / "root"
    with pytest.raises(KcacheError, match="space"):
        restore(store, sqlite_index, fp, root)
    assert read_state(root)["status"] == "error"
    monkeypatch.setattr(RESTORE_CMD, "compute_fingerprint", lambda *a: fp)
    args = ("--store", f"file://{store.root}", "--index", sqlite_index.url)
    result = cli("restore", "--into", root, *args)
    assert_started_cold(root, result.stderr)
    assert not list(root.glob(STAGING_PREFIX + "*"))


# ---- a file size limit (RLIMIT_FSIZE) -----------------------------------------------------------------


def test_a_file_size_limit_fails_open_with_its_own_reason(tmp_path, isolated_home):
    """A process over RLIMIT_FSIZE gets SIGXFSZ, whose default action kills it (Python ignores it, so
    writes fail with EFBIG instead): the restore must end as any full disk does, cold, with a reason
    an operator can act on, the old layers kept, and the next restore without the limit a hit."""
    import resource

    write_tree(tmp_path / "src", {"inductor/big": os.urandom(1024 * 1024), "inductor/small": b"k"})
    cli("publish", "--from", tmp_path / "src", "--model", MODEL)
    root = tmp_path / "dst"
    write_tree(root, OLD)

    def limited() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    child = kcache_child("restore", "--into", root, "--model", MODEL, "--timeout", 60, preexec_fn=limited)
    code, _out, err, _s = finish(child, 120)
    assert code == 0, err
    assert_started_cold(root, err)
    assert "file size limit" in read_state(root)["reason"], read_state(root)
    _assert_untouched(root)
    rerun = json.loads(cli("restore", "--into", root, "--model", MODEL, "--json").output)
    assert rerun["status"] == "hit" and (root / "inductor/small").read_bytes() == b"k"
