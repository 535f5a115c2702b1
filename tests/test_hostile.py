"""Hostile manifests, packs and restore roots: each is refused with a reason, and nothing is
written outside ROOT or left half-done inside it. Then the parsers, fuzzed."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import tracemalloc
from pathlib import Path

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trees import read_tree, write_tree

from kcache import canonical, packs, sources
from kcache import manifest as manifests
from kcache.errors import IntegrityError, KcacheError, UnsafePath
from kcache.publish import publish
from kcache.restore import STAGING_PREFIX, read_state, restore
from kcache.store import manifest_key, pack_key
from kcache.store.nodecache import NodeCacheStore

OLD = {"inductor/old": b"previous"}
HELLO = b"hello, kernel\n" * 10


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def put_pack(store, frames: list[tuple[str, bytes, int]]) -> tuple[str, int, list[tuple[int, int]]]:
    """A well-formed pack of (blob id, zstd frame, declared size); returns (id, size, [(offset, length)])."""
    body, spots, rows = b"", [], []
    for blob, frame, size in frames:
        spots.append((len(body), len(frame)))
        rows.append([blob, len(body), len(frame), size])
        body += frame
    trailer = canonical.dumps({"schema": 1, "blobs": rows})
    data = body + trailer + packs.FOOTER.pack(len(trailer)) + packs.MAGIC
    store.put_bytes(pack_key(sha(data)), data)
    return sha(data), len(data), spots


def compress(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_content_size=True).compress(data)


def put_manifest(store, fp, rows: list[list], layers=("inductor",)) -> str:
    data = canonical.dumps({"schema": 1, "bundle_key": fp.bundle_key, "toolchain_key": fp.toolchain_key,
                            "workload_key": fp.workload_key, "facts": dict(fp.facts), "layers": list(layers),
                            "entries": rows})  # fmt: skip
    store.put_bytes(manifest_key(sha(data)), data)
    return sha(data)


@pytest.fixture
def hello_pack(store):
    pack, size, [(offset, length)] = put_pack(store, [(sha(HELLO), compress(HELLO), len(HELLO))])
    return pack, size, offset, length


@pytest.fixture
def dirs(tmp_path):
    """(ROOT holding an old inductor layer, an empty directory beside it that must stay empty)."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    write_tree(root, OLD)
    outside.mkdir()
    return root, outside


def assert_nothing_happened(root: Path, outside: Path) -> None:
    assert read_tree(root / "inductor") == {"old": (b"previous", 0o644)}
    assert not list(root.glob(STAGING_PREFIX + "*"))
    assert list(outside.rglob("*")) == []
    assert read_state(root)["status"] == "error"


# ---- hostile manifests -----------------------------------------------------------------------------


def row(path, pack_info, *, mode=0o644, size=len(HELLO), blob=sha(HELLO), offset=None, length=None):
    pack, _size, default_offset, default_length = pack_info
    offset = default_offset if offset is None else offset
    length = default_length if length is None else length
    return [path, mode, size, blob, pack, offset, length]


def _absolute(p, outside):
    return [row(str(outside / "abs"), p)]


