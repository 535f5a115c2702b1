"""The store contract, run against every backend."""

import pytest

from kcache.errors import ObjectMissing, ObjectTooLarge, StoreError


def test_put_get_roundtrip(any_store, tmp_path):
    assert any_store.put_bytes("packs/ab/abc", b"hello") is True
    assert any_store.get_bytes("packs/ab/abc") == b"hello"
    assert any_store.size("packs/ab/abc") == 5
    assert any_store.exists("packs/ab/abc")


def test_put_is_create_if_absent(any_store, tmp_path):
    any_store.put_bytes("manifests/aa/one", b"first")
    src = tmp_path / "f"
    src.write_bytes(b"second")
    assert any_store.put_file("manifests/aa/one", src) is False
    assert any_store.get_bytes("manifests/aa/one") == b"first"


def test_open_range_reads_exactly_the_window(any_store):
    any_store.put_bytes("packs/00/p", bytes(range(100)))
    with any_store.open_range("packs/00/p", 10, 5) as stream:
        assert stream.read() == bytes(range(10, 15))
        assert stream.read() == b""


def test_missing_objects_raise_object_missing(any_store):
    with pytest.raises(ObjectMissing):
        any_store.get_bytes("packs/00/nope")
    with pytest.raises(ObjectMissing):
        any_store.open_range("packs/00/nope", 0, 1)
    with pytest.raises(ObjectMissing):
        any_store.size("packs/00/nope")
    assert not any_store.exists("packs/00/nope")


def test_list_and_delete(any_store):
    for key in ("packs/aa/1", "packs/bb/2", "manifests/cc/3"):
        any_store.put_bytes(key, b"x")
    assert sorted(o.key for o in any_store.list("packs/")) == ["packs/aa/1", "packs/bb/2"]
    any_store.delete("packs/aa/1")
    any_store.delete("packs/aa/1")  # idempotent
    assert sorted(o.key for o in any_store.list("packs/")) == ["packs/bb/2"]


@pytest.mark.parametrize("key", ["../escape", "/abs", "a/../b", "a//b", ""])
def test_invalid_keys_are_refused(any_store, key):
    with pytest.raises(StoreError):
        any_store.put_bytes(key, b"x")


def test_list_reports_size_and_time(any_store):
    any_store.put_bytes("manifests/ab/m", b"12345")
    (info,) = any_store.list("manifests/")
    assert (info.key, info.size) == ("manifests/ab/m", 5) and info.modified.tzinfo is not None


def test_compare_and_swap(any_store):
    assert any_store.get_versioned("refs/k") is None
    assert any_store.put_if("refs/k", b"one", None) is True
    assert any_store.put_if("refs/k", b"again", None) is False  # it exists now
    data, version = any_store.get_versioned("refs/k")
    assert data == b"one"
    assert any_store.put_if("refs/k", b"two", version) is True
    assert any_store.put_if("refs/k", b"stale", version) is False  # version moved on
    assert any_store.get_versioned("refs/k")[0] == b"two"


def test_a_versioned_read_over_its_limit_is_refused(any_store):
    any_store.put_if("refs/k", b"x" * 100, None)
    assert any_store.get_versioned("refs/k", limit=100)[0] == b"x" * 100
    with pytest.raises(ObjectTooLarge):
        any_store.get_versioned("refs/k", limit=99)
    assert any_store.get_versioned("refs/absent", limit=10) is None
