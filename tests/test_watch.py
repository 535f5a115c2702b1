"""`kcache watch`: files compiled after ready are found by layer, counted, and published as a delta."""

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from contextlib import contextmanager

import pytest
from click.testing import CliRunner
from served import kcache_server
from trees import write_tree

from kcache import manifest as manifests
from kcache import metrics, sources
from kcache.cli import main
from kcache.cli.options import Duration
from kcache.errors import StoreError
from kcache.publish import publish
from kcache.readiness import RESTORE_MARKER, WARMUP_MARKER, WATCH_MARKER, read_marker, write_marker
from kcache.store import manifest_key
from kcache.watch import BASELINE_MARKER, Watcher, layers_under, ready_time, scan, snapshot

RESTORED = {"inductor/fxgraph/aa/g1": b"graph", "triton/k1/k.cubin": b"\x7fELF1", "cuda/entry": b"sass"}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def make_ready(root, files=RESTORED):
    write_tree(root, files)
    write_marker(root, RESTORE_MARKER, {"status": "hit", "bundle_key": "k"})
    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
    ready = ready_time(root)
    for rel in files:  # restored and warmed before ready, as on a real pod
        os.utime(root / rel, (ready - 5, ready - 5))


def warmed(root, *, at: float) -> None:
    """The warmup marker, written at `at` (epoch seconds): the pod became ready then."""
    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
    os.utime(root / WARMUP_MARKER, (at, at))


def recording(store, index, fp, root):
    """A publisher of ROOT, and the list of what it published."""
    published = []

    def publisher(layers):
        published.append(publish(store, index, fp, layers, root=root))
        return published[-1]

    return publisher, published