HOSTILE = {
    "absolute-path": (_absolute, UnsafePath, "absolute paths"),
    "dot-dot": (lambda p, o: [row("inductor/../../outside/x", p)], UnsafePath, r"'\.\.'"),
    "empty-component": (lambda p, o: [row("inductor//x", p)], UnsafePath, "empty"),
    # No file system takes a name past 255 bytes: the bundle's fault, not ROOT's (it was a RootError).
    "name-past-name-max": (lambda p, o: [row("inductor/" + "é" * 128, p)], UnsafePath, "name of 256 bytes"),
    "backslash": (lambda p, o: [row("inductor\\..\\..\\outside\\x", p)], UnsafePath, "backslash"),
    "duplicate-path": (lambda p, o: [row("inductor/a", p), row("inductor/a", p)], UnsafePath, "appears twice"),
    "file-and-directory": (lambda p, o: [row("inductor/a", p), row("inductor/a/b", p)], UnsafePath,
                           "parent of this path is itself a file"),
    "setuid-mode": (lambda p, o: [row("inductor/a", p, mode=0o4755)], IntegrityError, "bits beyond permissions"),
    "setgid-sticky-mode": (lambda p, o: [row("inductor/a", p, mode=0o3777)], IntegrityError, "bits beyond"),
    "entry-past-pack-end": (lambda p, o: [row("inductor/a", p, offset=p[1] + 10)], IntegrityError, "truncated"),
    "length-past-pack-end": (lambda p, o: [row("inductor/a", p, length=p[1] * 3)], IntegrityError, "truncated"),
    "declared-size-too-small": (lambda p, o: [row("inductor/a", p, size=5)], IntegrityError, "past its declared 5"),
    "declared-size-too-large": (lambda p, o: [row("inductor/a", p, size=10**6)], IntegrityError, "expected 1000000"),
    "wrong-blob-id": (lambda p, o: [row("inductor/a", p, blob=sha(b"other"))], IntegrityError, "hashes to"),
    # One blob, one content, one size: the first path's size would be checked and the second path
    # laid out with bytes its row does not describe.
    "one-blob-two-sizes": (lambda p, o: [row("inductor/a", p), row("inductor/b", p, size=len(HELLO) + 1)],
                           IntegrityError, "listed with 140 and 141 bytes"),
}  # fmt: skip


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_manifest_is_refused(store, sqlite_index, fp, hello_pack, dirs, case):
    rows_for, error, reason = HOSTILE[case]
    root, outside = dirs
    evil = put_manifest(store, fp, rows_for(hello_pack, outside))
    with pytest.raises(error, match=reason):
        restore(store, sqlite_index, fp, root, bundle_id=evil)
    assert_nothing_happened(root, outside)


@pytest.mark.parametrize("case", ["wrong-blob-id", "declared-size-too-large"])
def test_a_hostile_manifest_drops_no_good_pack_from_the_node_cache(store, sqlite_index, fp, hello_pack, dirs,
                                                                  tmp_path, case):  # fmt: skip
    """A blob that fails its check through the node cache made restore drop the pack and remove its
    copy, as if a peer had changed it in place: a store writer could then empty the node of any pack
    (another bundle's, a signed one) by naming it in a manifest an unsigned pod takes."""
    rows_for, error, _reason = HOSTILE[case]
    root, outside = dirs
    node = tmp_path / "node"
    pack = hello_pack[0]
    NodeCacheStore(store, node).warm(pack)  # the DaemonSet's good copy
    copy = node / "packs" / pack[:2] / pack
    before = copy.read_bytes()
    evil = put_manifest(store, fp, rows_for(hello_pack, outside))
    with pytest.raises(error):
        restore(NodeCacheStore(store, node), sqlite_index, fp, root, bundle_id=evil)
    assert copy.read_bytes() == before


def test_zstd_bomb_in_a_real_pack_is_stopped_at_the_declared_size(store, sqlite_index, fp, dirs):
    root, outside = dirs
    zeros = bytes(50 * 1024 * 1024)
    bomb = compress(zeros)
    assert len(bomb) < 64 * 1024  # a small frame in the store, 50 MB once decompressed
    pack, _size, [(offset, length)] = put_pack(store, [(sha(b"x" * 10), bomb, 10)])
    evil = put_manifest(store, fp, [["inductor/bomb", 0o644, 10, sha(b"x" * 10), pack, offset, length]])
    with pytest.raises(IntegrityError, match="decompresses past its declared 10 bytes"):
        restore(store, sqlite_index, fp, root, bundle_id=evil)
    assert_nothing_happened(root, outside)

    out = io.BytesIO()  # and the staged file never held more than the declared size
    with pytest.raises(IntegrityError):
        packs.unpack_to(io.BytesIO(bomb), sha(b"x" * 10), 10, out)
    assert len(out.getvalue()) <= 10


