"""Restore through refs (no index access), and rebuilding the index from the store."""

import json
import threading
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from trees import read_tree, write_tree

from kcache import refs, sources
from kcache.cli import main
from kcache.index import Index
from kcache.publish import publish
from kcache.reindex import reindex
from kcache.restore import restore
from kcache.store import ref_key

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def test_refs_only_move_forward(store):
    assert refs.advance(store, refs.Ref("k", "b" * 64, T0 + timedelta(seconds=10)))
    assert not refs.advance(store, refs.Ref("k", "a" * 64, T0))  # a slower, older publisher
    assert refs.read(store, "k").manifest == "b" * 64
    assert refs.advance(store, refs.Ref("k", "c" * 64, T0 + timedelta(seconds=20)))
    assert refs.read(store, "k").manifest == "c" * 64


def test_racing_writers_leave_the_newest(any_store_kind, request):
    store = request.getfixturevalue(any_store_kind)
    start = threading.Barrier(8)

    def publisher(i):
        start.wait()
        refs.advance(store, refs.Ref("race", f"{i:064x}", T0 + timedelta(seconds=i)))

    threads = [threading.Thread(target=publisher, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert refs.read(store, "race").manifest == f"{7:064x}"


@pytest.fixture(params=["store", "s3_store"])
def any_store_kind(request):
    return request.param


def test_a_ref_rewritten_between_its_size_and_its_read_is_read_whole(any_store_kind, request, monkeypatch):
    """The ref was read as a size, then that many bytes: a writer that replaced it between the two with
    one of another length (a yank list that grew) tore it, and a refs-only pod started cold. One read."""
    store = request.getfixturevalue(any_store_kind)
    refs.advance(store, refs.Ref("torn", "a" * 64, T0))
    longer = refs.Ref("torn", "b" * 64, T0 + timedelta(seconds=1), yanked=("c" * 64, "d" * 64))
    real_size = type(store).size

    def size_then_rewrite(self, key):
        size = real_size(self, key)
        if key == ref_key("torn"):
            monkeypatch.setattr(type(store), "size", real_size)
            refs.advance(store, longer)  # another writer, right after the size was taken
        return size

    monkeypatch.setattr(type(store), "size", size_then_rewrite)
    got = refs.read(store, "torn")
    assert got.manifest in ("a" * 64, "b" * 64) and (got.manifest == "a" * 64 or got.yanked == longer.yanked)


def test_restore_through_refs_without_index(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/fxgraph/g": b"graph", "triton/k/k.json": b"{}"})
    result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    restored = restore(store, refs.RefCatalog(store), fp, tmp_path / "dst")
    assert (restored.status, restored.bundle_id) == ("hit", result.bundle_id)
    assert read_tree(tmp_path / "dst/inductor") == read_tree(tmp_path / "src/inductor")


def test_cli_restore_uses_refs_when_no_index_is_reachable(tmp_path, monkeypatch):
    monkeypatch.setenv("KCACHE_MODEL", "m")
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    store_url = f"file://{tmp_path / 'shared-store'}"
    runner = CliRunner()
    out = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--store", store_url, "--json"],
                        catch_exceptions=False)  # fmt: skip
    bundle_id = json.loads(out.output)["bundle_id"]
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path / "fresh-pod-home"))  # no local index exists
    out = runner.invoke(main, ["restore", "--into", str(tmp_path / "dst"), "--store", store_url, "--json"],
                        catch_exceptions=False)  # fmt: skip
    doc = json.loads(out.output)
    assert (doc["status"], doc["bundle_id"]) == ("hit", bundle_id)
    assert not (tmp_path / "fresh-pod-home" / "index.db").exists()
    explicit = runner.invoke(main, ["restore", "--into", str(tmp_path / "dst2"), "--store", store_url,
                                    "--index", "none", "--json"], catch_exceptions=False)  # fmt: skip
    assert json.loads(explicit.output)["status"] == "hit"


