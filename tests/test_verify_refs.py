"""`kcache verify` walks refs/ too: what a pod restoring with `--index none` would follow, or fail on."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from click.testing import CliRunner
from faulty import CountingStore
from trees import write_tree

from kcache import fingerprint, limits, refs, signing, sources
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.errors import IntegrityError, ObjectMissing, ObjectTooLarge
from kcache.index import Index
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.store import manifest_key, ref_key
from kcache.verify import verify
from kcache.yank import yank

LAYERS = sources.select()
EXPIRED = timedelta(seconds=-1)
OTHER_ID = "ab" * 32  # a bundle id no publish made


@pytest.fixture(params=["file", "s3"])
def any_store(request):
    """Each ref check runs on file:// and on S3 (moto's server): the walk is one listing of refs/."""
    return request.getfixturevalue("store" if request.param == "file" else "s3_store")


@pytest.fixture
def keys(tmp_path):
    made = {}
    for name in ("k1", "k2"):
        private, public = signing.generate(name, tmp_path / "keys")
        made[name] = (signing.load_signing_key(private), signing.load_trusted_keys([public])[0])
    return made


def _publish(tmp_path, store, index, fp, content: bytes, name="src", key=None):
    write_tree(tmp_path / name, {"inductor/a": content})
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={}, config=PublishConfig(signing_key=key))


def _replace(store, key: str, data: bytes) -> None:
    """What a writer to the bucket can do: put any bytes under a key, an existing one included."""
    store.delete(key)
    assert store.put_bytes(key, data)


def _ref_problems(result, bundle_key: str) -> list[str]:
    return [p for p in result.problems if p.startswith(f"ref refs/{bundle_key}")]


def _pod(store, fp, root, **kw):
    """A pod restoring with --index none."""
    return restore(store, refs.RefCatalog(store), fp, root, **kw)


def test_a_store_whose_refs_are_sound_has_no_ref_problems(tmp_path, any_store, sqlite_index, fp, keys):
    _publish(tmp_path, any_store, sqlite_index, fp, b"a", "v1", key=keys["k1"][0])
    other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
    _publish(tmp_path, any_store, sqlite_index, other, b"b", "v2", key=keys["k1"][0])
    assert [i.key for i in any_store.list("refs/layers/")]  # layer refs are there, and are no bundle refs
    for trusted in ((), (keys["k1"][1],)):
        result = verify(any_store, sqlite_index, trusted=trusted)
        assert result.problems == () and result.refs == 2 and result.bundles == 2


def test_a_ref_whose_manifest_is_gone(tmp_path, any_store, sqlite_index, fp):
    published = _publish(tmp_path, any_store, sqlite_index, fp, b"a")
    any_store.delete(manifest_key(published.bundle_id))
    with pytest.raises(ObjectMissing):  # what verify must warn of
        _pod(any_store, fp, tmp_path / "r")
    (problem,) = _ref_problems(verify(any_store, sqlite_index), fp.bundle_key)
    assert published.bundle_id[:12] in problem and "manifest is missing" in problem


def test_a_ref_naming_a_bundle_nobody_published(tmp_path, any_store, sqlite_index, fp):
    _publish(tmp_path, any_store, sqlite_index, fp, b"a")
    created = refs.read(any_store, fp.bundle_key).created_at
    _replace(any_store, ref_key(fp.bundle_key), refs.Ref(fp.bundle_key, OTHER_ID, created).to_bytes())
    with pytest.raises(ObjectMissing):
        _pod(any_store, fp, tmp_path / "r")
    problems = _ref_problems(verify(any_store, sqlite_index), fp.bundle_key)
    assert any("manifest is missing" in p for p in problems)
    assert any("the index has no bundle" in p for p in problems)


@pytest.mark.parametrize("planted", ["garbage", "empty object", "another key's ref", "schema 9", "bad generation"])
def test_a_ref_that_does_not_parse(tmp_path, any_store, sqlite_index, fp, planted):
    _publish(tmp_path, any_store, sqlite_index, fp, b"a", "v1")
    other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
    _publish(tmp_path, any_store, sqlite_index, other, b"b", "v2")
    doc = json.loads(any_store.get_bytes(ref_key(fp.bundle_key)))
    data = {
        "garbage": b"\xff not json {",
        "empty object": b"{}",
        "another key's ref": any_store.get_bytes(ref_key(other.bundle_key)),
        "schema 9": json.dumps({**doc, "signed": {**doc["signed"], "schema": 9}}).encode(),
        "bad generation": json.dumps({**doc, "signed": {**doc["signed"], "generation": -1}}).encode(),
    }[planted]
    _replace(any_store, ref_key(fp.bundle_key), data)
    with pytest.raises(IntegrityError):  # what verify must warn of
        _pod(any_store, fp, tmp_path / "r")
    result = verify(any_store, sqlite_index)
    (problem,) = result.problems
    assert problem.startswith(f"ref refs/{fp.bundle_key}") and ("does not parse" in problem or "names bundle key"
                                                                 in problem)  # fmt: skip
    assert result.refs == 2


