"""`kcache prefetch` as a DaemonSet runs it: round after round for months, against stores that stall
and a node directory that peers change under it. No round may hang, pile up threads, or end the loop.

    prefetch ──► NodeCacheStore(DIR) ──► S3FaultProxy (trickles or stalls) ──► moto's S3
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hanging_server import S3FaultProxy
from outcome import outcome_within
from test_node_cache import cli
from trees import write_tree
from unprivileged import without_root_powers

from kcache import choice, filelock, publish
from kcache import prefetch as prefetching
from kcache.cli.errors import ExitCode
from kcache.errors import LookupTimeout, StoreError
from kcache.refs import RefCatalog
from kcache.store import nodecache, open_store
from kcache.store.local import LocalStore
from kcache.store.nodecache import NodeCacheStore

KiB = 1024
MODEL = "prefetch-model"


@pytest.fixture
def bundle(tmp_path, s3_bucket, monkeypatch):
    """A bundle of a few small packs in S3; returns (store URL, endpoint, bundle key, pack ids)."""
    url, endpoint = s3_bucket
    monkeypatch.setattr(publish, "TARGET_PACK_BYTES", 64 * KiB)
    write_tree(tmp_path / "src", {f"inductor/fx/{i:02d}": os.urandom(50 * KiB) for i in range(3)})
    cli("publish", "--from", tmp_path / "src", "--model", MODEL, "--store", url, "--s3-endpoint-url", endpoint,
        "--index", f"sqlite:///{tmp_path / 'pub.db'}")  # fmt: skip
    store = open_store(url, endpoint_url=endpoint)
    (key,) = {info.key.rsplit("/", 1)[-1] for info in store.list("refs/") if info.key.count("/") == 1}
    packs = sorted(info.key.rsplit("/", 1)[-1] for info in store.list("packs/"))
    return url, endpoint, key, packs


def threads_named(prefix: str) -> int:
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive())


# ---- a store that trickles bytes: every read answers, the whole never ends ----------------------------


def test_a_round_whose_manifest_trickles_ends_with_that_target_timed_out(tmp_path, bundle):
    """Choosing a target's bundle (ref, manifest) had no deadline: a manifest sent a byte at a time,
    which no socket read timeout catches, kept `prefetch --once` (and a DaemonSet's round) going for ever."""
    url, _endpoint, _key, _packs = bundle
    with S3FaultProxy(bundle[1], "trickle", damaged="/manifests/") as proxy:
        args = ["prefetch", "--node-cache", tmp_path / "node", "--model", MODEL, "--store", url,
                "--s3-endpoint-url", proxy.url, "--index", "none", "--once", "--json", "--lookup-timeout", "1s"]
        result = outcome_within(lambda: cli(*args, ok=False), 60, unstick=proxy.release.set,
                                hung="prefetch waited for a trickling manifest")  # fmt: skip
    doc = json.loads(result.stdout)
    assert result.exit_code == doc["exit_code"] == ExitCode.TIMEOUT, result.output
    (target,) = doc["targets"]
    assert target["status"] == "error" and "1 s" in target["reason"] and "--lookup-timeout" in doc["hint"]


def test_rounds_against_a_trickling_store_keep_one_lookup_thread_per_target(tmp_path, bundle):
    """A look-up that outlived its round ran on; the next round started another beside it, and a
    DaemonSet on a store that trickles gathered one thread (and one connection) a target a round."""
    url, _endpoint, key, _packs = bundle
    with S3FaultProxy(bundle[1], "trickle", damaged="/manifests/") as proxy:
        store = open_store(url, endpoint_url=proxy.url)
        cache = NodeCacheStore(store, tmp_path / "node")
        lookups = prefetching.Lookups()
        before = threads_named("kcache-prefetch-lookup")

        def round_():
            return prefetching.prefetch(store, RefCatalog(store), cache, (prefetching.bundle_key_target(key),),
                                        choice.Policy((), False), lookup_timeout=0.5, lookups=lookups)  # fmt: skip

        outcomes = [outcome_within(round_, 60, unstick=proxy.release.set) for _ in range(3)]
        running = threads_named("kcache-prefetch-lookup") - before
        proxy.release.set()
    assert [o.status for (o,) in outcomes] == ["error"] * 3
    assert all(isinstance(o.error, LookupTimeout) for (o,) in outcomes)
    assert "still running" in outcomes[2][0].reason
    assert running == 1


def test_fills_that_stall_keep_one_download_thread_per_pack(tmp_path, bundle, monkeypatch):
    """A fill past its grace is given up, its download left running until the store lets go; the next
    round's warm of the pack started a second download beside it, and so on every round."""
    url, _endpoint, _key, packs = bundle
    monkeypatch.setattr(nodecache, "FILL_GRACE", 0.5)
    with S3FaultProxy(bundle[1], "stall-body") as proxy:
        cache = NodeCacheStore(open_store(url, endpoint_url=proxy.url), tmp_path / "node")
        before = threads_named("kcache-node-fill")
        errors = [outcome_within(lambda: cache.warm(packs[0], wait=60), 60, unstick=proxy.release.set)
                  for _ in range(3)]  # fmt: skip
        running = threads_named("kcache-node-fill") - before
        proxy.release.set()
    assert all(isinstance(e, StoreError) for e in errors), errors
    assert "still" in str(errors[2])
    assert running == 1


# ---- a node directory that peers change under a round --------------------------------------------------


@pytest.fixture
def local_bundle(tmp_path, monkeypatch):
    """A bundle of a few small packs in a local store; returns (store, bundle key, pack ids)."""
    monkeypatch.setattr(publish, "TARGET_PACK_BYTES", 64 * KiB)
    write_tree(tmp_path / "src", {f"inductor/fx/{i:02d}": os.urandom(50 * KiB) for i in range(3)})
    cli("publish", "--from", tmp_path / "src", "--model", MODEL, "--store", tmp_path / "store",
        "--index", f"sqlite:///{tmp_path / 'pub.db'}")  # fmt: skip
    store = LocalStore(tmp_path / "store")
    (key,) = {info.key.rsplit("/", 1)[-1] for info in store.list("refs/") if info.key.count("/") == 1}
    packs = sorted(info.key.rsplit("/", 1)[-1] for info in store.list("packs/"))
    return store, key, packs


def replace_with_file(path: Path) -> None:
    """What a peer leaves at `path`: its directory set aside, a file in its place."""
    path.rename(path.with_name(f"aside-{path.name}"))
    path.write_bytes(b"x")


def test_a_shard_replaced_under_a_round_is_that_targets_error_not_the_rounds_end(tmp_path, local_bundle):
    """A peer that replaced a shard directory (packs/<hh>) while a round ran made the round's last
    look at the node raise NotADirectoryError: no outcome at all, and the DaemonSet's loop ended."""
    store, key, packs = local_bundle
    node = tmp_path / "node"
    cache = NodeCacheStore(store, node)
    shard = node / "packs" / packs[0][:2]

    def peer(update) -> None:  # the moment the target's packs are all warmed
        if update.done and shard.is_dir():
            replace_with_file(shard)

    (outcome,) = outcome_within(lambda: prefetching.prefetch(
        store, RefCatalog(store), cache, (prefetching.bundle_key_target(key),), choice.Policy((), False),
        report=peer))  # fmt: skip
    assert shard.is_file()
    assert outcome.status == "error" and "left the node cache" in outcome.reason


# ---- the DaemonSet's loop outlives what a round meets ---------------------------------------------------


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line the process prints, failing the test if none comes within `timeout`."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output from kcache prefetch"
    line = proc.stdout.readline()
    assert line, f"kcache prefetch exited {proc.wait()}: {proc.stderr.read().decode()[-1500:]}"
    return line.decode()


def prefetch_loop(store: Path, node: Path) -> subprocess.Popen:
    """`kcache prefetch --every 1s` as a DaemonSet's non-root user runs it (file modes bind it)."""
    args = ["prefetch", "--node-cache", node, "--model", MODEL, "--store", store, "--index", "none", "--json",
            "--every", "1s"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, "-m", "kcache", *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE,
                            preexec_fn=without_root_powers if os.geteuid() == 0 else None)  # fmt: skip


@pytest.mark.parametrize("where", ["DIR", "its-parent"])
def test_a_node_cache_a_peer_made_unsearchable_fails_each_round_not_the_loop(tmp_path, local_bundle, where):
    """A peer that chmods DIR 000 made the round's report (the node cache's usage) raise: the loop,
    which goes on past a failed round but not past its report, ended, and with it the DaemonSet. Above
    DIR, the round's trim raised PermissionError itself, out of the round (exit 70)."""
    node = tmp_path / "host" / "node"
    unsearchable = node if where == "DIR" else node.parent
    proc = prefetch_loop(tmp_path / "store", node)
    try:
        assert json.loads(read_line(proc, 120))["status"] == "ok"
        unsearchable.chmod(0)  # the peer, between two rounds
        rounds = [json.loads(read_line(proc, 120)) for _ in range(2)]
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
        unsearchable.chmod(0o755)
    assert proc.returncode == 0, err.decode()[-1500:]
    assert [r["status"] for r in rounds] == ["error", "error"]
    assert all(r["targets"][0]["status"] == "error" for r in rounds)


def publish_model(tmp_path: Path, store: Path, model: str, files: int) -> list[str]:
    """Publish `files` files of 50 KiB (a pack each, under the fixture's pack size) as `model`; its packs."""
    src = tmp_path / f"src-{model}"
    write_tree(src, {f"inductor/fx/{i:02d}": os.urandom(50 * KiB) for i in range(files)})
    before = set(LocalStore(store).list("packs/")) if store.exists() else set()
    cli("publish", "--from", src, "--model", model, "--store", store, "--index", f"sqlite:///{tmp_path / 'pub.db'}")
    return sorted(info.key.rsplit("/", 1)[-1] for info in set(LocalStore(store).list("packs/")) - before)


def test_a_target_whose_packs_a_peer_holds_costs_the_round_one_wait_not_one_a_pack(tmp_path, monkeypatch):
    """Each pack's warm waited LOCK_WAIT for its lock: a frozen (or hostile) pod holding every lock of one
    target's packs held the round, and every target after it, a wait per pack (100 packs, 4 jobs: 25 waits
    of 300 s, two hours). A target's lock waits now end together, LOCK_WAIT after its warm began."""
    monkeypatch.setattr(publish, "TARGET_PACK_BYTES", 64 * KiB)
    monkeypatch.setattr(prefetching, "LOCK_WAIT", 1.0)
    store, node = tmp_path / "store", tmp_path / "node"
    held_packs, free_packs = publish_model(tmp_path, store, "a", 6), publish_model(tmp_path, store, "b", 2)
    args = ["prefetch", "--node-cache", node, "--model", "a", "--model", "b", "--store", store, "--index", "none",
            "--once", "--json", "--jobs", "1"]  # fmt: skip
    with contextlib.ExitStack() as peer:
        for pack in held_packs:
            lock = node / "packs" / pack[:2] / f".lock-{pack}"
            lock.parent.mkdir(parents=True, exist_ok=True)
            peer.enter_context(filelock.acquire(lock, filelock.EXCLUSIVE, None))
        started = time.monotonic()
        result = outcome_within(lambda: cli(*args, ok=False))
        seconds = time.monotonic() - started
    a, b = json.loads(result.stdout)["targets"]
    assert (a["status"], b["status"], b["fetched"]) == ("error", "cached", len(free_packs)), result.output
    assert seconds < 3 * prefetching.LOCK_WAIT, f"{seconds:.1f} s: a wait a pack"


def test_sigterm_while_a_bundle_look_up_trickles_stops_the_loop_at_once(tmp_path, bundle):
    """The kubelet's SIGTERM set the loop's stop, but a round waited out its look-ups first (--lookup-timeout,
    5 min by default; before it, for ever) and the pod was killed at the end of its grace period."""
    url, endpoint, _key, _packs = bundle
    with S3FaultProxy(endpoint, "trickle", damaged="/manifests/") as proxy:
        args = ["prefetch", "--node-cache", tmp_path / "node", "--model", MODEL, "--store", url,
                "--s3-endpoint-url", proxy.url, "--index", "none", "--json", "--every", "1s"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.Popen([sys.executable, "-m", "kcache", *map(str, args)], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)  # fmt: skip
        try:
            assert proxy.pack_requests.wait(120), "no manifest was asked for"
            proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 0, err.decode()[-1500:]
    (target,) = json.loads(out)["targets"]
    assert target["status"] == "stopped"