@contextmanager
def watching(*args):
    """`python -m kcache ARGS` with its stdout and stderr piped; killed on the way out if still running."""
    proc = subprocess.Popen([sys.executable, "-m", "kcache", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_scan_finds_new_files_by_layer_and_ignores_junk(tmp_path):
    make_ready(tmp_path)
    layers = layers_under(tmp_path)
    baseline = snapshot(tmp_path, layers, ready_time(tmp_path))
    assert {layer for layer, _ in baseline.files} == {"inductor", "triton", "cuda"}
    write_tree(tmp_path, {
        "inductor/fxgraph/bb/g2": b"new graph",
        "inductor/fxgraph/bb/g2.lock": b"",
        "inductor/locks/x": b"",  # belongs to no layer's content
        "triton/k2/k.cubin.tmp.123": b"partial",
        "triton/k2/__pycache__/m.pyc": b"",
        "kcache.env": b"# not a cache file",
    })  # fmt: skip
    found = scan(tmp_path, baseline, layers)
    assert [(f.layer, f.rel, f.size) for f in found] == [("inductor", "fxgraph/bb/g2", 9)]


def test_files_written_after_ready_but_before_the_baseline_still_count(tmp_path):
    make_ready(tmp_path)
    ready = ready_time(tmp_path)
    write_tree(tmp_path, {"triton/k9/k.cubin": b"hot path"})
    os.utime(tmp_path / "triton/k9/k.cubin", (ready + 3, ready + 3))
    layers = layers_under(tmp_path)
    found = scan(tmp_path, snapshot(tmp_path, layers, ready), layers)
    assert [(f.layer, f.rel) for f in found] == [("triton", "k9/k.cubin")]


def test_a_layer_root_that_is_a_link_is_not_watched(tmp_path):
    make_ready(tmp_path / "root")
    write_tree(tmp_path / "outside", {"ssh_host_key": b"SECRET"})
    (tmp_path / "root/vllm").symlink_to(tmp_path / "outside")
    layers = layers_under(tmp_path / "root")
    everything = scan(tmp_path / "root", snapshot(tmp_path / "root", layers, 0.0), layers)  # an empty baseline
    assert {f.layer for f in everything} == {"inductor", "triton", "cuda"}


def test_extra_layers_are_watched(tmp_path):
    make_ready(tmp_path, {**RESTORED, "extra/trt/timing.cache": b"t"})
    layers = layers_under(tmp_path)
    assert "extra:trt" in [s.name for s in layers]
    baseline = snapshot(tmp_path, layers)
    write_tree(tmp_path, {"extra/trt/more.cache": b"m"})
    assert [(f.layer, f.rel) for f in scan(tmp_path, baseline, layers)] == [("extra:trt", "more.cache")]


def test_waits_for_ready_then_counts_and_survives_a_restart(tmp_path, caplog):
    watcher = Watcher(tmp_path)
    step = watcher.step()
    assert not step.ready and step.reason == "restore has not finished"
    assert read_marker(tmp_path, WATCH_MARKER) is None

    make_ready(tmp_path)
    assert watcher.step().new == ()
    assert (tmp_path / BASELINE_MARKER).exists()
    doc = read_marker(tmp_path, WATCH_MARKER)
    assert doc["baseline_files"] == 3 and doc["new_files"]["inductor"] == 0

    write_tree(tmp_path, {"inductor/fxgraph/cc/g3": b"hot"})
    with caplog.at_level("WARNING", logger="kcache.watch"):
        step = watcher.step()
    assert [(f.layer, f.rel) for f in step.fresh] == [("inductor", "fxgraph/cc/g3")]
    assert "layer inductor file fxgraph/cc/g3" in caplog.text
    doc = read_marker(tmp_path, WATCH_MARKER)
    assert doc["new_files"]["inductor"] == 1 and doc["new_bytes"]["inductor"] == 3
    assert doc["files"] == [["inductor", "fxgraph/cc/g3"]]
    assert watcher.step().fresh == ()  # reported once

    restarted = Watcher(tmp_path).step()  # a restarted sidecar compares with the same moment
    assert [f.rel for f in restarted.new] == ["fxgraph/cc/g3"] and restarted.fresh == ()

    samples = metrics.render(metrics.collect(tmp_path))
    assert 'kcache_jit_files_after_ready{layer="inductor"} 1' in samples


@pytest.mark.parametrize("doc", [
    {"publishes": "many", "publish_errors": None, "files": [["inductor"]], "last_publish": 7},
    {"publishes": 1.5, "files": "fxgraph/aa/g1"},
    {"files": [[1, 2, 3], None, ["inductor", "fxgraph/aa/g1"]], "publishes": 10**400},
], ids=["wrong-types", "wrong-shapes", "mixed"])  # fmt: skip
def test_a_damaged_watch_marker_is_ignored_not_fatal(tmp_path, doc):
    make_ready(tmp_path)
    (tmp_path / WATCH_MARKER).write_text(json.dumps(doc))
    watcher = Watcher(tmp_path)
    assert watcher.step().ready
    written = read_marker(tmp_path, WATCH_MARKER)
    assert isinstance(written["publishes"], int) and isinstance(written["publish_errors"], int)


@pytest.mark.parametrize("files", ["all", [["inductor"]], [None], [[1, {"a": 1}]]])
def test_a_damaged_baseline_is_taken_again(tmp_path, files):
    make_ready(tmp_path)
    Watcher(tmp_path).step()
    (tmp_path / BASELINE_MARKER).write_text(json.dumps({"files": files}))
    write_tree(tmp_path, {"inductor/fxgraph/zz/late": b"after ready"})
    step = Watcher(tmp_path).step()
    assert step.ready and [f.rel for f in step.new] == ["fxgraph/zz/late"]


def test_a_newer_restore_invalidates_a_saved_baseline(tmp_path):
    make_ready(tmp_path)
    Watcher(tmp_path).step()
    baseline_mtime = (tmp_path / BASELINE_MARKER).stat().st_mtime
    os.utime(tmp_path / RESTORE_MARKER, (baseline_mtime + 60, baseline_mtime + 60))  # a later pod's restore
    write_tree(tmp_path, {"inductor/fxgraph/dd/g4": b"restored by the later pod"})
    os.utime(tmp_path / "inductor/fxgraph/dd/g4", (baseline_mtime, baseline_mtime))
    assert Watcher(tmp_path).step().new == ()


@pytest.mark.parametrize("status", ["miss", "hit"])
def test_kernels_this_pod_compiled_before_ready_are_published_at_the_first_step(tmp_path, store, sqlite_index, fp,
                                                                               status):
    """A cold pod compiles everything during warmup, before ready, and vLLM compiles nothing after:
    those kernels are this pod's own, not a restore's, and every later replica needs them. On a hit,
    the shapes warmup compiled that the bundle lacked are the same. Not after --publish-every: the
    replicas starting meanwhile would miss."""
    root = tmp_path / "root"
    restored = {"inductor/fxgraph/aa/g1": b"graph"} if status == "hit" else {}
    root.mkdir()
    write_tree(root, restored)
    write_marker(root, RESTORE_MARKER, {"status": status, "bundle_key": fp.bundle_key})
    restored_at = (root / RESTORE_MARKER).stat().st_mtime
    for rel in restored:
        os.utime(root / rel, (restored_at - 60,) * 2)
    compiled = {"triton/k1/k.cubin": b"warmup kernel", "inductor/fxgraph/bb/g2": b"warmup graph"}
    write_tree(root, compiled)
    for rel in compiled:  # during warmup: after the restore, before ready
        os.utime(root / rel, (restored_at + 5,) * 2)
    warmed(root, at=restored_at + 10)
    publisher, published = recording(store, sqlite_index, fp, root)

    step = Watcher(root, publisher=publisher, publish_every=3600, clock=Clock()).step()
    assert step.new == () and len(published) == 1 and step.published is published[0]
    entries = manifests.parse(store.get_bytes(manifest_key(published[0].bundle_id)), published[0].bundle_id).entries
    assert {e.path for e in entries} >= set(compiled)
    again = Watcher(root, publisher=publisher, publish_every=3600, clock=Clock()).step()  # a restarted sidecar
    assert again.published is None or not again.published.created


@pytest.mark.parametrize("compiled", [True, False])
def test_a_restored_file_rewritten_after_the_restore_is_not_the_pods_own(tmp_path, store, sqlite_index, fp,
                                                                         compiled):
    """The CUDA driver rewrites its ComputeCache files on a cache hit (same bytes, new mtime; seen on
    an H200): by time alone every warm pod took its restored cuda/ files for its own and published a
    new bundle at its first step. Only paths the restore did not lay down are the pod's own."""
    from kcache.restore import restore

    write_tree(tmp_path / "src", {"cuda/index": b"jit index", "cuda/b/0/e": b"sass", "inductor/fx/g": b"graph"})
    publish(store, sqlite_index, fp, sources.BUILTIN, root=tmp_path / "src")
    root = tmp_path / "root"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    restored_at = (root / RESTORE_MARKER).stat().st_mtime
    for rel in ("cuda/index", "cuda/b/0/e"):  # the driver's hit: rewritten in place, same bytes
        (root / rel).write_bytes((root / rel).read_bytes())
        os.utime(root / rel, (restored_at + 5,) * 2)
    if compiled:
        write_tree(root, {"triton/k1/k.cubin": b"a shape the bundle lacked"})
        os.utime(root / "triton/k1/k.cubin", (restored_at + 5,) * 2)
    warmed(root, at=restored_at + 10)
    publisher, calls = recording(store, sqlite_index, fp, root)

    Watcher(root, publisher=publisher, publish_every=3600, clock=Clock()).step()
    assert len(calls) == (1 if compiled else 0)


def test_restored_files_alone_are_not_published_again(published_root, store, sqlite_index, fp):
    root, _ = published_root
    calls = []
    Watcher(root, publisher=lambda layers: calls.append(layers), publish_every=3600, clock=Clock()).step()
    assert calls == []


@pytest.fixture
def published_root(tmp_path, store, sqlite_index, fp):
    """ROOT as a restore of a published bundle laid it down, and ready."""
    root = tmp_path / "root"
    make_ready(root)
    first = publish(store, sqlite_index, fp, sources.BUILTIN, root=root)
    return root, first


def test_publish_every_publishes_only_the_delta_when_due(published_root, store, sqlite_index, fp):
    root, first = published_root
    clock = Clock()
    calls = []

    def publisher(layers):
        calls.append(clock.now)
        return publish(store, sqlite_index, fp, layers, root=root)

    watcher = Watcher(root, publisher=publisher, publish_every=600, clock=clock)
    assert watcher.step().published is None  # baseline; nothing new
    write_tree(root, {"triton/k7/k.cubin": b"compiled on the hot path"})
    clock.now += 300
    assert watcher.step().published is None and calls == []  # not due yet
    clock.now += 301
    result = watcher.step().published
    assert result is not None and result.created and result.new_blobs == 1 and result.files == first.files + 1
    entries = manifests.parse(store.get_bytes(manifest_key(result.bundle_id)), result.bundle_id).entries
    assert "triton/k7/k.cubin" in {e.path for e in entries}
    clock.now += 601
    assert watcher.step().published is None and len(calls) == 1  # nothing new since: no publish
    doc = read_marker(root, WATCH_MARKER)
    assert doc["publishes"] == 1 and doc["last_publish"]["bundle_id"] == result.bundle_id


def test_a_failed_publish_is_counted_and_retried(published_root):
    root, first = published_root
    clock = Clock()
    outcomes = [StoreError("s3://b", "unreachable")]
    calls = []

    def publisher(layers):
        calls.append(clock.now)
        if outcomes:
            raise outcomes.pop()
        return first

    watcher = Watcher(root, publisher=publisher, publish_every=10, clock=clock)
    watcher.step()
    write_tree(root, {"cuda/new": b"x"})
    clock.now += 11
    step = watcher.step()
    assert "unreachable" in step.publish_error and read_marker(root, WATCH_MARKER)["publish_errors"] == 1
    assert watcher.step().published is None and len(calls) == 1  # not due again yet
    clock.now += 11
    assert watcher.step().published == first and len(calls) == 2  # the retry
    assert read_marker(root, WATCH_MARKER)["publishes"] == 1


def test_a_file_changed_while_it_was_published_is_retried(published_root, store, sqlite_index, fp, monkeypatch):
    """A compile still writing the file publish packs: a failed publish, counted, and the next one
    due takes the file as it is then; the sidecar goes on."""
    from kcache import publish as publishing

    root, first = published_root
    clock = Clock()
    real, rewrites = publishing._hash_all, [b"kernel, finished"]

    def hash_then_rewrite(*args, **kwargs):
        hashed = real(*args, **kwargs)
        if rewrites:
            (root / "triton/k8/k.cubin").write_bytes(rewrites.pop())
        return hashed

    monkeypatch.setattr(publishing, "_hash_all", hash_then_rewrite)
    watcher = Watcher(root, publisher=lambda layers: publish(store, sqlite_index, fp, layers, root=root),
                      publish_every=10, clock=clock)  # fmt: skip
    watcher.step()
    write_tree(root, {"triton/k8/k.cubin": b"kernel, half"})
    clock.now += 11
    failed = watcher.step()
    assert failed.published is None and "changed while it was being published" in failed.publish_error
    assert read_marker(root, WATCH_MARKER)["publish_errors"] == 1
    clock.now += 11
    retried = watcher.step().published
    assert retried is not None and retried.files == first.files + 1
    assert read_marker(root, WATCH_MARKER)["publishes"] == 1


def test_a_file_publish_skipped_is_published_when_next_due(published_root, store, sqlite_index, fp, monkeypatch):
    """A compile still writing a file (g++ writes a .so in place) when publish hashes it: publish
    leaves it out with a warning and succeeds; the watch must not count it published."""
    from kcache import publish as publishing

    root, first = published_root
    clock = Clock()
    real, grown = publishing.hash_file, []

    def hash_while_the_linker_writes(path, *args, **kwargs):
        if path.name == "kernel.so" and not grown:
            with open(path, "ab") as out:
                out.write(b" and the rest of it")
            grown.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(publishing, "hash_file", hash_while_the_linker_writes)
    watcher = Watcher(root, publisher=lambda layers: publish(store, sqlite_index, fp, layers, root=root),
                      publish_every=10, clock=clock)  # fmt: skip
    watcher.step()
    write_tree(root, {"inductor/aa/kernel.so": b"\x7fELF half", "triton/k9/k.cubin": b"done"})
    clock.now += 11
    partial = watcher.step().published
    assert grown and partial is not None and partial.skipped == ("inductor/aa/kernel.so",)
    clock.now += 11
    complete = watcher.step().published
    assert complete is not None, "the skipped file was never published again"
    entries = manifests.parse(store.get_bytes(manifest_key(complete.bundle_id)), complete.bundle_id).entries
    assert {"inductor/aa/kernel.so", "triton/k9/k.cubin"} <= {e.path for e in entries}
    clock.now += 11
    assert watcher.step().published is None  # and only once


@pytest.mark.parametrize("error", [
    UnicodeEncodeError("utf-8", "k\udcff", 1, 2, "surrogates not allowed"),  # a name no manifest can hold
    FileNotFoundError(2, "No such file or directory"),  # a file removed between walk and hash
    RuntimeError("a bug in publish"),
], ids=["unicode", "vanished", "bug"])  # fmt: skip
def test_run_survives_any_publish_failure_and_counts_it(published_root, store, sqlite_index, fp, error, caplog):
    root, _ = published_root
    write_tree(root, {"inductor/fxgraph/ff/g6": b"late"})  # compiled after ready
    os.utime(root / "inductor/fxgraph/ff/g6", (ready_time(root) + 1,) * 2)
    stop = threading.Event()
    outcomes = [error]

    def publisher(layers):
        if outcomes:
            raise outcomes.pop()
        stop.set()  # the second publish ends the run, after which nothing is pending
        return publish(store, sqlite_index, fp, layers, root=root)

    with caplog.at_level("WARNING", logger="kcache.watch"):
        Watcher(root, publisher=publisher, publish_every=0, clock=Clock()).run(stop, interval=0)
    doc = read_marker(root, WATCH_MARKER)
    assert doc["publish_errors"] == 1 and doc["publishes"] == 1
    assert type(error).__name__ in caplog.text
    samples = metrics.render(metrics.collect(root))
    assert "kcache_watch_publish_errors_total 1" in samples and "kcache_watch_publishes_total 1" in samples


def test_run_survives_a_failing_scan(tmp_path, monkeypatch, caplog):
    make_ready(tmp_path)
    stop = threading.Event()
    steps = []
    real_step = Watcher.step

    def step(self, **kwargs):
        steps.append(kwargs)
        if len(steps) == 1:
            raise ValueError("a scan that trips over something unexpected")
        stop.set()
        return real_step(self, **kwargs)

    monkeypatch.setattr(Watcher, "step", step)
    with caplog.at_level("WARNING", logger="kcache.watch"):
        Watcher(tmp_path).run(stop, interval=0)
    assert len(steps) == 2 and "ValueError" in caplog.text


def test_run_stops_on_the_event_and_publishes_what_remains(published_root, store, sqlite_index, fp):
    root, _ = published_root
    write_tree(root, {"inductor/fxgraph/ee/g5": b"late"})  # after ready, never due within the run
    os.utime(root / "inductor/fxgraph/ee/g5", (ready_time(root) + 1,) * 2)
    publisher, published = recording(store, sqlite_index, fp, root)

    stop = threading.Event()
    stop.set()
    Watcher(root, publisher=publisher, publish_every=3600).run(stop, interval=3600)
    assert len(published) == 1 and published[0].new_blobs == 1


def test_run_in_a_thread_ends_when_stopped(tmp_path):
    stop = threading.Event()
    worker = threading.Thread(target=Watcher(tmp_path).run, args=(stop, 3600))
    worker.start()
    stop.set()
    worker.join(timeout=30)
    assert not worker.is_alive()


def run(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_cli_once_then_publish_and_restore_elsewhere(tmp_path):
    root = tmp_path / "root"
    store = f"file://{tmp_path / 'store'}"
    index = f"sqlite:///{tmp_path / 'index.db'}"
    assert "not ready yet" in run("watch", "--root", str(root), "--once").output
    restored = run("restore", "--into", str(root), "--model", "m", "--store", store, "--index", index)
    assert "miss" in restored.output
    write_tree(root, RESTORED)  # the cold pod compiled these during warmup
    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
    for rel in RESTORED:
        os.utime(root / rel, (ready_time(root) - 1,) * 2)
    assert "0 cache files appeared after ready" in run("watch", "--root", str(root), "--once").output

    write_tree(root, {"vllm/torch_compile_cache/h/rank_0_0/x": b"late"})
    out = run("watch", "--root", str(root), "--once", "--json", "--publish-every", "10m",
              "--model", "m", "--store", store, "--index", index)  # fmt: skip
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["new_files"] == [{"layer": "vllm", "path": "torch_compile_cache/h/rank_0_0/x", "size": 4}]
    assert doc["published"]

    again = run("restore", "--into", str(tmp_path / "next"), "--model", "m", "--store", store, "--index", index)
    assert "hit" in again.output
    assert (tmp_path / "next/vllm/torch_compile_cache/h/rank_0_0/x").read_bytes() == b"late"


def test_cli_once_on_a_root_below_a_file_is_not_ready_not_a_bug(tmp_path):
    """A root whose parent is a file (a mistyped --root) was exit 70, "a bug in kcache"."""
    (tmp_path / "file").write_bytes(b"")
    out = run("watch", "--root", str(tmp_path / "file/root"), "--once")
    assert out.exit_code == 0 and "not ready yet" in out.output


def test_cli_once_publishes_past_a_file_name_that_is_not_utf8(tmp_path):
    root = tmp_path / "root"
    store = f"file://{tmp_path / 'store'}"
    index = f"sqlite:///{tmp_path / 'index.db'}"
    assert "miss" in run("restore", "--into", str(root), "--model", "m", "--store", store, "--index", index).output
    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
    run("watch", "--root", str(root), "--once")  # the baseline: nothing yet
    write_tree(root, {"triton/k1/k.cubin": b"late"})
    (root / "triton/k1").joinpath(os.fsdecode(b"bad\xff.json")).write_bytes(b"odd")
    out = run("watch", "--root", str(root), "--once", "--json", "--publish-every", "10m",
              "--model", "m", "--store", store, "--index", index)  # fmt: skip
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["published"] and doc["new_files"] == [{"layer": "triton", "path": "k1/k.cubin", "size": 4}]


@pytest.mark.parametrize("text, seconds", [("90", 90), ("30s", 30), ("10m", 600), ("1h", 3600), ("0.5s", 0.5)])
def test_durations(text, seconds):
    assert Duration().convert(text, None, None) == seconds


@pytest.mark.parametrize("text", ["", "0", "-1m", "10y", "m"])
def test_bad_durations(text):
    result = CliRunner().invoke(main, ["watch", "--root", "/tmp", "--once", "--interval", text])
    assert result.exit_code == 2 and "duration" in result.output


def test_watch_command_serves_and_stops_on_sigterm(tmp_path):
    make_ready(tmp_path)
    args = ("watch", "--root", str(tmp_path), "--interval", "1h", "--port", "0")
    with kcache_server(*args) as (proc, port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=10) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, proc.stderr.read()


def ready_with_a_late_kernel_and_no_index(tmp_path):
    """ROOT ready with one kernel compiled after ready, and the publish flags of an index no publish
    can open (a file where its directory should be; the index is opened at each publish)."""
    root = tmp_path / "root"
    make_ready(root)
    write_tree(root, {"inductor/fxgraph/ee/g5": b"compiled after ready"})
    os.utime(root / "inductor/fxgraph/ee/g5", (ready_time(root) + 1,) * 2)
    (tmp_path / "gone").write_bytes(b"a file where the index's directory should be")
    return root, ("--publish-every", "1h", "--model", "m", "--store", f"file://{tmp_path / 'store'}",
                  "--index", f"sqlite:///{tmp_path / 'gone/index.db'}")  # fmt: skip


def test_a_last_publish_that_fails_on_sigterm_exits_14(tmp_path):
    """The store refused the publish on SIGTERM: the kernels compiled after ready are lost for the
    pool, and watch said so only in a warning and exited 0 (14 came only from a publish abandoned)."""
    root, publishing = ready_with_a_late_kernel_and_no_index(tmp_path)
    with watching("watch", "--root", str(root), "--interval", "1h", "--json", *publishing) as proc:
        assert json.loads(proc.stdout.readline())["status"] == "watching"
        proc.send_signal(signal.SIGTERM)
        rest, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 14, stderr
    doc = json.loads(rest)
    assert doc["status"] == "error" and doc["exit_code"] == 14 and doc["error"] and doc["hint"]


def test_a_failed_publish_under_once_is_the_error_object_with_the_report(tmp_path):
    root, publishing = ready_with_a_late_kernel_and_no_index(tmp_path)
    out = run("watch", "--root", str(root), "--once", "--json", *publishing)
    doc = json.loads(out.stdout)
    assert out.exit_code == doc["exit_code"] == 14 and doc["status"] == "error" and doc["hint"]
    assert doc["publish_error"] in doc["error"] and doc["new_files"][0]["path"] == "fxgraph/ee/g5"


def test_watch_json_starts_with_one_json_line_that_names_the_port(tmp_path):
    make_ready(tmp_path)
    with watching("watch", "--root", str(tmp_path), "--interval", "1h", "--port", "0", "--json") as proc:
        doc = json.loads(proc.stdout.readline())  # the first line, once the port is bound
        assert doc["status"] == "watching" and doc["root"] == str(tmp_path) and doc["interval"] == 3600
        assert doc["port"] > 0 and doc["url"] == f"http://127.0.0.1:{doc['port']}" and doc["publish_every"] is None
        with urllib.request.urlopen(doc["url"] + "/healthz", timeout=10) as response:
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        rest, stderr = proc.communicate(timeout=20)
        assert proc.returncode == 0, stderr
        assert rest == ""  # nothing but the one object on stdout


def test_cli_watch_publishes_signed_deltas_under_the_restored_workload(tmp_path, monkeypatch):
    root = tmp_path / "root"
    store = ("--store", f"file://{tmp_path / 'store'}", "--index", f"sqlite:///{tmp_path / 'index.db'}")
    workload = ("--model", "m", "--extra", "tp=2")
    assert run("keygen", "pod", "--dir", str(tmp_path / "keys")).exit_code == 0
    monkeypatch.setenv("KCACHE_SIGNING_KEY", str(tmp_path / "keys" / "pod.key"))
    assert "miss" in run("restore", "--into", str(root), *workload, *store).output
    write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
    assert "0 cache files" in run("watch", "--root", str(root), "--once").output  # the baseline
    write_tree(root, {"triton/late/k.cubin": b"compiled after ready"})
    # No --model: the sidecar publishes what the init container restored, signed like `kcache publish`.
    out = run("watch", "--root", str(root), "--once", "--json", "--publish-every", "10m", *store)
    assert json.loads(out.output)["published"], out.output
    again = run("restore", "--into", str(tmp_path / "next"), *workload, *store, "--json", "--strict",
                "--require-signature", "--trusted-key", str(tmp_path / "keys" / "pod.pub"))  # fmt: skip
    doc = json.loads(again.output)
    assert (doc["status"], doc["signed_by"]) == ("hit", "pod")


def test_replicas_watch_publishes_keep_each_others_kernels(tmp_path):
    """Two pods restore one bundle, each compiles another shape after ready, each watch publishes:
    the second bundle had dropped the first pod's kernel, which the next pod compiled again on its
    hot path. A watch publish carries what the key's newest bundle holds that its ROOT lacks."""
    store = f"file://{tmp_path / 'store'}"
    index = f"sqlite:///{tmp_path / 'index.db'}"
    where = ("--model", "m", "--store", store, "--index", index)
    write_tree(tmp_path / "built", RESTORED)
    assert run("publish", "--from", str(tmp_path / "built"), *where).exit_code == 0
    pods = {"a": "triton/kA/k.cubin", "b": "triton/kB/k.cubin"}
    for pod in pods:  # both start from the same bundle
        root = tmp_path / pod
        assert "hit" in run("restore", "--into", str(root), *where).output
        write_marker(root, WARMUP_MARKER, {"status": "ok", "seconds": 1.0, "profiles": []})
        assert run("watch", "--root", str(root), "--once").exit_code == 0  # the baseline
    for pod, kernel in pods.items():
        root = tmp_path / pod
        write_tree(root, {kernel: pod.encode()})
        out = run("watch", "--root", str(root), "--once", "--json", "--publish-every", "1s", *where)
        assert out.exit_code == 0 and json.loads(out.output)["published"], out.output
    assert "hit" in run("restore", "--into", str(tmp_path / "next"), *where).output
    assert (tmp_path / "next/triton/kA/k.cubin").read_bytes() == b"a"
    assert (tmp_path / "next/triton/kB/k.cubin").read_bytes() == b"b"
    assert (tmp_path / "next/inductor/fxgraph/aa/g1").read_bytes() == b"graph"