def test_a_ref_over_its_cap_is_reported_unread(tmp_path, store, sqlite_index, fp):
    _publish(tmp_path, store, sqlite_index, fp, b"a")
    _replace(store, ref_key(fp.bundle_key), b" " * (limits.REF_BYTES + 1))
    with pytest.raises(ObjectTooLarge):
        _pod(store, fp, tmp_path / "r")
    for info in list(store.list("refs/layers/")):  # read, and sound: only the bundle ref's bytes count here
        store.delete(info.key)
    counting = CountingStore(store)
    (problem,) = verify(counting, sqlite_index).problems
    assert problem.startswith(f"ref refs/{fp.bundle_key}") and "limit" in problem
    assert counting.read.get("refs", 0) == 0  # refused by its size, not read


def test_with_trusted_keys_a_ref_whose_signature_does_not_verify(tmp_path, any_store, sqlite_index, fp, keys):
    _publish(tmp_path, any_store, sqlite_index, fp, b"a", "v1", key=keys["k1"][0])
    v2 = _publish(tmp_path, any_store, sqlite_index, fp, b"b", "v2", key=keys["k1"][0])
    doc = json.loads(any_store.get_bytes(ref_key(fp.bundle_key)))
    doc["signed"]["generation"] += 1  # edited after signing; the signature is still well-formed
    _replace(any_store, ref_key(fp.bundle_key), json.dumps(doc).encode())
    trusted = (keys["k1"][1],)
    miss = _pod(any_store, fp, tmp_path / "r", trusted=trusted, require_signature=True)
    assert miss.status == "miss" and "does not verify" in miss.reason  # what verify must warn of
    assert verify(any_store, sqlite_index).problems == ()  # only the public key tells
    (problem,) = verify(any_store, sqlite_index, trusted=trusted).problems
    assert problem.startswith(f"ref refs/{fp.bundle_key}") and "signature by 'k1' does not verify" in problem
    assert v2.bundle_id  # the bundles themselves are sound: only the ref is reported


@pytest.mark.parametrize("case", ["unsigned", "other key", "expired"])
def test_with_trusted_keys_a_ref_pods_requiring_signatures_refuse(tmp_path, store, sqlite_index, fp, keys, case):
    published = _publish(tmp_path, store, sqlite_index, fp, b"a", key=keys["k1"][0])
    ref = refs.for_bundle(sqlite_index, published.bundle_id)
    store.delete(ref_key(fp.bundle_key))
    signer = {"unsigned": None, "other key": keys["k2"][0], "expired": keys["k1"][0]}[case]
    refs.advance(store, ref, signer=signer, ttl=EXPIRED if case == "expired" else None)
    trusted = (keys["k1"][1],)
    miss = _pod(store, fp, tmp_path / "r", trusted=trusted, require_signature=True)
    assert miss.status == "miss"  # what verify must warn of
    assert verify(store, sqlite_index).problems == ()  # signed refs are optional without trusted keys
    (problem,) = verify(store, sqlite_index, trusted=trusted).problems
    assert problem.startswith(f"ref refs/{fp.bundle_key}")
    assert ("expired" in problem) if case == "expired" else ("not signed by a trusted key" in problem)


@pytest.mark.parametrize("planted", [b"AAAA", b"\xff\x00 not base64"])
def test_a_ref_signature_that_is_no_signature_at_all(tmp_path, store, sqlite_index, fp, keys, planted):
    _publish(tmp_path, store, sqlite_index, fp, b"a", key=keys["k1"][0])
    doc = json.loads(store.get_bytes(ref_key(fp.bundle_key)))
    doc["signatures"]["k1"] = planted.decode("latin-1")
    _replace(store, ref_key(fp.bundle_key), json.dumps(doc).encode())
    for trusted in ((), (keys["k1"][1],)):
        (problem,) = verify(store, sqlite_index, trusted=trusted).problems
        assert problem.startswith(f"ref refs/{fp.bundle_key}") and "signature by 'k1'" in problem