def test_reindex_rebuilds_what_publish_recorded(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {f"inductor/{i}": f"file {i}".encode() for i in range(50)})
    result = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    fresh = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuilt = reindex(store, fresh)
    assert (rebuilt.packs, rebuilt.blobs, rebuilt.bundles, rebuilt.new_bundles) == (1, 50, 1, 1)
    assert rebuilt.skipped == ()
    bundle = fresh.newest_bundle(fp.bundle_key)
    assert bundle.id == result.bundle_id and bundle.files == 50
    from kcache import manifest as manifests
    from kcache.store import manifest_key

    blob_ids = [e.blob for e in manifests.parse(store.get_bytes(manifest_key(bundle.id)), bundle.id).entries]
    assert fresh.locate(blob_ids) == sqlite_index.locate(blob_ids)
    assert restore(store, fresh, fp, tmp_path / "dst").status == "hit"
    again = reindex(store, fresh)
    assert again.new_bundles == 0
    fresh.close()


def test_reindex_reports_a_damaged_pack_and_indexes_the_rest(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    store.put_bytes("packs/ff/" + "f" * 64, b"this is not a pack")
    fresh = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuilt = reindex(store, fresh)
    assert rebuilt.blobs == 1 and len(rebuilt.skipped) == 1 and "footer" in rebuilt.skipped[0]
    fresh.close()


def test_damaged_ref_is_an_integrity_error(store):
    from kcache.errors import IntegrityError

    store.put_if(ref_key("k"), b"{not json", None)
    with pytest.raises(IntegrityError):
        refs.read(store, "k")


def test_reindex_reads_a_long_trailer_without_reading_the_pack(tmp_path, store, sqlite_index, fp, monkeypatch):
    import os

    from faulty import CountingStore

    from kcache import reindex as reindex_module

    write_tree(tmp_path / "src", {f"inductor/{i}": os.urandom(20_000) for i in range(20)})
    publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    monkeypatch.setattr(reindex_module, "_TAIL", 200)  # every trailer is now "longer than the first read"
    counting = CountingStore(store)
    fresh = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuilt = reindex(counting, fresh, trust_trailers=True)
    fresh.close()
    assert rebuilt.blobs == 20 and rebuilt.skipped == ()
    assert counting.read["packs"] < 10_000  # the pack holds 400 kB of blobs


def _forged_pack(store, claimed_id: str, content: bytes) -> str:
    """A pack whose trailer says it holds `claimed_id` but whose frame holds `content`: named by its
    hash like any pack, so only decompressing and hashing the blob tells it apart."""
    import hashlib

    import zstandard

    from kcache import packs
    from kcache.store import pack_key

    frame = zstandard.ZstdCompressor().compress(content)
    data = frame + packs.trailer([packs.PackedBlob(claimed_id, 0, len(frame), len(content))])
    pack_id = hashlib.sha256(data).hexdigest()
    store.put_bytes(pack_key(pack_id), data)
    return pack_id


def test_reindex_indexes_no_blob_a_forged_trailer_claims(tmp_path, store, sqlite_index, fp):
    """A store writer's pack claims the id of a file an honest publisher will publish. Indexed, every
    later publish would name its garbage instead of uploading the file: no restore would ever hit."""
    import hashlib

    kernel = b"the kernel a warmup will compile" * 50
    forged = _forged_pack(store, hashlib.sha256(kernel).hexdigest(), b"garbage" * 50)
    fresh = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuilt = reindex(store, fresh)
    assert rebuilt.blobs == 0 and len(rebuilt.skipped) == 1 and forged[:12] in rebuilt.skipped[0]
    write_tree(tmp_path / "src", {"inductor/kernel.so": kernel})
    published = publish(store, fresh, fp, sources.select(), root=tmp_path / "src", env={})
    assert published.new_blobs == 1  # uploaded, not named in the forged pack
    pod = restore(store, fresh, fp, tmp_path / "dst")
    assert pod.status == "hit", pod.reason
    assert read_tree(tmp_path / "dst" / "inductor")["kernel.so"][0] == kernel
    fresh.close()


def test_reindex_keeps_the_good_blobs_of_a_pack_with_a_bad_one(tmp_path, store, sqlite_index, fp):
    write_tree(tmp_path / "src", {"inductor/a": b"a" * 1000, "inductor/b": b"b" * 1000})
    publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    forged = _forged_pack(store, "z" * 64, b"x")  # as long as a blob id (a shorter one is refused unparsed)
    fresh = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuilt = reindex(store, fresh)
    assert rebuilt.blobs == 2 and len(rebuilt.skipped) == 1 and forged[:12] in rebuilt.skipped[0]
    trusted = reindex(store, Index.open(f"sqlite:///{tmp_path / 'trusting.db'}"), trust_trailers=True)
    assert trusted.blobs == 3  # --trust-trailers reads trailers only, as before
    fresh.close()


def _touch(store, key: str, when: datetime) -> None:
    import os

    os.utime(store.root / key, (when.timestamp(), when.timestamp()))


def test_reindex_keeps_the_bundle_the_ref_names_newest_whatever_the_manifests_times(tmp_path, store, sqlite_index, fp):
    """A store copied or migrated (every object's time now), or a manifest put back by hand, must
    not make an older bundle the newest: gc would then delete the one the ref names."""
    from kcache.store import manifest_key

    write_tree(tmp_path / "v1", {"inductor/k": b"old"})
    old = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "v1", env={})
    write_tree(tmp_path / "v2", {"inductor/k": b"new"})
    new = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "v2", env={})
    _touch(store, manifest_key(old.bundle_id), datetime.now(timezone.utc) + timedelta(days=400))  # or just "now"
    fresh = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    reindex(store, fresh)
    assert fresh.newest_bundle(fp.bundle_key).id == new.bundle_id
    assert fresh.get_bundle(old.bundle_id).created_at < fresh.get_bundle(new.bundle_id).created_at
    fresh.close()


