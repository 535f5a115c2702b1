"""Publish then restore, end to end on the file:// store and a SQLite index."""

import os
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trees import read_tree, write_tree

from kcache import envfile, fingerprint, sources
from kcache import manifest as manifests
from kcache.errors import IntegrityError, RestoreTimeout, RootError, UnsafePath
from kcache.index import Bundle
from kcache.publish import PublishConfig, publish
from kcache.restore import STAGING_PREFIX, read_state, restore
from kcache.sources.base import torch_user
from kcache.store import manifest_key

LAYERS = sources.select()


def publish_tree(store, index, fp, root: Path):
    return publish(store, index, fp, LAYERS, root=root, env={}, config=PublishConfig(allow_empty=True))


def layer_dirs(root: Path) -> dict:
    return {name: read_tree(root / name) for name in ("inductor", "triton", "cuda", "vllm")}


# ---- arbitrary trees ---------------------------------------------------------------------------

JUNK_LIKE = ("lock", "tmp", "pyc", "__pycache__")
names = st.text(
    alphabet=st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\"), min_size=1, max_size=10
).filter(lambda n: n not in (".", "..") and not n.startswith(".tmp") and not any(j in n for j in JUNK_LIKE))
leaves = st.tuples(st.binary(max_size=3000), st.sampled_from([0o644, 0o755, 0o600, 0o444]))
trees = st.recursive(leaves, lambda kids: st.dictionaries(names, kids, min_size=1, max_size=5), max_leaves=25)


def flatten(node, prefix: str) -> dict:
    if isinstance(node, tuple):
        return {prefix: node}
    out = {}
    for name, child in node.items():
        out.update(flatten(child, f"{prefix}/{name}"))
    return out


# Top-level names the inductor layer leaves to other layers (locks/, triton/, precompiled_headers/).
inductor_names = names.filter(lambda n: n not in sources.InductorSource.foreign)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(inductor=st.dictionaries(inductor_names, trees, max_size=4), triton=st.dictionaries(names, trees, max_size=3))
def test_any_tree_restores_byte_identical(tmp_path_factory, store, sqlite_index, fp, inductor, triton):
    src = tmp_path_factory.mktemp("src")
    files = {}
    for layer, tree in (("inductor", inductor), ("triton", triton)):
        for name, node in tree.items():
            files.update(flatten(node, f"{layer}/{name}"))
    write_tree(src, files)
    result = publish_tree(store, sqlite_index, fp, src)
    assert result.files == len(files)
    dst = tmp_path_factory.mktemp("dst") / "root"
    restored = restore(store, sqlite_index, fp, dst)
    assert restored.status == "hit"
    assert layer_dirs(dst) == layer_dirs(src)


def test_large_file_beside_thousands_of_small_ones(tmp_path, store, sqlite_index, fp):
    files = {f"inductor/k/{i:04d}.py": f"kernel {i}\n".encode() * (i % 7) for i in range(3000)}
    files["triton/big/kernel.cubin"] = (os.urandom(17 * 1024 * 1024), 0o755)  # its own pack
    write_tree(tmp_path / "src", files)
    result = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    assert result.packs >= 2
    restore(store, sqlite_index, fp, tmp_path / "dst")
    assert layer_dirs(tmp_path / "dst") == layer_dirs(tmp_path / "src")


# ---- dedup -------------------------------------------------------------------------------------


