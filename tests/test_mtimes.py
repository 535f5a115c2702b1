"""Manifest schema 2: every file's modification time travels, and restore gives it back.

Builders that decide "up to date" by mtime (ninja under torch.utils.cpp_extension, FlashInfer's JIT)
rebuild everything when a restore stamps files with the time of writing.
"""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import write_tree

from kcache import canonical, fingerprint, sources
from kcache import manifest as m
from kcache.errors import IntegrityError
from kcache.index import Index
from kcache.publish import publish
from kcache.restore import restore
from kcache.store.local import LocalStore

BLOB = "b" * 64
PACK = "c" * 64


def test_schema_2_round_trips_mtime_and_layer_info():
    built = m.build("bk", "tk", "wk", {}, ["inductor-pch"], [m.Entry("inductor-pch/h", 0o644, 3, BLOB, PACK, 0, 10,
                    1_700_000_000_123_456_789)], {"inductor-pch": {"user": "root"}})  # fmt: skip
    parsed = m.parse(built.to_bytes(), built.id)
    assert parsed == built and parsed.entries[0].mtime_ns == 1_700_000_000_123_456_789
    assert parsed.layer_info == {"inductor-pch": {"user": "root"}}


def test_golden_schema_3_bytes():
    """Pins the canonical bytes: a refactor that changes them changes every bundle id."""
    built = m.build("bk", "tk", "wk", {"os": "linux"}, ["triton"],
                    [m.Entry("triton/k/a.cubin", 0o644, 3, BLOB, PACK, 0, 10, 1_700_000_000_000_000_001)],
                    {"inductor-pch": {"user": "root"}})  # fmt: skip
    assert built.to_bytes() == (
        b'{"bundle_key":"bk","chunks":{},"entries":[["triton/k/a.cubin",420,3,"'
        + BLOB.encode()
        + b'","'
        + PACK.encode()
        + b'",0,10,1700000000000000001]],"facts":{"os":"linux"},"layer_info":{"inductor-pch":{"user":"root"}},'
        b'"layers":["triton"],"schema":3,"toolchain_key":"tk","workload_key":"wk"}'
    )
    assert built.id == canonical.sha256(built.to_bytes())


def test_schema_2_manifests_still_parse_and_keep_their_id():
    """Bundles published before chunk digests (schema 3) still restore: their large blobs are verified whole."""
    data = (b'{"bundle_key":"bk","entries":[["triton/k/a.cubin",420,3,"' + BLOB.encode() + b'","' + PACK.encode()
            + b'",0,10,1700000000000000001]],"facts":{"os":"linux"},"layer_info":{"inductor-pch":{"user":"root"}},'
            b'"layers":["triton"],"schema":2,"toolchain_key":"tk","workload_key":"wk"}')  # fmt: skip
    parsed = m.parse(data, canonical.sha256(data))
    assert parsed.schema == 2 and parsed.chunks == {} and parsed.to_bytes() == data
    assert parsed.entries[0].mtime_ns == 1_700_000_000_000_000_001


def test_schema_1_manifests_still_parse_and_keep_their_id():
    data = canonical.dumps({"schema": 1, "bundle_key": "bk", "toolchain_key": "tk", "workload_key": "wk",
                            "facts": {}, "layers": ["inductor"],
                            "entries": [["inductor/a", 420, 3, BLOB, PACK, 0, 10]]})  # fmt: skip
    parsed = m.parse(data, canonical.sha256(data))
    assert parsed.id == canonical.sha256(data) and parsed.to_bytes() == data
    assert parsed.entries[0].mtime_ns is None and parsed.layer_info == {}


def _schema_2(rows, layer_info=None) -> bytes:
    doc = {"schema": 2, "bundle_key": "bk", "toolchain_key": "tk", "workload_key": "wk", "facts": {},
           "layers": ["inductor"], "entries": rows}  # fmt: skip
    if layer_info is not None:
        doc["layer_info"] = layer_info
    return canonical.dumps(doc)


@pytest.mark.parametrize(
    "data",
    [
        _schema_2([["inductor/a", 420, 3, BLOB, PACK, 0, 10]]),  # a schema 1 row in a schema 2 manifest
        _schema_2([["inductor/a", 420, 3, BLOB, PACK, 0, 10, -1]]),
        _schema_2([["inductor/a", 420, 3, BLOB, PACK, 0, 10, True]]),
        _schema_2([["inductor/a", 420, 3, BLOB, PACK, 0, 10, 1.5]]),
        _schema_2([["inductor/a", 420, 3, BLOB, PACK, 0, 10, 2**64]]),
        _schema_2([["inductor/a", 420, 3, BLOB, PACK, 0, 10, 1, "extra"]]),
        _schema_2([], {"inductor-pch": {"user": 0}}),
        _schema_2([], {"inductor-pch": "root"}),
        _schema_2([], ["root"]),
        canonical.dumps({"schema": True, "entries": []}),
    ],
    ids=[
        "short-row",
        "negative",
        "bool",
        "float",
        "huge",
        "long-row",
        "info-int",
        "info-str",
        "info-list",
        "bool-schema",
    ],
)
def test_hostile_schema_2_manifests_are_refused(data):
    with pytest.raises(IntegrityError):
        m.parse(data, canonical.sha256(data))


# From 1990 to 2023, in nanoseconds: times in the past travel as they were (later ones move back
# together to the restore's time: tests/test_publish_restore.py).
mtimes = st.integers(min_value=631_152_000 * 10**9, max_value=1_700_000_000 * 10**9)


@settings(max_examples=10, deadline=None)
@given(times=st.lists(mtimes, min_size=3, max_size=3))
def test_restore_gives_every_file_its_published_mtime(tmp_path_factory, times):
    base = tmp_path_factory.mktemp("mtimes")
    store, root = base / "store", base / "src"
    # Two files share a blob (the second is written as a copy), one is a Triton group (rewritten).
    files = {"triton/k/a.cubin": b"same", "triton/k/b.cubin": b"same",
             "triton/k/__grp__a.json": b'{"child_paths": {"a.cubin": "/pub/k/a.cubin"}}'}  # fmt: skip
    write_tree(root, files)
    for rel, ns in zip(files, times):
        os.utime(root / rel, ns=(ns, ns))
    fp = fingerprint.compute({"gpu.name": "none"})
    index = Index.open(f"sqlite:///{base / 'index.db'}")
    try:
        publish(LocalStore(store), index, fp, sources.select(["triton"]), root=root, env={})
        restore(LocalStore(store), index, fp, base / "dst")
    finally:
        index.close()
    assert [(base / "dst" / rel).stat().st_mtime_ns for rel in files] == times
    assert b"/dst/triton/k/a.cubin" in (base / "dst/triton/k/__grp__a.json").read_bytes()
