"""The node cache tier end to end: real restore processes, a real S3 server, GETs counted on the wire.

restore x8 ──► CuttingProxy (counts pack GETs, cuts nothing) ──► moto's S3 server
    └─ --node-cache DIR (one node: one directory)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
from click.testing import CliRunner
from cutting_proxy import CuttingProxy
from trees import read_tree, write_tree
from unprivileged import run_kcache

from kcache import filelock, publish
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.store import open_store

KiB = 1024
MODEL = "node-cache-model"
RESTORES = 8


class PackGets:
    """Counts GETs per pack as the proxy sees them (its `cut_if`, which never asks for a cut)."""

    def __init__(self):
        self.by_pack: Counter[str] = Counter()
        self.manifests = 0

    def __call__(self, head: bytes) -> bool:
        line = head.split(b"\r\n", 1)[0].decode()
        if line.startswith("GET "):
            path = line.split()[1].split("?")[0]
            if "/packs/" in path:
                self.by_pack[path.rsplit("/", 1)[-1]] += 1
            elif "/manifests/" in path:
                self.manifests += 1
        return False


def cli(*args, ok=True):
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output + result.stderr
    return result


@pytest.fixture
def bundle(tmp_path, s3_bucket, monkeypatch):
    """A bundle of several small packs in S3 (packs of ~256 KiB instead of 32 MiB keep it quick)."""
    url, endpoint = s3_bucket
    monkeypatch.setattr(publish, "TARGET_PACK_BYTES", 256 * KiB)
    files = {f"inductor/fx/{i:02d}": os.urandom(200 * KiB) for i in range(5)}
    files["triton/k/kernel.cubin"] = os.urandom(150 * KiB)
    write_tree(tmp_path / "src", files)
    cli("publish", "--from", tmp_path / "src", "--model", MODEL, "--store", url, "--s3-endpoint-url", endpoint,
        "--index", f"sqlite:///{tmp_path / 'pub.db'}")  # fmt: skip
    packs = sorted(info.key.rsplit("/", 1)[-1] for info in open_store(url, endpoint_url=endpoint).list("packs/"))
    assert len(packs) >= 4
    return url, endpoint, packs, files


def restore_args(url, proxy, root, node):
    return ["restore", "--into", root, "--model", MODEL, "--store", url, "--s3-endpoint-url", proxy.url,
            "--index", "none", "--node-cache", node, "--strict", "--json"]  # fmt: skip


def prefetch_args(url, endpoint, node, *extra):
    return ["prefetch", "--node-cache", node, "--model", MODEL, "--store", url, "--s3-endpoint-url", endpoint,
            "--index", "none", "--json", *extra]  # fmt: skip


def assert_restored(root, files):
    tree = {f"{layer}/{path}": content for layer in ("inductor", "triton")
            for path, (content, _mode) in read_tree(root / layer).items()}  # fmt: skip
    assert tree == files


def test_eight_concurrent_restores_read_each_pack_from_the_store_once(tmp_path, bundle):
    url, endpoint, packs, files = bundle
    node = tmp_path / "node"
    gets = PackGets()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    # Hold every pack's node lock until all eight have read the manifest: they then race for the
    # packs at once, which is what many pods scheduled onto one node do.
    held = []
    for pack in packs:
        (node / "packs" / pack[:2]).mkdir(parents=True, exist_ok=True)
        held.append(filelock.acquire(node / "packs" / pack[:2] / f".lock-{pack}", filelock.EXCLUSIVE, None))
    with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
        procs = [subprocess.Popen([sys.executable, "-m", "kcache", *map(str, restore_args(url, proxy, tmp_path /
                                   f"root{i}", node))], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for i in range(RESTORES)]  # fmt: skip
        try:
            wait_for(lambda: gets.manifests >= RESTORES or any(p.poll() is not None for p in procs), 120)
        finally:
            for lock in held:
                lock.release()
        outputs = [p.communicate(timeout=120) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err.decode()
        assert json.loads(out)["status"] == "hit"
    assert gets.by_pack == Counter({pack: 1 for pack in packs}), "each pack once from the store, for all eight"
    for pack in packs:  # and the node now holds every pack, verified, for the next pod
        assert hashlib.sha256((node / "packs" / pack[:2] / pack).read_bytes()).hexdigest() == pack
    for i in range(RESTORES):
        assert_restored(tmp_path / f"root{i}", files)


def test_after_a_prefetch_restores_get_no_pack_from_the_store(tmp_path, bundle):
    url, endpoint, packs, files = bundle
    node = tmp_path / "node"
    first = json.loads(cli(*prefetch_args(url, endpoint, node, "--once")).stdout)
    (target,) = first["targets"]
    assert (target["status"], target["packs"], target["fetched"]) == ("cached", len(packs), len(packs))
    assert first["node_cache"]["packs"] == len(packs)
    again = json.loads(cli(*prefetch_args(url, endpoint, node, "--once")).stdout)
    assert again["targets"][0]["fetched"] == 0  # already there and verified
    gets = PackGets()
    with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
        for i in range(2):
            result = cli(*restore_args(url, proxy, tmp_path / f"root{i}", node))
            assert json.loads(result.stdout)["status"] == "hit"
    assert sum(gets.by_pack.values()) == 0
    assert_restored(tmp_path / "root1", files)


def test_a_corrupt_node_cache_file_is_detected_refetched_and_replaced(tmp_path, bundle):
    url, endpoint, packs, files = bundle
    node = tmp_path / "node"
    victim = prefetch_and_damage(url, endpoint, node, packs[0])
    gets = PackGets()
    with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
        result = cli(*restore_args(url, proxy, tmp_path / "root", node))
    assert json.loads(result.stdout)["status"] == "hit"
    assert gets.by_pack == Counter({packs[0]: 1})  # only the damaged one, once
    assert hashlib.sha256(victim.read_bytes()).hexdigest() == packs[0]
    assert_restored(tmp_path / "root", files)


def test_prefetch_of_an_unpublished_model_is_a_miss_not_a_failure(tmp_path, s3_bucket):
    url, endpoint = s3_bucket
    result = cli("prefetch", "--node-cache", tmp_path / "node", "--model", "nobody-published-this", "--store", url,
                 "--s3-endpoint-url", endpoint, "--index", "none", "--once", "--json")  # fmt: skip
    (target,) = json.loads(result.stdout)["targets"]
    assert target["status"] == "miss" and "no bundle" in target["reason"]


def test_prefetch_by_bundle_key_and_text_output(tmp_path, bundle):
    url, endpoint, packs, _ = bundle
    key = json.loads(cli("fingerprint", "--model", MODEL, "--json").stdout)["bundle_key"]
    result = cli("prefetch", "--node-cache", tmp_path / "node", "--bundle-key", key, "--store", url,
                 "--s3-endpoint-url", endpoint, "--index", "none", "--once")  # fmt: skip
    assert f"{len(packs)} packs" in result.stdout and f"{len(packs)} fetched" in result.stdout


@pytest.mark.parametrize("args, why", [
    (["--model", "a", "--model", "b", "--model-config", "{config}"], "give a single --model"),
    ([], "at least one --model or --bundle-key"),
])  # fmt: skip
def test_prefetch_refuses_targets_it_cannot_fingerprint(tmp_path, args, why):
    (tmp_path / "config.json").write_text("{}")
    args = [a.format(config=tmp_path / "config.json") for a in args]
    result = cli("prefetch", "--node-cache", tmp_path / "node", *args, "--once", ok=False)
    assert result.exit_code == 2 and why in result.stderr


@pytest.mark.parametrize("flags", [["--extra", "tp=2"], ["--fact", "model.id=pinned"]])
def test_prefetch_of_several_models_warns_about_a_misspelt_fact_once_and_keys_each_as_fingerprint(tmp_path, flags,
                                                                                                   caplog):
    """Each --model was fingerprinted from scratch: the machine probed again, and a --fact naming no
    fact warned once a model, the same line three times for three models."""
    models = ["a", "b", "c"]
    common = ["--fact", "gpu.smm=sm_90", *flags]
    with caplog.at_level(logging.WARNING, logger="kcache"):
        result = cli("prefetch", "--node-cache", tmp_path / "node", *[f for m in models for f in ("--model", m)],
                     *common, "--store", tmp_path / "store", "--index", "none", "--once", "--json")  # fmt: skip
    warned = [r for r in caplog.records if "--fact gpu.smm names no fact" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    keys = [json.loads(cli("fingerprint", "--model", m, *common, "--json").stdout)["bundle_key"] for m in models]
    assert [t["bundle_key"] for t in json.loads(result.stdout)["targets"]] == keys


def test_prefetch_refuses_a_blank_model_among_several(tmp_path):
    result = cli("prefetch", "--node-cache", tmp_path / "node", "--model", "a", "--model", " ", "--once", ok=False)
    assert result.exit_code == 2 and "--model" in result.stderr and "blank" in result.stderr


def test_prefetch_once_that_fails_a_target_prints_the_error_object_json_promises(tmp_path, bundle):
    """--json promises one object, for an error too, with status, error, hint and exit_code (as every
    other command prints it): prefetch --once that exits 7 for a target over the cap printed its round
    report with no error, hint or exit_code, and a script reading them failed on a KeyError."""
    url, endpoint, _packs, _files = bundle
    result = cli(*prefetch_args(url, endpoint, tmp_path / "node", "--once", "--max-bytes", "1Ki"), ok=False)
    doc = json.loads(result.stdout)
    assert result.exit_code == doc["exit_code"] == ExitCode.ROOT, result.output
    assert doc["status"] == "error" and doc["targets"][0]["status"] == "over_cap"
    assert MODEL in doc["error"] and "cap" in doc["error"] and "--max-bytes" in doc["hint"]


def test_prefetch_loops_every_interval_follows_new_bundles_and_stops_on_sigterm(tmp_path, bundle, monkeypatch):
    url, endpoint, packs, files = bundle
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, "-m", "kcache", *map(str, prefetch_args(url, endpoint, tmp_path / "node", "--every",
                                                                   "1s"))]  # fmt: skip
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        first = json.loads(read_line(proc, 120))["targets"][0]
        assert first["fetched"] == len(packs)
        write_tree(tmp_path / "src", {"inductor/fx/new": os.urandom(100 * KiB)})  # a pod published more
        cli("publish", "--from", tmp_path / "src", "--model", MODEL, "--store", url, "--s3-endpoint-url", endpoint,
            "--index", f"sqlite:///{tmp_path / 'pub.db'}")  # fmt: skip
        newer = next(t for line in iter(lambda: read_line(proc, 120), None)
                     if (t := json.loads(line)["targets"][0])["bundle_id"] != first["bundle_id"])  # fmt: skip
        assert newer["fetched"] == 1 and newer["packs"] == len(packs) + 1
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line the process prints, failing the test if none comes within `timeout`."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output from kcache prefetch"
    line = proc.stdout.readline()
    assert line, proc.stderr.read().decode()
    return line.decode()


def wait_for(condition, timeout: float) -> None:
    """Return once `condition()` holds; fail the test after `timeout` seconds."""
    done = threading.Event()
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        done.wait(0.02)


def test_a_prefetch_loop_outlives_a_failing_round_and_once_reports_it(tmp_path):
    unreachable = ["--index", "postgresql+psycopg://root@127.0.0.1:1/kcache"]  # nothing listens on port 1
    base = ["prefetch", "--node-cache", tmp_path / "node", "--model", MODEL, "--store", tmp_path / "store", "--json"]
    once = cli(*base, *unreachable, "--once", ok=False)
    assert once.exit_code == ExitCode.INDEX and json.loads(once.stdout)["status"] == "error"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, "-m", "kcache", *map(str, base), *unreachable, "--every", "1s"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for _ in range(2):  # two rounds, both failed, and still running
            assert json.loads(read_line(proc, 120))["status"] == "error"
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err.decode()


def _read_only(tree):
    """Every directory 0555 and file 0444 under `tree`: what a pod's `readOnly: true` mount shows."""
    for dirpath, _dirs, names in os.walk(tree):
        for name in names:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def restore_in_child(args):
    """`kcache restore` in a process that file modes bind, as a pod's non-root user is bound."""
    proc = run_kcache(args)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout), proc.stderr.decode()


