"""Golden bytes of what kcache writes to the store and hashes or signs: manifests, the signature
message, refs and pack trailers.

These bytes are already in buckets. A refactor that changes them by accident changes every
manifest id, invalidates every signature or makes old packs unreadable, and no other test notices.
If the change is intended: bump that format's schema number, write the change in docs/design.md
(Store and index), and replace the expected hex below with the one the failure prints.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timezone

import pytest

from kcache import manifest as manifests
from kcache import packs, refs, signing

BLOB_A, BLOB_B, PACK, BLOB_D = ("a" * 64), ("b" * 64), ("c" * 64), ("d" * 64)
CREATED = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
EXPIRES = datetime(2026, 1, 9, 3, 4, 5, tzinfo=timezone.utc)
SEED = bytes(range(32))  # a fixed Ed25519 key: its signatures are deterministic


def manifest_fixture() -> manifests.Manifest:
    """The one fixed manifest. A new entry field goes here too (and changes MANIFEST below)."""
    return manifests.build(
        "k" * 32, "t" * 32, "w" * 32, {"gpu.sm": "sm_90", "model.id": "m@1", "torch.version": "2.13.0"},
        ["triton", "inductor"],
        [manifests.Entry("triton/k/k.cubin", 0o644, 5, BLOB_B, PACK, 17, 20),
         manifests.Entry("inductor/fxgraph/g", 0o755, 3, BLOB_A, PACK, 0, 17),
         manifests.Entry("tmp/pch/h.gch", 0o644, packs.CHUNK_BYTES + 1, BLOB_D, PACK, 37, 900)],
        chunks={BLOB_D: ("e" * 64, "f" * 64)},
    )  # fmt: skip


def ref_fixture() -> refs.Ref:
    unsigned = refs.Ref("k" * 32, "d" * 64, CREATED, generation=7, expires=EXPIRES, yanked=("e" * 64,))
    key = signing.SigningKey("golden", SEED)
    return refs.Ref(**{**unsigned.__dict__, "signatures": (("golden", signing.sign_message(key, unsigned.message())),)})


MANIFEST = "dbda771aee59fbf1685d408035c32ff1d20a238ba011bdfcbba7976341e3f50b"
SIGNATURE_MESSAGE = "2ab721d05feb7b5e54cbdd9d59291f3ffe469e61d0c145537220706a6030363d"
REF = "5722682cb5c99e9d306252ab55c3b64706c4a1dd03fdd9164f3b6e9be71af2b8"
TRAILER = "7506da4224a201d1388b4ab2647a45db32c14a15c8a3c4f774f4fbc1b970adb6"
# Schema 1 (before chunked blobs): packs already in buckets with it must stay readable.
_V1_BODY = b'{"blobs":[["' + BLOB_A.encode() + b'",0,17,3]],"schema":1}'
TRAILER_V1 = _V1_BODY + len(_V1_BODY).to_bytes(8, "big") + b"KCPACK1\n"
SEEK_TABLE = "4ec954f7fa95bd8c0594707e5f0c175819926a0786443753e0e99295ad6ee786"

GOLDEN = {
    "manifest bytes (manifest.SCHEMA; the hash is the manifest id)": (lambda: manifest_fixture().to_bytes(), MANIFEST),
    "signature message (signing.message, its 'schema')": (
        lambda: signing.message("k" * 32, "d" * 64, 1234), SIGNATURE_MESSAGE),
    "ref bytes with its signature (refs.SCHEMA)": (lambda: ref_fixture().to_bytes(), REF),
    "pack trailer and footer (packs.TRAILER_SCHEMA, MAGIC)": (
        lambda: packs.trailer([packs.PackedBlob(BLOB_A, 0, 17, 3), packs.PackedBlob(BLOB_B, 17, 20, 5)]), TRAILER),
    "seek table ending a chunked blob (packs.seek_table, zstd's seekable format)": (
        lambda: packs.seek_table([(1000, packs.CHUNK_BYTES), (17, 5)]), SEEK_TABLE),
}  # fmt: skip


@pytest.mark.parametrize("what", list(GOLDEN))
def test_stored_formats_are_pinned(what):
    make, expected = GOLDEN[what]
    data = make()
    actual = hashlib.sha256(data).hexdigest()
    assert actual == expected, (
        f"the {what} changed. Bytes already in stores no longer match: bump its schema number, note the "
        f"change in docs/design.md, then pin the new value {actual!r}.\nnew bytes: {data!r}"
    )


def test_the_manifest_id_is_the_hash_of_its_pinned_bytes_and_parses_back():
    fixture = manifest_fixture()
    assert fixture.id == MANIFEST
    assert manifests.parse(fixture.to_bytes(), MANIFEST) == fixture


def test_the_pinned_ref_parses_back_and_its_signature_verifies():
    ref = ref_fixture()
    assert refs.parse(ref.to_bytes(), ref.bundle_key) == ref
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    public = Ed25519PrivateKey.from_private_bytes(SEED).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
    trusted = (signing.TrustedKey("golden", public),)
    assert signing.check(trusted, dict(ref.signatures), ref.message(), ref.bundle_key) == "golden"


def test_the_pinned_trailer_parses_back_and_is_what_a_pack_ends_with(tmp_path):
    blobs = (packs.PackedBlob(BLOB_A, 0, 17, 3), packs.PackedBlob(BLOB_B, 17, 20, 5))
    tail = packs.trailer(blobs)
    assert packs.parse_trailer(PACK, tail, 37 + len(tail)) == blobs
    (tmp_path / "f").write_bytes(b"abc")
    writer = packs.PackWriter(tmp_path)
    writer.add(hashlib.sha256(b"abc").hexdigest(), tmp_path / "f", 3)
    pack = writer.finish()
    assert pack.path.read_bytes().endswith(packs.trailer(pack.blobs))


def test_a_schema_1_trailer_still_parses():
    assert packs.parse_trailer(PACK, TRAILER_V1, 17 + len(TRAILER_V1)) == (packs.PackedBlob(BLOB_A, 0, 17, 3),)


def test_the_pinned_seek_table_parses_back():
    table = packs.seek_table([(1000, packs.CHUNK_BYTES), (17, 5)])
    chunks = packs.parse_seek_table(table, 1017 + len(table), packs.CHUNK_BYTES + 5)
    assert tuple(chunks) == (packs.Chunk(0, 1000, 0, packs.CHUNK_BYTES), packs.Chunk(1000, 17, packs.CHUNK_BYTES, 5))