def test_reindex_with_trusted_keys_indexes_only_bundles_they_signed(tmp_path, store, sqlite_index, fp):
    from kcache import signing
    from kcache.publish import PublishConfig
    from kcache.store import manifest_key

    private, public = signing.generate("prod", tmp_path / "keys")
    signed = PublishConfig(signing_key=signing.load_signing_key(private))
    write_tree(tmp_path / "v1", {"inductor/k": b"signed"})
    good = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "v1", env={}, config=signed)
    write_tree(tmp_path / "v2", {"inductor/k": b"planted"})
    planted = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "v2", env={})  # no key: a writer's
    store.delete(ref_key(fp.bundle_key))  # and the ref that would name the signed one
    _touch(store, manifest_key(planted.bundle_id), datetime.now(timezone.utc))
    fresh = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuilt = reindex(store, fresh, trusted=signing.load_trusted_keys([public]))
    assert fresh.newest_bundle(fp.bundle_key).id == good.bundle_id
    assert rebuilt.bundles == 1 and any(planted.bundle_id[:12] in s and "signed" in s for s in rebuilt.skipped)
    fresh.close()


def test_reindex_on_a_host_whose_clock_is_behind_keeps_the_bundles_in_their_order(tmp_path, store, index, fp,
                                                                                   monkeypatch):  # fmt: skip
    """A reindex run on a node 7 h behind the index and the store took the ref (stamped by the index's clock)
    for one from the future and clamped every manifest's time to its own "now": the last 7 h of bundles
    all got one time, and the key's newest became whichever id sorts first (a rollback for index pods,
    and gc's --keep-last kept the wrong ones). Times are judged by the index's clock, not the host's."""
    import kcache.reindex

    behind = timedelta(hours=7)

    class HostClock(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.now(tz) - behind

    publishers = Index.open(f"sqlite:///{tmp_path / 'publishers.db'}")
    published = []
    for name in ("v1", "v2", "v3"):
        write_tree(tmp_path / name, {"inductor/k": name.encode()})
        published.append(publish(store, publishers, fp, sources.select(), root=tmp_path / name, env={}).bundle_id)
    publishers.close()
    monkeypatch.setattr(kcache.reindex, "datetime", HostClock)
    monkeypatch.setattr(refs, "_host_now", lambda: datetime.now(timezone.utc) - behind)
    reindex(store, index)
    rows = sorted(index.list_bundles(bundle_key=fp.bundle_key), key=lambda b: b.created_at)
    assert [b.id for b in rows] == published and len({b.created_at for b in rows}) == 3
    assert index.newest_bundle(fp.bundle_key).id == published[-1]