@pytest.mark.parametrize("missing", [0, 1])
def test_a_read_only_node_cache_serves_its_packs_and_the_store_the_rest(tmp_path, bundle, missing):
    """Pods may mount the prefetch DaemonSet's directory read-only (then no pod can plant anything
    there): every pack it holds is read from it, one it lacks from the store, and nothing is written."""
    url, endpoint, packs, files = bundle
    node = tmp_path / "node"
    cli(*prefetch_args(url, endpoint, node, "--once"))
    for pack in packs[:missing]:
        (node / "packs" / pack[:2] / pack).unlink()
    before = {path: content for path, (content, _mode) in read_tree(node).items()}
    _read_only(node)
    gets = PackGets()
    try:
        with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
            result, err = restore_in_child(restore_args(url, proxy, tmp_path / "root", node))
    finally:
        for dirpath, _dirs, _names in os.walk(node):
            os.chmod(dirpath, 0o755)
    assert result["status"] == "hit"
    assert gets.by_pack == Counter({pack: 1 for pack in packs[:missing]})
    assert {path: content for path, (content, _mode) in read_tree(node).items()} == before  # nothing written
    assert ("Permission denied" in err) == bool(missing)  # only the fill it may not make is reported
    assert ("Permission denied" in err) == bool(missing)  # only the fill it may not make is reported
    assert_restored(tmp_path / "root", files)