def test_trailer_with_offsets_past_the_end_is_refused():
    trailer = canonical.dumps({"schema": 1, "blobs": [[sha(HELLO), 0, 10**9, len(HELLO)]]})
    tail = trailer + packs.FOOTER.pack(len(trailer)) + packs.MAGIC
    with pytest.raises(IntegrityError, match="lies outside the pack body"):
        packs.parse_trailer("p" * 64, tail, len(tail) + 100)
    trailer = canonical.dumps({"schema": 1, "blobs": [[sha(HELLO), -5, 1, 1]]})
    tail = trailer + packs.FOOTER.pack(len(trailer)) + packs.MAGIC
    with pytest.raises(IntegrityError, match="lies outside the pack body"):
        packs.parse_trailer("p" * 64, tail, len(tail) + 100)
    with pytest.raises(IntegrityError, match="longer than the bytes given"):
        packs.parse_trailer("p" * 64, packs.FOOTER.pack(10**6) + packs.MAGIC, 10**7)


def test_hostile_extra_layer_name_is_refused(store, sqlite_index, fp, hello_pack, dirs):
    root, outside = dirs
    evil = put_manifest(store, fp, [row("extra/x/a", hello_pack)], layers=("extra:../../outside",))
    with pytest.raises(KcacheError, match="extra directory name"):
        restore(store, sqlite_index, fp, root, bundle_id=evil)
    assert_nothing_happened(root, outside)


def test_manifest_path_colliding_with_restore_internals_is_refused(store, sqlite_index, fp, hello_pack, dirs):
    root, outside = dirs
    evil = put_manifest(store, fp, [row(".retired/x", hello_pack), row("inductor/a", hello_pack)])
    with pytest.raises(KcacheError):
        restore(store, sqlite_index, fp, root, bundle_id=evil)
    assert_nothing_happened(root, outside)


def deep_paths(layer: str, count: int, depth: int = 200) -> list[str]:
    """`count` paths of `depth` directories each, apart from the second component down: every one
    a directory of its own, each path ~3 KB (under PATH_MAX with the staging prefix)."""
    return [f"{layer}/{n:04d}/" + "/".join(["d" * 14] * depth) + "/f" for n in range(count)]


def traced_peak(run) -> int:
    tracemalloc.start()
    try:
        run()
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak


def test_deep_paths_cost_restore_their_bytes_not_depth_squared(store, sqlite_index, fp, hello_pack, tmp_path):
    """Each directory of each path is made once, and nothing keeps a string per directory: restore
    had held every directory's full path (~320 KB for one path of 200 levels; a manifest at the cap,
    ~10,000 such paths, ~3 GB), where the manifest itself is ~3 KB a path."""
    paths = deep_paths("inductor", 64)
    evil = put_manifest(store, fp, [row(path, hello_pack) for path in paths])
    root = tmp_path / "root"
    results = []
    peak = traced_peak(lambda: results.append(restore(store, sqlite_index, fp, root, bundle_id=evil)))
    assert results[0].status == "hit" and (root / paths[-1]).read_bytes() == HELLO
    assert peak < 8 * 1024 * 1024  # measured ~20 MiB when a string of every directory was kept


def test_deep_paths_beside_an_index_file_cost_relocation_their_bytes(store, sqlite_index, fp, tmp_path):
    """Relocating a Triton group file looks its children up among the layer's files and directories
    without a string for every directory: it had held all of them (as make_tree did, ~320 KB for one
    200-level path), for any layer holding one index file."""
    group = canonical.dumps({"child_paths": {}})
    pack, _size, spots = put_pack(store, [(sha(HELLO), compress(HELLO), len(HELLO)),
                                          (sha(group), compress(group), len(group))])  # fmt: skip
    paths = deep_paths("triton", 64)
    rows = [[p, 0o644, len(HELLO), sha(HELLO), pack, *spots[0]] for p in paths]
    rows.append(["triton/k/__grp__add.json", 0o644, len(group), sha(group), pack, *spots[1]])
    evil = put_manifest(store, fp, sorted(rows), layers=("triton",))
    root = tmp_path / "root"
    results = []
    peak = traced_peak(lambda: results.append(restore(store, sqlite_index, fp, root, bundle_id=evil)))
    assert results[0].status == "hit" and (root / "triton/k/__grp__add.json").read_bytes() == group
    assert peak < 8 * 1024 * 1024  # measured ~20 MiB when every directory's path was kept