def test_republish_uploads_nothing(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/a": b"alpha", "inductor/b": b"beta", "triton/c": b"gamma"})
    first = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    second = publish_tree(store, sqlite_index, fp, tmp_path / "src")
    assert (first.new_blobs, first.created) == (3, True)
    assert (second.new_blobs, second.uploaded_bytes, second.packs, second.created) == (0, 0, 0, False)
    assert second.bundle_id == first.bundle_id
    assert len(list(store.list("packs/"))) == 1


def test_trees_that_share_files_share_blobs(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "one", {"inductor/a": b"shared", "inductor/b": b"only one"})
    write_tree(tmp_path / "two", {"inductor/a": b"shared", "inductor/c": b"only two", "inductor/d": b"shared"})
    publish_tree(store, sqlite_index, fp, tmp_path / "one")
    other = fingerprint.compute({**fp.facts, "model.id": "other"})
    second = publish_tree(store, sqlite_index, other, tmp_path / "two")
    assert second.new_blobs == 1 and second.files == 3


# ---- what restore lays down --------------------------------------------------------------------


def test_restore_writes_env_and_layout(tmp_path, store, sqlite_index, fp):
    pch = f"tmp/torchinductor_{torch_user()}/precompiled_headers/abc/c10.h.gch"  # a restore root's layout
    write_tree(tmp_path / "src", {"inductor/fxgraph/x": b"graph", pch: b"header", "extra/trt/timing.cache": b"t"})
    layers = LAYERS + [sources.ExtraSource("trt")]
    publish(store, sqlite_index, fp, layers, root=tmp_path / "src", env={})
    root = tmp_path / "dst"
    result = restore(store, sqlite_index, fp, root)
    assert set(result.layers) == {"inductor", "inductor-pch", "extra:trt"}
    assert (
        root / "tmp" / f"torchinductor_{torch_user()}" / "precompiled_headers" / "abc/c10.h.gch"
    ).read_bytes() == b"header"
    assert (root / "extra/trt/timing.cache").read_bytes() == b"t"
    env = envfile.read(root / "kcache.env")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(root / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(root / "triton")
    assert env["CUDA_CACHE_PATH"] == str(root / "cuda")
    assert env["VLLM_CACHE_ROOT"] == str(root / "vllm")
    assert env["TMPDIR"] == str(root / "tmp")
    assert env["KCACHE_EXTRA_TRT"] == str(root / "extra/trt")
    # The bundle key carries the toolchain; a tag torch keys on would split publisher and restorer.
    assert "TORCH_COMPILE_CACHE_KEY_TAG" not in env
    assert read_state(root)["status"] == "hit"


def test_miss_still_prepares_root(tmp_path, store, sqlite_index, fp):
    result = restore(store, sqlite_index, fp, tmp_path / "dst")
    assert result.status == "miss"
    assert (tmp_path / "dst/inductor").is_dir() and (tmp_path / "dst/kcache.env").is_file()
    assert read_state(tmp_path / "dst")["status"] == "miss"


def test_other_cpu_isa_never_hits(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/kernel.so": b"avx512 code"})
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    avx2 = fingerprint.compute({**fp.facts, "cpu.isa": "avx2"})
    assert restore(store, sqlite_index, avx2, tmp_path / "dst").status == "miss"
    assert read_tree(tmp_path / "dst/inductor") == {}


def test_restore_replaces_previous_layer_content(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/new": b"new"})
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    write_tree(tmp_path / "dst", {"inductor/stale": b"old", "unrelated/keep": b"mine"})
    restore(store, sqlite_index, fp, tmp_path / "dst")
    assert read_tree(tmp_path / "dst/inductor") == {"new": (b"new", 0o644)}
    assert (tmp_path / "dst/unrelated/keep").read_bytes() == b"mine"


def test_publish_from_live_directories(tmp_path, store, sqlite_index, fp):
    inductor = tmp_path / "live-inductor"
    write_tree(inductor, {"fxgraph/g": b"g", "locks/x.lock": b"", "triton/0/k/kernel.json": b"{}", "a.tmp": b"",
                          "precompiled_headers/h.gch": b"pch"})  # fmt: skip
    write_tree(tmp_path / "tmp" / f"torchinductor_{torch_user()}", {"precompiled_headers/h.gch": b"pch"})
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "TMPDIR": str(tmp_path / "tmp"), "HOME": str(tmp_path / "home")}
    result = publish(store, sqlite_index, fp, LAYERS, env=env)
    bundle = sqlite_index.get_bundle(result.bundle_id)
    paths = [e.path for e in manifests.parse(store.get_bytes(manifest_key(bundle.id)), bundle.id).entries]
    assert paths == ["inductor-pch/h.gch", "inductor/fxgraph/g", "triton/k/kernel.json"]


# ---- refusing bad input, leaving nothing half-done ---------------------------------------------


def _published(tmp_path, store, index, fp):
    write_tree(tmp_path / "src", {"inductor/a": b"A" * 1000, "inductor/b": b"B" * 1000})
    return publish_tree(store, index, fp, tmp_path / "src")


def _assert_untouched(root: Path):
    assert read_tree(root / "inductor") == {"old": (b"previous", 0o644)}
    assert not list(root.glob(STAGING_PREFIX + "*"))


def test_corrupted_blob_is_detected_and_nothing_written(tmp_path, store, sqlite_index, fp):
    _published(tmp_path, store, sqlite_index, fp)
    (pack,) = store.list("packs/")
    path = store.root / pack.key
    data = bytearray(path.read_bytes())
    data[20] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))
    write_tree(tmp_path / "dst", {"inductor/old": b"previous"})
    with pytest.raises(IntegrityError):
        restore(store, sqlite_index, fp, tmp_path / "dst")
    _assert_untouched(tmp_path / "dst")
    assert read_state(tmp_path / "dst")["status"] == "error"


def test_manifest_with_unsafe_path_is_refused(tmp_path, store, sqlite_index, fp):
    result = _published(tmp_path, store, sqlite_index, fp)
    good = manifests.parse(store.get_bytes(manifest_key(result.bundle_id)), result.bundle_id)
    evil_entries = [e.as_row() for e in good.entries]
    evil_entries[0][0] = "inductor/../../escaped"
    from kcache import canonical

    data = canonical.dumps({"schema": manifests.SCHEMA, "bundle_key": fp.bundle_key, "toolchain_key": fp.toolchain_key,
                            "workload_key": fp.workload_key, "facts": dict(fp.facts), "layers": ["inductor"],
                            "entries": evil_entries, "layer_info": {}, "chunks": {}})  # fmt: skip
    evil_id = canonical.sha256(data)
    store.put_bytes(manifest_key(evil_id), data)
    from datetime import datetime, timedelta, timezone

    sqlite_index.add_bundle(Bundle(evil_id, fp.bundle_key, fp.toolchain_key, fp.workload_key, None, {},
                                   ("inductor",), 2, 2000, datetime.now(timezone.utc) + timedelta(hours=1),
                                   "attacker", "active"))  # fmt: skip
    write_tree(tmp_path / "dst", {"inductor/old": b"previous"})
    with pytest.raises(UnsafePath):
        restore(store, sqlite_index, fp, tmp_path / "dst")
    _assert_untouched(tmp_path / "dst")
    assert not (tmp_path / "escaped").exists()


def test_root_that_is_a_file_is_refused(tmp_path, store, sqlite_index, fp):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RootError, match="not a directory"):
        restore(store, sqlite_index, fp, tmp_path / "file")


