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


def _whole_document(manifest: m.Manifest) -> bytes:
    """The canonical form written the plain way: one document, one dumps."""
    doc = {"schema": manifest.schema, "bundle_key": manifest.bundle_key, "toolchain_key": manifest.toolchain_key,
           "workload_key": manifest.workload_key, "facts": dict(manifest.facts), "layers": list(manifest.layers),
           "entries": [e.as_row(manifest.schema) for e in manifest.entries]}  # fmt: skip
    if manifest.schema >= 2:
        doc["layer_info"] = {name: dict(info) for name, info in manifest.layer_info.items()}
    return canonical.dumps(doc)


@pytest.mark.parametrize("count", [0, 1, m._ROWS_PER_PIECE, m._ROWS_PER_PIECE + 1, 3 * m._ROWS_PER_PIECE - 7])
def test_the_pieces_are_the_one_canonical_document(count):
    entries = [m.Entry(f"inductor/é/{i:05d}", 0o644, i, BLOB, PACK, i * 10, 10, 10**18 + i) for i in range(count)]
    built = m.build("bk", "tk", "wk", {"os": "linux", "z": "ü"}, ["inductor"], entries, {"inductor": {"k": "v"}})
    assert built.to_bytes() == _whole_document(built)
    parsed = m.parse(built.to_bytes(), built.id)
    assert parsed == built and parsed.id == built.id
    assert parsed.to_bytes() == built.to_bytes()  # rebuilt on demand: a parsed manifest does not keep its bytes
    schema1 = m.Manifest("bk", "tk", "wk", {"os": "linux"}, ("inductor",), tuple(built.entries), {}, 1)
    assert schema1.to_bytes() == _whole_document(schema1)


def test_a_manifest_that_differs_only_past_the_first_piece_is_not_canonical():
    entries = [m.Entry(f"inductor/{i:05d}", 0o644, 1, BLOB, PACK, i, 1, 0) for i in range(m._ROWS_PER_PIECE + 5)]
    data = manifest_of(*entries).to_bytes()
    row = f'"inductor/{m._ROWS_PER_PIECE + 2:05d}",420'.encode()
    spaced = data.replace(row, row.replace(b",", b", "), 1)
    assert spaced != data
    with pytest.raises(IntegrityError, match="canonical"):
        m.parse(spaced, canonical.sha256(spaced))
    longer = data + b" "
    with pytest.raises(IntegrityError, match="canonical|parse"):
        m.parse(longer, canonical.sha256(longer))


@pytest.mark.parametrize("paths", [[], ["inductor/a"], [f"inductor/ü/{i}" for i in range(50)]])
def test_least_size_is_a_bound_that_single_digit_numbers_reach(paths):
    head = manifest_of()
    least = m.build("bk", "tk", "wk", {"os": "linux"}, ["inductor"],
                    [m.Entry(p, 0, 0, BLOB, PACK, 0, 0, 0) for p in paths])  # fmt: skip
    assert m.least_size(head, paths) == len(least.to_bytes())
    real = manifest_of(*(m.Entry(p, 0o644, 12345, BLOB, PACK, 99999, 10, 10**18) for p in paths))
    assert m.least_size(head, paths) <= len(real.to_bytes())


_ROW_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(_ROW_TEXT, st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1)), max_size=40),
       per_piece=st.integers(1, 7), facts=st.dictionaries(_ROW_TEXT, _ROW_TEXT, max_size=4))  # fmt: skip
def test_pieces_join_to_the_one_document_for_any_rows_and_any_piece_size(rows, per_piece, facts):
    entries = [m.Entry(f"inductor/{i}/{text}", 0o644, size, BLOB, PACK, offset, 1, size)
               for i, (text, size, offset) in enumerate(rows)]  # fmt: skip
    built = m.Manifest("bk", "tk", "wk", facts, ("inductor",), tuple(entries), {"inductor": facts})
    whole = _whole_document(built)
    assert b"".join(built.pieces(per_piece)) == whole
    assert m._same_bytes(built.pieces(per_piece), whole)
    assert not m._same_bytes(built.pieces(per_piece), whole[:-1]) and not m._same_bytes(built.pieces(per_piece),
                                                                                          whole + b"}")  # fmt: skip