def test_a_manifest_listing_thousands_of_layers_is_refused(store, sqlite_index, fp, hello_pack, dirs):
    """Each layer a manifest lists becomes a Source, a prefix to check every path against and, for
    an extra layer, an export in kcache.env: 2 million names (32 MiB) took restore to 1.4 GiB and
    would have written an export each into the file the model's shell sources. A real bundle lists
    the built-in layers and a few extra directories."""
    root, outside = dirs
    names = [f"extra:x{n:05d}" for n in range(manifests.MAX_LAYERS + 1)]
    evil = put_manifest(store, fp, [row("inductor/a", hello_pack)], layers=["inductor", *names])
    with pytest.raises(IntegrityError, match=f"lists {manifests.MAX_LAYERS + 2} layers"):
        restore(store, sqlite_index, fp, root, bundle_id=evil)
    assert_nothing_happened(root, outside)
    assert "KCACHE_EXTRA_" not in (root / "kcache.env").read_text()


# ---- hostile restore roots -------------------------------------------------------------------------


@pytest.fixture
def bundle(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/a": b"new a", "inductor/sub/b": b"new b", "triton/k/t": b"kernel"})
    return publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})


def outside_dir(tmp_path: Path) -> tuple[Path, dict]:
    outside = tmp_path / "outside"
    write_tree(outside, {"theirs": b"not kcache's", "a": b"outside a"})
    return outside, read_tree(outside)


@pytest.mark.parametrize("layer", ["inductor", "triton"])
def test_layer_directory_that_is_a_link_outside_is_replaced_not_followed(tmp_path, bundle, store, sqlite_index,
                                                                          fp, layer):  # fmt: skip
    outside, before = outside_dir(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    (root / layer).symlink_to(outside)
    assert restore(store, sqlite_index, fp, root).status == "hit"
    assert read_tree(outside) == before
    assert not (root / layer).is_symlink()
    assert read_tree(root / "inductor") == {"a": (b"new a", 0o644), "sub/b": (b"new b", 0o644)}


def test_link_inside_a_retired_layer_is_not_followed_when_it_is_deleted(tmp_path, bundle, store, sqlite_index, fp):
    outside, before = outside_dir(tmp_path)
    root = tmp_path / "root"
    write_tree(root, OLD)
    (root / "inductor" / "escape").symlink_to(outside)
    restore(store, sqlite_index, fp, root)
    assert read_tree(outside) == before


def test_unused_layer_link_outside_gets_no_writes(tmp_path, bundle, store, sqlite_index, fp):
    outside, before = outside_dir(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    (root / "vllm").symlink_to(outside)  # the bundle has no vllm layer; restore only ensures it exists
    assert restore(store, sqlite_index, fp, root).status == "hit"
    assert read_tree(outside) == before


@pytest.mark.parametrize("outcome", ["hit", "miss"])
def test_layer_link_outside_a_group_shared_root_is_not_chmodded(tmp_path, store, sqlite_index, fp, outcome):
    """A setgid ROOT (fsGroup) makes restore chmod its layer directories: never through a link."""
    if outcome == "hit":
        write_tree(tmp_path / "src", {"inductor/a": b"new a"})
        publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    outside, before = outside_dir(tmp_path)
    outside.chmod(0o700)
    root = tmp_path / "root"
    root.mkdir()
    root.chmod(0o2775)
    (root / "vllm").symlink_to(outside)  # left by someone else; the bundle has no vllm layer
    assert restore(store, sqlite_index, fp, root).status == outcome
    assert stat.S_IMODE(outside.stat().st_mode) == 0o700
    assert read_tree(outside) == before


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("mode", [0o777, 0o666, 0o775, 0o646])
def test_manifest_cannot_ask_for_a_file_others_may_write(tmp_path, store, sqlite_index, fp, hello_pack, shared, mode):
    """The manifest's mode is the publisher's, but a file others (or the group) may rewrite is a kernel
    any user of the volume could replace: restore never lays one out."""
    root = tmp_path / "root"
    root.mkdir()
    if shared:
        root.chmod(0o2775)
    evil = put_manifest(store, fp, [row("inductor/ab/kernel.so", hello_pack, mode=mode)])
    old_umask = os.umask(0)  # nothing left for the umask to take away
    try:
        assert restore(store, sqlite_index, fp, root, bundle_id=evil).status == "hit"
    finally:
        os.umask(old_umask)
    got = stat.S_IMODE((root / "inductor/ab/kernel.so").stat().st_mode)
    assert got == mode & 0o755, oct(got)


def test_tmp_link_outside_is_refused_even_without_a_header_layer(tmp_path, bundle, store, sqlite_index, fp):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / "tmp").symlink_to(outside)
    with pytest.raises(UnsafePath, match="outside"):
        restore(store, sqlite_index, fp, root)
    assert list(outside.rglob("*")) == []


def test_dangling_layer_link_is_a_clear_error(tmp_path, bundle, store, sqlite_index, fp):
    root = tmp_path / "root"
    root.mkdir()
    (root / "cuda").symlink_to(tmp_path / "missing")
    try:
        restore(store, sqlite_index, fp, root)
    except KcacheError:
        pass
    assert not (tmp_path / "missing").exists()


def test_hard_link_to_a_file_outside_is_never_written_through(tmp_path, bundle, store, sqlite_index, fp):
    outside = tmp_path / "outside"
    write_tree(outside, {"a": b"outside a"})
    root = tmp_path / "root"
    (root / "inductor").mkdir(parents=True)
    os.link(outside / "a", root / "inductor" / "a")  # same name as a file the bundle restores
    assert restore(store, sqlite_index, fp, root).status == "hit"
    assert (outside / "a").read_bytes() == b"outside a"
    assert (root / "inductor/a").read_bytes() == b"new a"
    assert os.stat(outside / "a").st_nlink == 1


# ---- the parsers, fuzzed ---------------------------------------------------------------------------

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEX = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8),
                           kids, max_size=4), max_leaves=20)  # fmt: skip