class FailingStore:
    """Wraps a store; the n-th range read of a pack raises, or blocks until released."""

    def __init__(self, inner, *, fail_at: int | None = None, block: threading.Event | None = None):
        self.inner, self.fail_at, self.block, self.reads = inner, fail_at, block, 0
        self.url = inner.url

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_range(self, key, offset, length):
        if not key.startswith("packs/"):  # the manifest, read with its size as the bound
            return self.inner.open_range(key, offset, length)
        self.reads += 1
        if self.block is not None:
            self.block.wait()
        if self.fail_at is not None and self.reads >= self.fail_at:
            from kcache.errors import StoreError

            raise StoreError(self.url, "injected failure")
        return self.inner.open_range(key, offset, length)


def test_interrupted_restore_leaves_old_content(tmp_path, store, sqlite_index, fp):
    _published(tmp_path, store, sqlite_index, fp)
    write_tree(tmp_path / "dst", {"inductor/old": b"previous"})
    from kcache.errors import StoreError

    with pytest.raises(StoreError, match="injected"):
        restore(FailingStore(store, fail_at=1), sqlite_index, fp, tmp_path / "dst")
    _assert_untouched(tmp_path / "dst")
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"


def test_timeout_gives_up_without_touching_root(tmp_path, store, sqlite_index, fp):
    _published(tmp_path, store, sqlite_index, fp)
    write_tree(tmp_path / "dst", {"inductor/old": b"previous"})
    release = threading.Event()
    try:
        with pytest.raises(RestoreTimeout):
            restore(FailingStore(store, block=release), sqlite_index, fp, tmp_path / "dst", timeout=0.3)
    finally:
        release.set()
    assert read_tree(tmp_path / "dst/inductor") == {"old": (b"previous", 0o644)}


class ReachedStore:
    """The real store; the first read of a pack says so, then waits until released."""

    def __init__(self, inner):
        self.inner, self.reached, self.release = inner, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_range(self, key, offset, length):
        self.reached.set()
        assert self.release.wait(60)
        return self.inner.open_range(key, offset, length)


