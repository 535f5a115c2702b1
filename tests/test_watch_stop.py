"""`kcache watch` publishing while things go wrong: a store that hangs when the pod is told to stop,
and a cache directory removed from under it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading

import pytest
from hanging_server import SilentServer
from test_watch import RESTORED, Clock, make_ready
from trees import write_tree

from kcache import manifest as manifests
from kcache import metrics, sources
from kcache.publish import publish
from kcache.readiness import WATCH_MARKER, read_marker
from kcache.store import manifest_key
from kcache.store.local import LocalStore
from kcache.watch import Watcher, ready_time


def compiled_after_ready(root, rel="triton/k9/k.cubin"):
    write_tree(root, {rel: b"compiled on the hot path"})
    os.utime(root / rel, (ready_time(root) + 1,) * 2)


def test_a_publish_that_hangs_when_stopped_is_abandoned_after_the_grace(tmp_path):
    make_ready(tmp_path)
    compiled_after_ready(tmp_path)
    stop, entered, release = threading.Event(), threading.Event(), threading.Event()

    def hanging_publisher(layers, **_):  # a store that accepted the connection and went quiet
        entered.set()
        stop.set()  # SIGTERM arrives mid-publish
        release.wait(60)
        raise OSError("the store never answered")

    watcher, finished = Watcher(tmp_path, publisher=hanging_publisher, publish_every=0), []
    runner = threading.Thread(target=lambda: finished.append(watcher.run(stop, 3600, grace=0.1)))
    runner.start()
    try:
        runner.join(30)  # a bound on a broken run, not synchronisation: run returns once the grace is over
    finally:
        release.set()
        runner.join()
    assert entered.is_set() and finished == [False]


def test_a_publish_that_ends_within_the_grace_is_kept(tmp_path, store, sqlite_index, fp):
    make_ready(tmp_path)
    compiled_after_ready(tmp_path)
    stop = threading.Event()
    stop.set()
    published = []

    def publisher(layers, **_):
        published.append(publish(store, sqlite_index, fp, layers, root=tmp_path))
        return published[-1]

    assert Watcher(tmp_path, publisher=publisher, publish_every=3600).run(stop, 3600, grace=60) is True
    assert len(published) == 1 and read_marker(tmp_path, WATCH_MARKER)["publishes"] == 1


def test_a_removed_cache_directory_is_not_published_away(tmp_path, store, sqlite_index, fp):
    root = tmp_path / "root"
    make_ready(root)
    first = publish(store, sqlite_index, fp, sources.BUILTIN, root=root)
    clock = Clock()
    published = []

    def publisher(layers):
        published.append(publish(store, sqlite_index, fp, layers, root=root))
        return published[-1]

    watcher = Watcher(root, publisher=publisher, publish_every=10, clock=clock)
    watcher.step()
    compiled_after_ready(root)
    shutil.rmtree(root / "inductor")  # someone cleaned the cache; restore's files for that layer are gone
    clock.now += 11
    step = watcher.step()
    assert step.published is None and published == []
    assert "layer inductor held files when the pod became ready and holds none now" in step.publish_error
    doc = read_marker(root, WATCH_MARKER)
    assert doc["publish_errors"] == 1 and doc["new_files"]["triton"] == 1  # still counted, just not published
    assert "kcache_watch_publish_errors_total 1" in metrics.render(metrics.collect(root))
    # The bundle a restore gets is still one with every layer.
    newest = sqlite_index.newest_bundle(first.bundle_key)
    entries = manifests.parse(store.get_bytes(manifest_key(newest.id)), newest.id).entries
    assert {e.path for e in entries} >= set(RESTORED)


def test_the_layer_back_the_publish_goes_on(tmp_path, store, sqlite_index, fp):
    root = tmp_path / "root"
    make_ready(root)
    publish(store, sqlite_index, fp, sources.BUILTIN, root=root)
    clock = Clock()
    watcher = Watcher(root, publisher=lambda layers: publish(store, sqlite_index, fp, layers, root=root),
                      publish_every=10, clock=clock)  # fmt: skip
    watcher.step()
    compiled_after_ready(root)
    moved = tmp_path / "moved"
    shutil.move(root / "cuda", moved)
    clock.now += 11
    assert watcher.step().publish_error
    shutil.move(moved, root / "cuda")
    clock.now += 11
    result = watcher.step().published
    assert result is not None and result.new_blobs == 1


@pytest.mark.parametrize("as_json", [False, True])
def test_sigterm_while_a_publish_hangs_on_the_store_exits_within_the_stop_timeout(tmp_path, as_json):
    """Under --json the abandoned publish ends in the error object every other failure prints: it had
    printed only its stderr line, so a script reading stdout saw "watching" and then an exit 14."""
    root = tmp_path / "root"
    make_ready(root)
    compiled_after_ready(root)
    with SilentServer() as s3:
        env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3.url}  # fmt: skip
        index = f"sqlite:///{tmp_path / 'index.db'}"
        args = ["watch", "--root", str(root), "--interval", "1s", "--publish-every", "1s", "--stop-timeout", "1s",
                "--store", "s3://bucket/cache", "--index", index, "--model", "m"] + ["--json"] * as_json  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-m", "kcache", *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert s3.accepted.wait(60)  # the publish is under way, waiting on the store
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 14, stderr
    assert "did not finish within 1.00 s (--stop-timeout); abandoned" in stderr
    if as_json:
        docs = [json.loads(line) for line in stdout.splitlines()]
        assert docs[0]["status"] == "watching"
        assert docs[-1]["status"] == "error" and docs[-1]["exit_code"] == 14 and "abandoned" in docs[-1]["error"]


def test_replicas_stopped_together_each_get_their_last_publish_in(tmp_path, index, fp):
    """Pods of one Deployment get SIGTERM together, and another publish of their key holds the lease
    (a pod still uploading). Each waited for the lease up to --peer-wait (10 min), past its
    --stop-timeout, and was abandoned: the kernels it compiled were in no bundle. The last publish
    waits only up to half the stop timeout, then publishes without the lease (its commit is
    conditional on the newest bundle, so none drops another's kernels)."""
    from kcache.index import Index
    from kcache.publish import PublishConfig

    store = LocalStore(tmp_path / "store")
    assert index.take_lease(fp.bundle_key, "a-pod-still-uploading", 600) is None
    pods = [f"pod{n}" for n in range(3)]
    stops, finished, watchers, indexes = [threading.Event() for _ in pods], {}, [], []
    for pod in pods:
        root = tmp_path / pod
        make_ready(root)
        compiled_after_ready(root, f"triton/{pod}/k.cubin")
        pod_index = Index.open(index.url)
        indexes.append(pod_index)

        mine: list[Watcher] = []

        def publisher(layers, root=root, pod_index=pod_index, mine=mine):  # as `kcache watch` publishes
            config = PublishConfig(carry_newest=True, lease_deadline=mine[0].lease_deadline)
            return publish(store, pod_index, fp, layers, root=root, env={}, config=config)

        watcher = Watcher(root, publisher=publisher, publish_every=3600)
        mine.append(watcher)
        watcher.step()  # ready: the baseline taken, the kernel found and not yet due
        watchers.append(watcher)
    threads = [threading.Thread(target=lambda w=w, s=s, p=p: finished.update({p: w.run(s, 3600, grace=6)}))
               for w, s, p in zip(watchers, stops, pods)]  # fmt: skip
    try:
        for thread in threads:
            thread.start()
        for stop in stops:  # SIGTERM to every replica at once
            stop.set()
        for thread in threads:
            thread.join(120)  # a bound on a broken run: run returns once the grace is over
    finally:
        for pod_index in indexes:
            pod_index.close()
    assert finished == {pod: True for pod in pods}
    assert all(not w.final_error for w in watchers), [w.final_error for w in watchers]
    newest = index.newest_bundle(fp.bundle_key)
    paths = {e.path for e in manifests.parse(store.get_bytes(manifest_key(newest.id)), newest.id).entries}
    assert {f"triton/{pod}/k.cubin" for pod in pods} <= paths


def test_a_stop_ends_a_periodic_publishs_wait_for_the_lease_too(tmp_path, index, fp):
    """The stop came while a periodic (or first-step) publish waited for another pod's lease: only
    the last publish's wait was bounded, so this one waited on (up to --peer-wait), the grace ran
    out and the last publish never ran. Every publish of a watcher being stopped waits only up to
    half the grace (kcache watch passes Watcher.lease_deadline to every publish)."""
    from kcache.publish import PublishConfig

    store = LocalStore(tmp_path / "store")
    assert index.take_lease(fp.bundle_key, "a-pod-still-uploading", 600) is None
    root = tmp_path / "pod"
    make_ready(root)
    compiled_after_ready(root)
    stop, started, finished = threading.Event(), threading.Event(), []

    def publisher(layers):  # as `kcache watch` publishes (--peer-wait 600 s)
        started.set()
        config = PublishConfig(carry_newest=True, lease_deadline=watcher.lease_deadline)
        return publish(store, index, fp, layers, root=root, env={}, config=config)

    watcher = Watcher(root, publisher=publisher, publish_every=0)
    thread = threading.Thread(target=lambda: finished.append(watcher.run(stop, 3600, grace=6)))
    thread.start()
    assert started.wait(60)  # the first step publishes the kernel and waits for the lease
    stop.set()  # SIGTERM
    thread.join(120)  # a bound on a broken run: run returns once the grace is over
    assert finished == [True] and not watcher.final_error, watcher.final_error
    newest = index.newest_bundle(fp.bundle_key)
    assert "triton/k9/k.cubin" in {e.path for e in manifests.parse(store.get_bytes(manifest_key(newest.id)),
                                                                    newest.id).entries}  # fmt: skip