@pytest.mark.parametrize("mode, from_node", [(0o700, False), (0o311, True)], ids=["private", "search-only"])
def test_a_node_cache_the_pod_may_not_read_restores_from_the_store(tmp_path, bundle, mode, from_node):
    """The prefetch DaemonSet made DIR as root, 0700 (or one the pod may search but not list); a pod
    running as another user is given --node-cache DIR. The node cache can only cost time: the pod is
    restored from the store (or the packs it may still open), not started cold by a usage error."""
    url, endpoint, packs, files = bundle
    node = tmp_path / "node"
    cli(*prefetch_args(url, endpoint, node, "--once"))
    os.chmod(node, mode)
    os.chown(node, 4242, 4242)
    os.chmod(tmp_path, 0o777)  # the unprivileged restore creates ROOT here
    gets = PackGets()
    with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
        result, err = restore_in_child(restore_args(url, proxy, tmp_path / "root", node))
    assert result["status"] == "hit", err
    assert sorted(gets.by_pack) == ([] if from_node else packs)
    assert_restored(tmp_path / "root", files)


@pytest.mark.parametrize("given", ["node", "node/packs"])
def test_a_node_cache_below_a_directory_the_pod_may_not_search_restores_from_the_store(tmp_path, bundle, given):
    """--node-cache names a path below a directory private to another user (a hostPath the DaemonSet
    keeps 0700): even whether DIR exists cannot be known. The restore is a hit from the store, not a
    cold start blamed on ROOT ("cannot write")."""
    url, endpoint, packs, files = bundle
    private = tmp_path / "private"
    cli(*prefetch_args(url, endpoint, private / "node", "--once"))
    os.chmod(private, 0o700)
    os.chown(private, 4242, 4242)
    os.chmod(tmp_path, 0o777)  # the unprivileged restore creates ROOT here
    gets = PackGets()
    with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
        result, err = restore_in_child(restore_args(url, proxy, tmp_path / "root", private / given))
    assert result["status"] == "hit", err
    assert sorted(gets.by_pack) == packs
    assert "node cache" in err
    assert_restored(tmp_path / "root", files)