def test_an_interrupt_stops_the_restore_before_its_swap(tmp_path, store, sqlite_index, fp, monkeypatch):
    """SIGTERM while a pack is read under --timeout (restore turns it into Terminated): the
    error path wrote its marker, and then the worker went on and swapped the bundle in."""
    import os
    import signal

    from kcache.errors import Terminated

    _published(tmp_path, store, sqlite_index, fp)
    write_tree(tmp_path / "dst", {"inductor/old": b"previous"})
    slow = ReachedStore(store)
    terminate = lambda: slow.reached.wait(60) and os.kill(os.getpid(), signal.SIGTERM)  # noqa: E731
    threading.Thread(target=terminate, daemon=True).start()

    from kcache import restore as restoring

    worked, real_work = threading.Event(), restoring._open_and_restore

    def work(*args, **kwargs):  # the worker thread's whole run, then said so
        try:
            return real_work(*args, **kwargs)
        finally:
            worked.set()

    monkeypatch.setattr(restoring, "_open_and_restore", work)

    class ReleasingWhenRecorded:
        """The error path records the outcome (a slow index took seconds): the read goes on meanwhile."""

        def __getattr__(self, name):
            return getattr(sqlite_index, name)

        def record_event(self, event) -> None:
            slow.release.set()
            assert worked.wait(60)
            sqlite_index.record_event(event)

    try:
        with pytest.raises(Terminated):
            restore(slow, ReleasingWhenRecorded(), fp, tmp_path / "dst", timeout=60)
    finally:
        slow.release.set()
    assert read_tree(tmp_path / "dst/inductor") == {"old": (b"previous", 0o644)}
    assert read_state(tmp_path / "dst")["status"] == "error"


def test_a_signal_while_the_worker_starts_still_stops_it_before_its_swap(tmp_path, store, sqlite_index, fp,
                                                                         monkeypatch):
    """SIGTERM as the worker starts: the main thread may still be inside Thread.start(), waiting to
    hear that the worker runs; the signal's exception there must stop the worker as anywhere else."""
    import os
    import signal

    from kcache import restore as restoring
    from kcache.errors import Terminated

    _published(tmp_path, store, sqlite_index, fp)
    write_tree(tmp_path / "dst", {"inductor/old": b"previous"})
    worked, real_work, real_start = threading.Event(), restoring._open_and_restore, threading.Thread.start

    def work(*args, **kwargs):
        try:
            return real_work(*args, **kwargs)
        finally:
            worked.set()

    def start_then_signal(thread):  # the handler runs before this frame returns, inside start()
        real_start(thread)
        if thread.name == "kcache-restore":
            os.kill(os.getpid(), signal.SIGTERM)

    class ReleasingWhenRecorded:
        def __getattr__(self, name):
            return getattr(sqlite_index, name)

        def record_event(self, event) -> None:
            assert worked.wait(60)
            sqlite_index.record_event(event)

    monkeypatch.setattr(restoring, "_open_and_restore", work)
    monkeypatch.setattr(threading.Thread, "start", start_then_signal)
    with pytest.raises(Terminated):
        restore(store, ReleasingWhenRecorded(), fp, tmp_path / "dst", timeout=60)
    assert read_tree(tmp_path / "dst/inductor") == {"old": (b"previous", 0o644)}
    assert read_state(tmp_path / "dst")["status"] == "error"



def test_a_signal_during_the_swap_of_a_restore_without_a_budget_lets_the_swap_finish(tmp_path, store, sqlite_index,
                                                                                   fp, monkeypatch):  # fmt: skip
    """Without --timeout (prebake's restore) the work ran on the main thread, where SIGTERM's exception
    lands: one between the swap's renames left ROOT with some layers new and some gone. The swap is a
    few renames; begun, it finishes whatever signal comes, as under a budget."""
    import os
    import signal

    from kcache import restore as restoring

    _published(tmp_path, store, sqlite_index, fp)
    write_tree(tmp_path / "dst", {"inductor/old": b"previous"})
    real_swap, swapped = restoring._swap, threading.Event()

    def signalled_swap(*args, **kwargs):  # the handler runs where the signal lands: here, or the main thread
        os.kill(os.getpid(), signal.SIGTERM)
        real_swap(*args, **kwargs)
        swapped.set()

    monkeypatch.setattr(restoring, "_swap", signalled_swap)
    result = restore(store, sqlite_index, fp, tmp_path / "dst", timeout=None)
    assert swapped.is_set() and result.status == "hit"
    assert read_tree(tmp_path / "dst/inductor") == {"a": (b"A" * 1000, 0o644), "b": (b"B" * 1000, 0o644)}
    assert read_state(tmp_path / "dst")["status"] == "hit"