def test_a_ref_naming_a_bundle_the_index_has_yanked(tmp_path, any_store, sqlite_index, fp):
    _publish(tmp_path, any_store, sqlite_index, fp, b"good", "v1")
    v2 = _publish(tmp_path, any_store, sqlite_index, fp, b"broken", "v2")
    before = any_store.get_bytes(ref_key(fp.bundle_key))
    yank(any_store, sqlite_index, v2.bundle_id, "NaNs")
    assert verify(any_store, sqlite_index).problems == ()
    # A ref from before the yank put back, and the marker deleted: pods without the index follow it.
    any_store.delete(refs.yank_key(v2.bundle_id))
    _replace(any_store, ref_key(fp.bundle_key), before)
    assert _pod(any_store, fp, tmp_path / "r").bundle_id == v2.bundle_id  # what verify must warn of
    (problem,) = _ref_problems(verify(any_store, sqlite_index), fp.bundle_key)
    assert v2.bundle_id[:12] in problem and "yanked in the index" in problem


def test_a_ref_naming_a_bundle_with_a_yank_marker(tmp_path, any_store, sqlite_index, fp):
    only = _publish(tmp_path, any_store, sqlite_index, fp, b"a")
    any_store.put_bytes(refs.yank_key(only.bundle_id), b"yanked by hand")  # not through `kcache yank`
    assert _pod(any_store, fp, tmp_path / "r").status == "miss"  # what verify must warn of
    (problem,) = _ref_problems(verify(any_store, sqlite_index), fp.bundle_key)
    assert only.bundle_id[:12] in problem and refs.yank_key(only.bundle_id) in problem


def test_a_ref_naming_a_bundle_its_own_yank_list_names(tmp_path, store, sqlite_index, fp):
    only = _publish(tmp_path, store, sqlite_index, fp, b"a")
    ref = refs.read(store, fp.bundle_key)
    _replace(store, ref_key(fp.bundle_key), refs.Ref(fp.bundle_key, only.bundle_id, ref.created_at,
                                                     yanked=(only.bundle_id,)).to_bytes())  # fmt: skip
    assert _pod(store, fp, tmp_path / "r").status == "miss"
    (problem,) = verify(store, sqlite_index).problems
    assert problem.startswith(f"ref refs/{fp.bundle_key}") and "its own yank list" in problem


def test_a_ref_naming_another_keys_bundle(tmp_path, store, sqlite_index, fp):
    _publish(tmp_path, store, sqlite_index, fp, b"a", "v1")
    other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
    theirs = _publish(tmp_path, store, sqlite_index, other, b"b", "v2")
    ref = refs.read(store, fp.bundle_key)
    _replace(store, ref_key(fp.bundle_key), refs.Ref(fp.bundle_key, theirs.bundle_id, ref.created_at).to_bytes())
    with pytest.raises(IntegrityError, match="bundle key"):
        _pod(store, fp, tmp_path / "r")
    (problem,) = verify(store, sqlite_index).problems
    assert problem.startswith(f"ref refs/{fp.bundle_key}") and other.bundle_key in problem


def test_a_ref_naming_a_bundle_the_index_does_not_have(tmp_path, any_store, sqlite_index, fp, keys):
    """Another index's publishes: index-mode pods take one bundle, `--index none` pods another."""
    ours = _publish(tmp_path, any_store, sqlite_index, fp, b"a", "v1")
    elsewhere = Index.open(f"sqlite:///{tmp_path / 'elsewhere.db'}")
    try:
        theirs = _publish(tmp_path, any_store, elsewhere, fp, b"b", "v2")
        other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
        _publish(tmp_path, any_store, elsewhere, other, b"c", "v3")
    finally:
        elsewhere.close()
    assert restore(any_store, sqlite_index, fp, tmp_path / "i").bundle_id == ours.bundle_id
    assert _pod(any_store, fp, tmp_path / "r").bundle_id == theirs.bundle_id
    result = verify(any_store, sqlite_index)
    assert result.refs == 2
    (known,) = _ref_problems(result, fp.bundle_key)
    assert theirs.bundle_id[:12] in known and "the index has no bundle" in known
    (unknown,) = _ref_problems(result, other.bundle_key)
    assert "never seen" in unknown
    # With trusted keys, such a bundle's manifest signature is checked as a pod would check it.
    signed = verify(any_store, sqlite_index, trusted=(keys["k1"][1],))
    (problem,) = [p for p in _ref_problems(signed, fp.bundle_key) if theirs.bundle_id[:12] in p and "trusted" in p]
    assert "not signed by a trusted key" in problem