def test_a_node_cache_on_a_read_only_mount_serves_its_packs(tmp_path, bundle):
    """`readOnly: true` on the pod's hostPath mount: EROFS, not EACCES, whoever the pod runs as."""
    url, endpoint, packs, files = bundle
    node, view = tmp_path / "node", tmp_path / "view"
    cli(*prefetch_args(url, endpoint, node, "--once"))
    view.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", node, view], capture_output=True).returncode:
        pytest.skip("needs root allowed to bind-mount")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", view], check=True, capture_output=True)
        gets = PackGets()
        with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
            result = json.loads(cli(*restore_args(url, proxy, tmp_path / "root", view)).stdout)
    finally:
        subprocess.run(["umount", view], check=True)
    assert result["status"] == "hit"
    assert sum(gets.by_pack.values()) == 0
    assert_restored(tmp_path / "root", files)


@pytest.mark.parametrize("mount", ["writable", "read-only"])
def test_a_fifo_at_a_packs_lock_path_costs_a_reader_that_may_not_write_it_no_wait(tmp_path, bundle, mount):
    """A reader that may not open a lock file for writing (another user's file, a read-only mount)
    opened it for reading without O_NONBLOCK: a FIFO planted there blocked it until a writer came, and
    the pod waited out its --timeout and started cold. It is now replaced where the reader may, else
    that pack comes from the store."""
    if os.geteuid() != 0:
        pytest.skip("plants a FIFO owned by another user: needs root")
    url, endpoint, packs, files = bundle
    node = tmp_path / "node"
    cli(*prefetch_args(url, endpoint, node, "--once"))
    planted = node / "packs" / packs[0][:2] / f".lock-{packs[0]}"
    planted.unlink()
    os.mkfifo(planted, 0o644)
    os.chown(planted, 65532, 65532)  # readable, not writable, by the restoring pod's user
    if mount == "read-only":
        _read_only(node)
    gets = PackGets()
    try:
        with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
            result, _err = restore_in_child([*restore_args(url, proxy, tmp_path / "root", node), "--timeout", "10"])
    finally:
        for dirpath, _dirs, _names in os.walk(node):
            os.chmod(dirpath, 0o755)
    assert result["status"] == "hit"
    assert gets.by_pack == (Counter({packs[0]: 1}) if mount == "read-only" else Counter())
    if mount == "writable":
        assert planted.is_file(), "the FIFO is replaced by a lock file"
    assert_restored(tmp_path / "root", files)