class HangingEvents:
    """A catalog that answers, but whose event recording hangs until released (a wedged index)."""

    def __init__(self, inner, release: threading.Event):
        self.inner, self.release, self.recording = inner, release, threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def record_event(self, event) -> None:
        self.recording.set()
        self.release.wait()


def test_recording_the_outcome_never_holds_the_pod_up(tmp_path, store, sqlite_index, fp):
    _published(tmp_path, store, sqlite_index, fp)
    release = threading.Event()
    index = HangingEvents(sqlite_index, release)
    try:
        result = restore(store, index, fp, tmp_path / "dst", timeout=60)
    finally:
        release.set()
    assert result.status == "hit" and index.recording.is_set()
    assert read_state(tmp_path / "dst")["status"] == "hit"


def test_stale_staging_from_a_killed_restore_is_cleaned(tmp_path, store, sqlite_index, fp):
    _published(tmp_path, store, sqlite_index, fp)
    stale = tmp_path / "dst" / f"{STAGING_PREFIX}999999999-abc"
    write_tree(stale, {"inductor/half": b"half"})
    restore(store, sqlite_index, fp, tmp_path / "dst")
    assert not stale.exists()


@pytest.mark.parametrize("pid", [1, os.getpid()], ids=["pid-1", "live-pid"])
def test_staging_named_for_a_live_pid_is_cleaned(tmp_path, store, sqlite_index, fp, pid):
    """In a container kcache is pid 1 and pids are reused: a live pid in the name proves nothing."""
    _published(tmp_path, store, sqlite_index, fp)
    stale = tmp_path / "dst" / f"{STAGING_PREFIX}{pid}-abc"
    write_tree(stale, {"files/inductor/half": b"half"})
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"
    assert not stale.exists()


def test_same_content_at_two_paths_is_fetched_once_and_laid_twice(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/a": b"same", "inductor/sub/b": (b"same", 0o755)})
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    counting = FailingStore(store)
    restore(counting, sqlite_index, fp, tmp_path / "dst")
    assert counting.reads == 1
    assert read_tree(tmp_path / "dst/inductor") == {"a": (b"same", 0o644), "sub/b": (b"same", 0o755)}


def test_link_in_root_cannot_carry_a_layer_outside(tmp_path, store, sqlite_index, fp):
    header = f"tmp/torchinductor_{torch_user()}/precompiled_headers/h.gch"
    write_tree(tmp_path / "src", {"inductor/a": b"a", header: b"pch"})
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "tmp").symlink_to(outside)
    with pytest.raises(UnsafePath, match="outside"):
        restore(store, sqlite_index, fp, tmp_path / "dst")
    assert list(outside.rglob("*")) == []
    assert read_state(tmp_path / "dst")["status"] == "error"
    assert "TMPDIR" not in envfile.read(tmp_path / "dst" / envfile.NAME)  # the pod starts cold, its temp dir its own


def test_publish_from_root_keeps_extra_layers_a_restore_laid_down(tmp_path, store, sqlite_index, fp):
    from click.testing import CliRunner

    from kcache.cli import main

    write_tree(tmp_path / "root", {"inductor/a": b"a", "extra/trt/timing.cache": b"t"})
    args = ["publish", "--from", str(tmp_path / "root"), "--model", "m", "--json"]
    out = CliRunner().invoke(main, args, catch_exceptions=False)
    assert "extra:trt" in out.output