path_parts = st.sampled_from(["inductor", "triton", "..", ".", "", "a", "b", "/", "\\", "\x00", "é", ".retired"])
paths = st.lists(path_parts, min_size=0, max_size=5).map("/".join) | st.text(max_size=20)
rows = st.lists(
    st.tuples(paths, st.integers(-1, 0o7777) | json_values, st.integers(-1, 10**6) | json_values,
              HEX | json_values, HEX, st.integers(-1, 10**6), st.integers(-1, 10**6)).map(list)
    | json_values,
    max_size=6,
)  # fmt: skip
near_manifests = st.fixed_dictionaries(
    {"schema": st.just(1) | json_values, "bundle_key": st.text(max_size=8), "toolchain_key": st.text(max_size=8),
     "workload_key": json_values, "facts": st.dictionaries(st.text(max_size=5), json_values, max_size=3) | json_values,
     "layers": st.lists(st.text(max_size=8), max_size=3) | json_values, "entries": rows}
)  # fmt: skip


def check_manifest_outcome(data: bytes) -> None:
    try:
        parsed = manifests.parse(data, sha(data))
    except (IntegrityError, UnsafePath):
        return
    seen = [e.path for e in parsed.entries]
    assert len(seen) == len(set(seen))
    for entry in parsed.entries:
        assert manifests.check_path(entry.path) == entry.path
        assert entry.mode & ~manifests.MODE_MASK == 0
        assert min(entry.size, entry.offset, entry.length) >= 0


@FUZZ
@given(doc=near_manifests | json_values)
def test_fuzz_manifest_parse_documents(doc):
    check_manifest_outcome(json.dumps(doc).encode())


@FUZZ
@given(data=st.binary(max_size=300))
def test_fuzz_manifest_parse_bytes(data):
    check_manifest_outcome(data)
    with pytest.raises(IntegrityError, match="hashes to"):
        manifests.parse(data, "0" * 64 if sha(data) != "0" * 64 else "1" * 64)


