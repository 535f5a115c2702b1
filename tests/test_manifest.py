import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcache import canonical
from kcache import manifest as m
from kcache.errors import IntegrityError, UnsafePath

BLOB = "b" * 64
PACK = "c" * 64


def entry(path: str, mode: int = 0o644) -> m.Entry:
    return m.Entry(path, mode, 3, BLOB, PACK, 0, 10)


def manifest_of(*entries: m.Entry) -> m.Manifest:
    return m.build("bk", "tk", "wk", {"os": "linux"}, ["inductor"], entries)


def test_roundtrip_and_id():
    built = manifest_of(entry("inductor/b"), entry("inductor/a", 0o755))
    parsed = m.parse(built.to_bytes(), built.id)
    assert parsed == built
    assert [e.path for e in parsed.entries] == ["inductor/a", "inductor/b"]


@settings(max_examples=50, deadline=None)
@given(st.permutations([f"inductor/{c}" for c in "abcdefg"]))
def test_serialization_does_not_depend_on_input_order(paths):
    assert manifest_of(*map(entry, paths)).to_bytes() == manifest_of(*map(entry, sorted(paths))).to_bytes()


@pytest.mark.parametrize(
    "path", ["/etc/passwd", "../x", "inductor/../../x", "a//b", "./a", "a/./b", "", "a\\b", "a\x00b"]
)
def test_unsafe_paths_are_refused(path):
    with pytest.raises(UnsafePath):
        manifest_of(entry(path))


def _tampered(doc_rows) -> bytes:
    return canonical.dumps({"schema": 1, "bundle_key": "bk", "toolchain_key": "tk", "workload_key": "wk",
                            "facts": {}, "layers": ["inductor"], "entries": doc_rows})  # fmt: skip


@pytest.mark.parametrize(
    "rows",
    [
        [["../../etc/cron.d/x", 420, 3, BLOB, PACK, 0, 10]],
        [["inductor/a", 420, 3, BLOB, PACK, 0, 10], ["inductor/a", 420, 3, BLOB, PACK, 0, 10]],
        [["inductor/a", 420, 3, BLOB, PACK, 0, 10], ["inductor/a/b", 420, 3, BLOB, PACK, 0, 10]],
        [["inductor/a", 0o4755, 3, BLOB, PACK, 0, 10]],
        [["inductor/a", 420, -1, BLOB, PACK, 0, 10]],
        [["inductor/a", 420, 3, "not-a-hash", PACK, 0, 10]],
        [["inductor/a", 420, 3, BLOB, PACK, 0]],
    ],
    ids=["dotdot", "duplicate", "file-as-dir", "setuid", "negative-size", "bad-blob", "short-row"],
)
def test_hostile_manifests_are_refused(rows):
    data = _tampered(rows)
    with pytest.raises((UnsafePath, IntegrityError)):
        m.parse(data, canonical.sha256(data))


def test_manifest_that_does_not_match_its_id_is_refused():
    built = manifest_of(entry("inductor/a"))
    with pytest.raises(IntegrityError, match="hashes to"):
        m.parse(built.to_bytes().replace(b"inductor/a", b"inductor/b"), built.id)


def test_only_the_canonical_form_parses():
    """Stored under its own hash but spaced out: its id from the fields would differ from the stored one."""
    data = manifest_of(entry("inductor/a")).to_bytes()
    spaced = data.replace(b",", b", ", 1)
    with pytest.raises(IntegrityError, match="canonical"):
        m.parse(spaced, canonical.sha256(spaced))


def test_text_no_manifest_can_hold_is_refused_not_a_crash():
    data = manifest_of(entry("inductor/a")).to_bytes()
    lone_surrogate = data.replace(b'"model.id"', b'"model.id\\ud800"') if b'"model.id"' in data else None
    hostile = lone_surrogate or data.replace(b'"layers":[', b'"layers":["\\ud800",', 1)
    with pytest.raises(IntegrityError, match="holds text"):
        m.parse(hostile, canonical.sha256(hostile))
