
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kcache import canonical
from kcache import manifest as m
from kcache.errors import IntegrityError, UnsafePath
from kcache.packs import CHUNK_BYTES

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
    if manifest.schema >= 3:
        doc["chunks"] = {blob: list(digests) for blob, digests in manifest.chunks.items()}
    return canonical.dumps(doc)


@pytest.mark.parametrize("count", [0, 1, m._ROWS_PER_PIECE, m._ROWS_PER_PIECE + 1, 3 * m._ROWS_PER_PIECE - 7])
def test_the_pieces_are_the_one_canonical_document(count):
    entries = [m.Entry(f"inductor/é/{i:05d}", 0o644, i, f"{i:064x}", PACK, i * 10, 10, 10**18 + i)
               for i in range(count)]  # fmt: skip
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


# ---- path caps and the cost of path checks: a planted manifest must not make a parser hang ----------


def _stored(*paths: str) -> tuple[bytes, str]:
    data = _tampered([[p, 420, 3, BLOB, PACK, 0, 10] for p in paths])
    return data, canonical.sha256(data)


def _longest(size: int, char: str = "k") -> str:
    """The longest path under inductor/ of `char`s, in names of about 100 (a name is 255 bytes at
    most), that is at most `size` UTF-8 bytes."""
    path = "inductor/"
    while True:
        name = path.rsplit("/", 1)[-1]
        steps = ("/" + char, char) if len(name) >= 100 else (char,)
        step = next((s for s in steps if len((path + s).encode()) <= size), None)
        if step is None:
            return path
        path += step


@pytest.mark.parametrize("char", ["k", "é"])
def test_a_path_over_4096_bytes_is_refused_naming_its_entry(char):
    at_cap = _longest(4096, char)
    assert 4095 <= len(at_cap.encode()) <= 4096
    m.parse(*_stored("inductor/a", at_cap))
    over = at_cap + "é"  # over in UTF-8 bytes; with "é", still well under 4096 characters
    refused = r"entry 1 \('inductor/(k|é)+.*\) is a path of 409[78] (bytes|characters), over the 4096"
    with pytest.raises(IntegrityError, match=refused):
        m.parse(*_stored("inductor/a", over))
    with pytest.raises(IntegrityError) as caught:
        m.parse(*_stored(over))
    assert len(str(caught.value)) < 600  # names the entry without quoting all of it


def test_a_path_of_more_than_256_components_is_refused_naming_its_entry():
    deepest = "inductor/" + "a/" * 254 + "f"
    assert deepest.count("/") + 1 == 256
    m.parse(*_stored(deepest))
    deeper = "inductor/" + "a/" * 255 + "f"
    with pytest.raises(IntegrityError, match=r"entry 0 \('inductor/a/a/.*\) has 257 components.* 256"):
        m.parse(*_stored(deeper))


def test_build_refuses_paths_over_the_caps_too():
    with pytest.raises(UnsafePath, match="4096"):
        manifest_of(entry(_longest(4097)))
    with pytest.raises(UnsafePath, match="256"):
        manifest_of(entry("inductor/" + "a/" * 300 + "f"))


def test_the_planted_manifest_of_a_million_components_is_refused_at_once():
    """The report's repro: one 2 MB path of `a/` components, well under the manifest cap; reindex,
    restore and gc all parse it. Refused by the caps before any path check (those used to take hours)."""
    data, manifest_id = _stored("inductor/" + "a/" * 1_000_000 + "f")
    with pytest.raises(IntegrityError, match="entry 0"):
        m.parse(data, manifest_id)


def _naive_problems(paths: list[str]) -> set[str]:
    """What the checks must find, the obvious quadratic way."""
    found = set()
    if len(set(paths)) < len(paths):
        found.add("twice")
    files = set(paths)
    for path in paths:
        parts = path.split("/")
        if any("/".join(parts[:i]) in files for i in range(1, len(parts))):
            found.add("parent")
    return found


# Components that sort around "/" ("!" and "." before it, "0" after), so that a file's children are
# not its neighbours in the sorted order.
_COMPONENTS = st.sampled_from(["a", "a!", "a.b", "a0", "b"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_COMPONENTS, min_size=1, max_size=4).map("/".join), max_size=8))
def test_duplicate_and_file_as_directory_checks_agree_with_the_naive_ones(paths):
    entries = tuple(entry(f"inductor/{p}") for p in paths)
    expected = _naive_problems([e.path for e in entries])
    if not expected:
        m._check_entries(entries)
        return
    with pytest.raises(UnsafePath) as caught:
        m._check_entries(entries)
    assert ("twice" if "appears twice" in caught.value.why else "parent") in expected


BIG = "d" * 64


def _big_manifest(digests) -> m.Manifest:
    entries = [m.Entry("tmp/h.gch", 0o644, 2 * CHUNK_BYTES + 1, BIG, PACK, 0, 100, 0),
               m.Entry("inductor/a", 0o644, 1, BLOB, PACK, 100, 10, 0)]  # fmt: skip
    return m.Manifest("bk", "tk", "wk", {"os": "linux"}, ("inductor",), tuple(entries), chunks={BIG: tuple(digests)})


def test_chunk_digests_of_a_large_blob_round_trip():
    built = m.build("bk", "tk", "wk", {"os": "linux"}, ["inductor"], _big_manifest(()).entries,
                    chunks={BIG: ["1" * 64, "2" * 64, "3" * 64]})  # fmt: skip
    assert built.to_bytes() == _whole_document(built)
    assert m.parse(built.to_bytes(), built.id).chunks == {BIG: ("1" * 64, "2" * 64, "3" * 64)}


@pytest.mark.parametrize("digests, why", [
    (["1" * 64, "2" * 64], "has 2 chunk digests, not 3"),  # one short: a part would go unverified
    (["1" * 64] * 4, "has 4 chunk digests"),
    (["1" * 64, "2" * 64, "X" * 64], "not all SHA-256"),
    (["1" * 64, "2" * 64, 3], "not all SHA-256"),
])  # fmt: skip
def test_a_manifest_whose_chunk_digests_do_not_fit_its_blob_is_refused(digests, why):
    data = _big_manifest(["0" * 64] * 3).to_bytes().replace(canonical.dumps(["0" * 64] * 3), canonical.dumps(digests))
    with pytest.raises(IntegrityError, match=why):
        m.parse(data, canonical.sha256(data))


def test_chunk_digests_for_a_blob_no_entry_holds_are_refused():
    data = _big_manifest(["0" * 64] * 3).to_bytes().replace(BIG.encode() + b'":', b"e" * 64 + b'":')
    with pytest.raises(IntegrityError, match="which no entry holds"):
        m.parse(data, canonical.sha256(data))


def test_a_schema_3_manifest_without_chunks_is_refused():
    data = _big_manifest(["0" * 64] * 3).to_bytes().replace(b'"chunks":', b'"chunkz":')
    with pytest.raises(IntegrityError, match="does not parse"):
        m.parse(data, canonical.sha256(data))