def _has_infinity(value) -> bool:
    if isinstance(value, float):
        return value in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return any(_has_infinity(v) for v in value)
    if isinstance(value, dict):
        return any(_has_infinity(v) for v in value.values())
    return False


trailer_docs = st.fixed_dictionaries(
    {"schema": st.just(1),
     "blobs": st.lists(st.lists(st.integers(-10, 10**4) | HEX | json_values, min_size=4, max_size=4) | json_values,
                       max_size=5) | json_values}
) | json_values  # fmt: skip


@FUZZ
@given(doc=trailer_docs, junk=st.binary(max_size=20), slack=st.integers(-50, 10**4), lie=st.integers(-3, 3))
def test_fuzz_parse_trailer(doc, junk, slack, lie):
    trailer = json.dumps(doc).encode()
    tail = junk + trailer + packs.FOOTER.pack(max(0, len(trailer) + lie)) + packs.MAGIC
    check_trailer(tail, len(tail) + slack)


@FUZZ
@given(tail=st.binary(max_size=200), pack_size=st.integers(0, 10**6))
def test_fuzz_parse_trailer_bytes(tail, pack_size):
    check_trailer(tail, pack_size)
    check_trailer(tail + packs.MAGIC, pack_size)


def check_trailer(tail: bytes, pack_size: int) -> None:
    try:
        blobs = packs.parse_trailer("p" * 64, tail, pack_size)
    except IntegrityError:
        return
    body_end = pack_size - packs.FOOTER_SIZE
    for blob in blobs:
        assert 0 <= blob.offset and 0 <= blob.length and 0 <= blob.size and blob.offset + blob.length <= body_end


def test_trailer_with_infinite_offset_is_an_integrity_error():
    trailer = b'{"blobs":[["b",1e999,1,1]],"schema":1}'
    tail = trailer + packs.FOOTER.pack(len(trailer)) + packs.MAGIC
    with pytest.raises(IntegrityError):
        packs.parse_trailer("p" * 64, tail, len(tail))


@pytest.mark.parametrize("parser", ["manifest", "trailer"])
def test_deeply_nested_json_is_an_integrity_error(parser):
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(IntegrityError):
        if parser == "manifest":
            manifests.parse(deep, sha(deep))
        else:
            packs.parse_trailer("p" * 64, deep + packs.FOOTER.pack(len(deep)) + packs.MAGIC, 10**7)


class Counting(io.RawIOBase):
    def __init__(self):
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.written += len(data)
        return len(data)


def frames():
    content = st.binary(max_size=2000)
    real = content.map(compress)
    damaged = st.tuples(real, st.integers(0, 2000), st.integers(0, 255)).map(
        lambda t: t[0][: t[1] % (len(t[0]) + 1)] + bytes([t[2]]) + t[0][t[1] % (len(t[0]) + 1) + 1 :]
    )
    concatenated = st.tuples(real, real).map(lambda t: t[0] + t[1])
    return st.binary(max_size=300) | real | damaged | concatenated | st.sampled_from([compress(bytes(10**6))])


@FUZZ
@given(frame=frames(), size=st.integers(0, 3000), blob=HEX | st.sampled_from(["", "zz"]))
def test_fuzz_unpack_to(frame, size, blob):
    out = Counting()
    try:
        packs.unpack_to(io.BytesIO(frame), blob, size, out)
    except IntegrityError:
        pass
    assert out.written <= size


@FUZZ
@given(content=st.binary(max_size=3000), extra=st.binary(min_size=1, max_size=50))
def test_fuzz_unpack_to_accepts_exactly_the_right_content(content, extra):
    out = io.BytesIO()
    packs.unpack_to(io.BytesIO(compress(content)), sha(content), len(content), out)
    assert out.getvalue() == content
    with pytest.raises(IntegrityError):
        packs.unpack_to(io.BytesIO(compress(content + extra)), sha(content), len(content), io.BytesIO())