def test_a_strict_umask_does_not_take_the_bits_a_manifest_asks_for(tmp_path, store, sqlite_index, fp):
    """Files are created under the umask, then given their modes (and times) through their descriptor."""
    files = {"inductor/a.so": (b"\x7fELF" * 10, 0o755), "inductor/b.py": (b"x = 1\n", 0o644),
             "triton/c/k.json": (b"{}", 0o444)}  # fmt: skip
    write_tree(tmp_path / "src", files)
    os.utime(tmp_path / "src/inductor/b.py", ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    publish_tree(store, sqlite_index, fp, tmp_path / "src")
    old = os.umask(0o077)
    try:
        assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"
    finally:
        os.umask(old)
    assert layer_dirs(tmp_path / "dst")["inductor"] == read_tree(tmp_path / "src/inductor")
    assert layer_dirs(tmp_path / "dst")["triton"] == read_tree(tmp_path / "src/triton")
    assert (tmp_path / "dst/inductor/b.py").stat().st_mtime_ns == 1_600_000_000_000_000_000


def test_directories_planted_where_the_outcome_goes_are_deleted_within_the_budget(tmp_path, store, sqlite_index, fp,
                                                                                  monkeypatch):  # fmt: skip
    """A directory at kcache.env and at the marker is moved aside and deleted "for a second at most":
    on the error path of a restore whose budget had run out, each second came on top of the budget."""
    import time

    from kcache import rootdir

    _published(tmp_path, store, sqlite_index, fp)
    root = tmp_path / "dst"
    asked: list[float | None] = []
    real = rootdir.delete_until
    monkeypatch.setattr(rootdir, "delete_until", lambda path, deadline: asked.append(deadline) or real(path, deadline))
    release = threading.Event()
    ready = threading.Event()

    class PlantsThenStalls(FailingStore):
        def open_range(self, key, offset, length):  # the pod's neighbour plants while the pack is read
            if not ready.is_set():
                write_tree(root, {"kcache.env/x": b"", ".kcache-state.json/x": b""})
                ready.set()
            return super().open_range(key, offset, length)

    try:
        with pytest.raises(RestoreTimeout):
            restore(PlantsThenStalls(store, block=release), sqlite_index, fp, root, timeout=0.5)
        returned = time.monotonic()  # past the budget's end, and before a second more of deleting would end
    finally:
        release.set()
    assert ready.is_set() and asked
    assert all(d is not None and d <= returned for d in asked), (asked, returned)


def test_publish_from_a_root_restored_for_another_user_keeps_its_header(tmp_path, store, sqlite_index, fp,
                                                                         monkeypatch):  # fmt: skip
    """Restored for the model's user (KCACHE_RUN_AS=bob), the ROOT was published again by a sidecar or an
    operator without KCACHE_RUN_AS: publish looked for the header under its own user's name, dropped the
    layer without a word, and every later pod rebuilt the 155 MB header. The marker names the user."""
    pch = "tmp/torchinductor_alice/precompiled_headers/abc/c10.h.gch"
    write_tree(tmp_path / "src", {"inductor/fxgraph/x": b"graph", pch: b"header"})
    publish(store, sqlite_index, fp, sources.builtin("alice"), root=tmp_path / "src", env={})
    root = tmp_path / "dst"
    monkeypatch.setenv("KCACHE_RUN_AS", "bob")
    assert restore(store, sqlite_index, fp, root).status == "hit"
    assert (root / "tmp/torchinductor_bob/precompiled_headers/abc/c10.h.gch").read_bytes() == b"header"
    monkeypatch.delenv("KCACHE_RUN_AS")
    write_tree(root, {"inductor/fxgraph/y": b"a graph the pod compiled"})
    again = publish(store, sqlite_index, fp, sources.in_root(root), root=root, env={})
    assert "inductor-pch" in again.layers and again.files == 3


def test_files_from_a_publisher_whose_clock_ran_ahead_are_not_newer_than_the_marker(tmp_path, store, sqlite_index,
                                                                                     fp):  # fmt: skip
    """Torch's ISA-probe and header shortcuts vouch only for files not newer than the restore marker:
    mtimes from a publisher 10 minutes ahead made them distrust every restored file (a header
    preprocessed, four probe interpreters run). The bundle's times move back together, so that
    ninja still finds each output newer than its inputs (a link after its objects)."""
    import os
    import time

    from kcache.readiness import RESTORE_MARKER

    files = {"inductor/ext/a_ext.so": b"linked", "inductor/ext/b_kernels.o": b"object", "inductor/old": b"past"}
    write_tree(tmp_path / "src", files)
    ahead, past = time.time_ns() + 600 * 10**9, time.time_ns() - 3600 * 10**9
    times = {"inductor/ext/a_ext.so": ahead + 10**6, "inductor/ext/b_kernels.o": ahead, "inductor/old": past}
    for rel, when in times.items():
        os.utime(tmp_path / "src" / rel, ns=(when, when))
    publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "src", env={})
    root = tmp_path / "dst"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    marker = (root / RESTORE_MARKER).stat().st_mtime_ns
    got = {rel: (root / rel).stat().st_mtime_ns for rel in times}
    assert max(got.values()) <= marker
    assert got["inductor/ext/a_ext.so"] - got["inductor/ext/b_kernels.o"] == 10**6  # the order, and the gap
    assert got["inductor/ext/b_kernels.o"] - got["inductor/old"] == ahead - past