def test_cli_verify_reports_ref_problems_with_exit_12(tmp_path, isolated_home):
    runner = CliRunner()
    assert runner.invoke(main, ["keygen", "k1", "--dir", str(tmp_path / "k")]).exit_code == 0
    write_tree(tmp_path / "src", {"inductor/a": b"a"})
    out = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m1", "--json",
                               "--signing-key", str(tmp_path / "k/k1.key")])  # fmt: skip
    assert out.exit_code == 0, out.output
    pub = str(tmp_path / "k/k1.pub")
    clean = runner.invoke(main, ["verify", "--trusted-key", pub, "--json"])
    assert clean.exit_code == 0 and json.loads(clean.stdout)["refs"] == 1
    (ref,) = [p for p in isolated_home.glob("store/refs/*") if fingerprint.is_bundle_key(p.name)]
    doc = json.loads(ref.read_bytes())
    doc["signed"]["generation"] += 1
    ref.chmod(0o644)
    ref.write_text(json.dumps(doc))
    assert runner.invoke(main, ["verify"]).exit_code == 0  # only the public key tells
    flagged = runner.invoke(main, ["verify", "--trusted-key", pub, "--json"])
    assert flagged.exit_code == ExitCode.PROBLEMS
    (problem,) = json.loads(flagged.stdout)["problems"]
    assert problem.startswith(f"ref refs/{ref.name}") and "does not verify" in problem
    ref.write_bytes(b"garbage")
    text = runner.invoke(main, ["verify"])
    assert text.exit_code == ExitCode.PROBLEMS and "1 refs" in text.output and "does not parse" in text.output


def test_cli_verify_refuses_a_named_sqlite_index_that_does_not_exist_under_any_driver(tmp_path):
    typo = tmp_path / "typo.db"
    for url in (f"sqlite:///{typo}", f"sqlite+pysqlite:///{typo}"):
        result = CliRunner().invoke(main, ["verify", "--index", url, "--json"])
        assert result.exit_code == ExitCode.INDEX, (url, result.output)
        assert "does not exist" in json.loads(result.stdout)["error"] and not typo.exists()



def test_an_index_row_filed_under_another_bundle_key(tmp_path, store, sqlite_index, fp, keys):
    """An index writer files one key's signed bundle as another key's newest: that key's pods fail on it."""
    from sqlalchemy import update

    from kcache.index.models import BundleRow

    ours = _publish(tmp_path, store, sqlite_index, fp, b"a", "v1", key=keys["k1"][0])
    other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
    _publish(tmp_path, store, sqlite_index, other, b"b", "v2", key=keys["k1"][0])
    sqlite_index.transaction(lambda s: s.execute(
        update(BundleRow).where(BundleRow.id == ours.bundle_id)
        .values(bundle_key=other.bundle_key, created_at=sqlite_index.now() + timedelta(days=1))))
    assert sqlite_index.newest_bundle(other.bundle_key).id == ours.bundle_id  # what other's pods are offered
    for trusted in ((), (keys["k1"][1],)):
        problems = [p for p in verify(store, sqlite_index, trusted=trusted).problems
                    if p.startswith(f"bundle {ours.bundle_id[:12]}")]  # fmt: skip
        assert problems and all(other.bundle_key in p and fp.bundle_key in p for p in problems), problems


def test_a_ref_behind_the_indexs_newest_bundle(tmp_path, any_store, sqlite_index, fp):
    """A signed ref replayed within its lifetime (the documented limit), or one no signer has
    rewritten since: pods with --index none take an older bundle than index-mode pods; verify says so."""
    from sqlalchemy import update

    from kcache.index.models import BundleRow

    v1 = _publish(tmp_path, any_store, sqlite_index, fp, b"a", "v1")
    before = any_store.get_bytes(ref_key(fp.bundle_key))
    v2 = _publish(tmp_path, any_store, sqlite_index, fp, b"b", "v2")
    assert verify(any_store, sqlite_index).problems == ()
    _replace(any_store, ref_key(fp.bundle_key), before)
    assert _pod(any_store, fp, tmp_path / "r").bundle_id == v1.bundle_id
    # Within minutes of v2's commit, its publish may still be writing the ref: no alarm yet.
    assert verify(any_store, sqlite_index).problems == ()
    for bundle, age in ((v1, 20), (v2, 10)):
        sqlite_index.transaction(lambda s, b=bundle, a=age: s.execute(
            update(BundleRow).where(BundleRow.id == b.bundle_id).values(created_at=sqlite_index.now()
                                                                       - timedelta(minutes=a))))  # fmt: skip
    (problem,) = _ref_problems(verify(any_store, sqlite_index), fp.bundle_key)
    assert v1.bundle_id[:12] in problem and v2.bundle_id[:12] in problem and "kcache refresh" in problem