def test_a_corrupt_node_cache_file_is_warned_about_once_per_restore(tmp_path, bundle, caplog):
    """The reader's look and the fill's second look under the exclusive lock both find the damaged
    copy: an operator is told about it once."""
    url, endpoint, packs, files = bundle
    node = tmp_path / "node"
    victim = prefetch_and_damage(url, endpoint, node, packs[0])
    with caplog.at_level(logging.WARNING, logger="kcache"), CuttingProxy(endpoint, after=0, cuts=0) as proxy:
        result = cli(*restore_args(url, proxy, tmp_path / "root", node))
    assert json.loads(result.stdout)["status"] == "hit"
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and "hash to its id" in r.getMessage()]  # fmt: skip
    assert len(warnings) == 1, warnings
    assert str(victim) in warnings[0]
    assert_restored(tmp_path / "root", files)


def prefetch_and_damage(url: str, endpoint: str, node, pack: str):
    """Prefetch the bundle into `node`, then flip one bit in the middle of `pack`'s copy there."""
    cli(*prefetch_args(url, endpoint, node, "--once"))
    victim = node / "packs" / pack[:2] / pack
    damaged = bytearray(victim.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40
    victim.write_bytes(bytes(damaged))
    return victim


def test_a_node_cache_on_a_full_disk_costs_no_pack_a_second_get(tmp_path, bundle, tmpfs):
    """A full node disk (the hostPath's volume filled by something else): every fill downloaded its pack,
    failed writing it (ENOSPC) and the restore read the pack from the store again, so each pod on the
    node fetched every pack twice, and a restore that fit its budget without the node cache could not."""
    url, endpoint, packs, files = bundle
    node = tmpfs(tmp_path / "node", "64k")  # smaller than any pack
    gets = PackGets()
    with CuttingProxy(endpoint, after=0, cuts=0, cut_if=gets) as proxy:
        result = json.loads(cli(*restore_args(url, proxy, tmp_path / "root", node)).stdout)
    prefetched = cli(*prefetch_args(url, endpoint, node, "--once"), ok=False)
    assert result["status"] == "hit"
    assert gets.by_pack == Counter(packs)  # each pack from the store once
    assert prefetched.exit_code == ExitCode.ROOT, prefetched.output
    assert "bytes free, too few for pack" in json.loads(prefetched.stdout)["targets"][0]["reason"]
    assert_restored(tmp_path / "root", files)