def test_times_from_the_past_travel_as_they_were(tmp_path, store, sqlite_index, fp):
    import os
    import time

    write_tree(tmp_path / "src", {"inductor/old": b"past"})
    past = time.time_ns() - 3600 * 10**9
    os.utime(tmp_path / "src/inductor/old", ns=(past, past))
    publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "src", env={})
    assert restore(store, sqlite_index, fp, tmp_path / "dst").status == "hit"
    assert (tmp_path / "dst/inductor/old").stat().st_mtime_ns == past


def test_the_header_a_pod_built_for_itself_wins_over_the_one_restored_for_another_user(tmp_path, store,
                                                                                        sqlite_index, fp,
                                                                                        monkeypatch):  # fmt: skip
    """A miss lays no header out and names no user; a header the model built under its own user's
    name is the one published, whatever user the restore laid the bundle's out for."""
    root = tmp_path / "dst"
    assert restore(store, sqlite_index, fp, root).status == "miss"
    assert read_state(root).get("run_as") is None  # a cold start says nothing of who runs the model
    me = torch_user()
    write_tree(root, {f"tmp/torchinductor_{me}/precompiled_headers/abc/c10.h.gch": b"built here",
                      "inductor/fxgraph/x": b"graph"})  # fmt: skip
    first = publish(store, sqlite_index, fp, sources.in_root(root), root=root, env={})
    assert "inductor-pch" in first.layers
    monkeypatch.setenv("KCACHE_RUN_AS", "bob")
    again = tmp_path / "again"
    assert restore(store, sqlite_index, fp, again).status == "hit"
    monkeypatch.delenv("KCACHE_RUN_AS")
    write_tree(again, {f"tmp/torchinductor_{me}/precompiled_headers/abc/c10.h.gch": b"rebuilt by the model"})
    layers = sources.in_root(again)
    (header,) = [s for s in layers if s.name == "inductor-pch"]
    assert header.restore_dir(again) == again / f"tmp/torchinductor_{me}/precompiled_headers"


def test_one_time_far_in_the_future_moves_no_other_file(tmp_path, store, sqlite_index, fp):
    """One file stamped 2**62 ns (year 2116: no clock that ran ahead) took every other file of the
    bundle back to 1970 with it, older than the image's headers they were built from."""
    import os
    import time

    from kcache.readiness import RESTORE_MARKER

    write_tree(tmp_path / "src", {"inductor/old": b"past", "triton/k/odd.json": b"{}"})
    past = time.time_ns() - 3600 * 10**9
    os.utime(tmp_path / "src/inductor/old", ns=(past, past))
    os.utime(tmp_path / "src/triton/k/odd.json", ns=(2**62, 2**62))
    publish(store, sqlite_index, fp, LAYERS, root=tmp_path / "src", env={})
    root = tmp_path / "dst"
    assert restore(store, sqlite_index, fp, root).status == "hit"
    assert (root / "inductor/old").stat().st_mtime_ns == past
    assert (root / "triton/k/odd.json").stat().st_mtime_ns <= (root / RESTORE_MARKER).stat().st_mtime_ns


def test_a_cold_start_for_a_named_user_names_it_for_publish(tmp_path, store, sqlite_index, fp, monkeypatch):
    """`restore --run-as app` misses and lays TMPDIR out for app, whose header the model then builds:
    `publish --from ROOT` as another user must read app's, which the marker names."""
    root = tmp_path / "dst"
    monkeypatch.setenv("KCACHE_RUN_AS", "app")
    assert restore(store, sqlite_index, fp, root).status == "miss"
    monkeypatch.delenv("KCACHE_RUN_AS")
    assert read_state(root)["run_as"] == "app"
    (header,) = [s for s in sources.in_root(root) if s.name == "inductor-pch"]
    assert header.restore_dir(root) == root / "tmp/torchinductor_app/precompiled_headers"
