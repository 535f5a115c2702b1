import io
import os

import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from kcache import canonical, packs
from kcache.errors import FileChanged, IntegrityError


def _pack(tmp_path, contents: list[bytes]) -> packs.Pack:
    writer = packs.PackWriter(tmp_path)
    for i, data in enumerate(contents):
        src = tmp_path / f"src{i}"
        src.write_bytes(data)
        writer.add(canonical.sha256(data), src, len(data))
    return writer.finish()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.binary(max_size=5000), max_size=12))
def test_pack_roundtrip_through_trailer(tmp_path_factory, contents):
    tmp = tmp_path_factory.mktemp("pack")
    pack = _pack(tmp, contents)
    raw = pack.path.read_bytes()
    assert pack.id == canonical.sha256(raw)
    blobs = packs.parse_trailer(pack.id, raw, len(raw))
    assert [b.id for b in blobs] == [canonical.sha256(c) for c in contents]
    for blob, data in zip(blobs, contents):
        out = io.BytesIO()
        packs.unpack_to(io.BytesIO(raw[blob.offset : blob.offset + blob.length]), blob.id, blob.size, out)
        assert out.getvalue() == data


@settings(max_examples=20, deadline=None)
@given(contents=st.lists(st.binary(max_size=3000), max_size=40), threads=st.integers(1, 3))
def test_a_batch_of_small_files_packs_each_as_its_own_frame(tmp_path_factory, contents, threads, monkeypatch_batch):
    """add_small compresses batches in one call (several batches here, empty files among them):
    every blob must still be its own frame, at the offset the trailer gives, holding its file."""
    tmp = tmp_path_factory.mktemp("batch")
    files = []
    for i, data in enumerate(contents):
        (tmp / f"src{i}").write_bytes(data)
        files.append((canonical.sha256(data), tmp / f"src{i}", len(data)))
    writer = packs.PackWriter(tmp)
    writer.add_small(files, threads)
    pack = writer.finish()
    raw = pack.path.read_bytes()
    blobs = packs.parse_trailer(pack.id, raw, len(raw))
    assert [b.id for b in blobs] == [f[0] for f in files]
    for blob, data in zip(blobs, contents):
        assert packs.unpack_bytes(raw[blob.offset : blob.offset + blob.length], blob.id, blob.size) == data


@pytest.fixture(scope="module")
def monkeypatch_batch():
    """Batches of a few KiB, so that a handful of small files spans several compression calls."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(packs, "SMALL_BATCH_BYTES", 4096)
        yield


def test_a_file_changed_in_a_batch_is_refused(tmp_path):
    files = []
    for i in range(5):
        (tmp_path / f"src{i}").write_bytes(b"x" * i)
        files.append((canonical.sha256(b"x" * i), tmp_path / f"src{i}", i))
    (tmp_path / "src3").write_bytes(b"yyy")  # same size, other bytes
    writer = packs.PackWriter(tmp_path)
    with pytest.raises(FileChanged, match="src3.*changed"):
        writer.add_small(files, 2)
    writer.discard()


def test_file_changed_after_hashing_is_refused(tmp_path):
    src = tmp_path / "f"
    src.write_bytes(b"before")
    writer = packs.PackWriter(tmp_path)
    with pytest.raises(FileChanged, match="changed"):
        writer.add(canonical.sha256(b"other!"), src, 6)
    writer.discard()


@pytest.mark.parametrize("change", ["removed", "now a link"])
def test_file_removed_or_swapped_for_a_link_after_hashing_is_refused(tmp_path, change):
    src, secret = tmp_path / "f", tmp_path / "secret"
    src.write_bytes(b"before")
    secret.write_bytes(b"before")  # the same bytes: only the link itself gives it away
    src.unlink()
    if change == "now a link":
        src.symlink_to(secret)
    writer = packs.PackWriter(tmp_path)
    with pytest.raises(FileChanged, match="changed"):
        writer.add(canonical.sha256(b"before"), src, 6)
    assert writer.blob_count == 0
    writer.discard()


def test_blob_that_decompresses_past_its_size_is_refused():
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 1_000_000)
    with pytest.raises(IntegrityError, match="past its declared"):
        packs.unpack_to(io.BytesIO(bomb), canonical.sha256(b"\0" * 10), 10, io.BytesIO())


def test_frame_asking_for_a_huge_window_is_refused_before_it_is_decoded():
    data = os.urandom(1024 * 1024) * 20
    params = zstandard.ZstdCompressionParameters.from_level(1, window_log=24, write_content_size=True)
    frame = zstandard.ZstdCompressor(compression_params=params).compress(data)
    assert zstandard.get_frame_parameters(frame).window_size > packs.MAX_WINDOW
    with pytest.raises(IntegrityError, match="not a valid zstd frame"):
        packs.unpack_to(io.BytesIO(frame), canonical.sha256(data), len(data), io.BytesIO())


def test_our_own_frames_fit_the_window_limit(tmp_path):
    src = tmp_path / "big"
    src.write_bytes(os.urandom(1024 * 1024) * 24)  # larger than any window: the compressor picks its own
    writer = packs.PackWriter(tmp_path)
    writer.add(canonical.sha256(src.read_bytes()), src, src.stat().st_size)
    pack = writer.finish()
    (blob,) = pack.blobs
    frame = pack.path.read_bytes()[blob.offset : blob.offset + blob.length]
    assert zstandard.get_frame_parameters(frame).window_size <= packs.MAX_WINDOW
    out = io.BytesIO()
    packs.unpack_to(io.BytesIO(frame), blob.id, blob.size, out)
    assert out.getvalue() == src.read_bytes()


def test_blob_with_wrong_content_is_refused():
    frame = zstandard.ZstdCompressor().compress(b"evil")
    with pytest.raises(IntegrityError, match="hashes to"):
        packs.unpack_to(io.BytesIO(frame), canonical.sha256(b"good"), 4, io.BytesIO())


def test_garbage_frame_is_refused():
    with pytest.raises(IntegrityError):
        packs.unpack_to(io.BytesIO(b"not zstd at all"), canonical.sha256(b"x"), 1, io.BytesIO())


def test_trailer_with_offsets_past_the_body_is_refused():
    trailer = canonical.dumps({"schema": 1, "blobs": [["a" * 64, 0, 999, 5]]})
    tail = trailer + packs.FOOTER.pack(len(trailer)) + packs.MAGIC
    with pytest.raises(IntegrityError, match="outside"):
        packs.parse_trailer("p", tail, len(tail))


def test_missing_footer_is_refused():
    with pytest.raises(IntegrityError, match="footer"):
        packs.parse_trailer("p", b"random bytes with no footer", 27)
