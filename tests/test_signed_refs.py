"""Rollback through refs/: a store writer without the signing key cannot make a pod that requires
signatures restore a yanked or superseded bundle, except by replaying a signed ref before it expires."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from trees import write_tree

from kcache import refs, signing, sources
from kcache.cli import main
from kcache.errors import ConfigError, IntegrityError
from kcache.index import Index
from kcache.publish import PublishConfig, publish
from kcache.reindex import reindex
from kcache.restore import restore
from kcache.store import ref_key
from kcache.store.local import LocalStore
from kcache.yank import unyank, yank

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
EXPIRED = timedelta(seconds=-1)  # a ref signed so long ago that its lifetime is over


@pytest.fixture
def keys(tmp_path):
    made = {}
    for name in ("prod", "other"):
        private, public = signing.generate(name, tmp_path / "keys")
        made[name] = (signing.load_signing_key(private), signing.load_trusted_keys([public])[0])
    return made


def _publish(tmp_path, store, index, fp, content: bytes, key=None, name="src"):
    write_tree(tmp_path / name, {"inductor/a": content})
    os.utime(tmp_path / name / "inductor/a", ns=(10**18, 10**18))  # mtimes are published: "unchanged" keeps them
    return publish(
        store, index, fp, sources.select(), root=tmp_path / name, env={}, config=PublishConfig(signing_key=key)
    )


def _pod(store, fp, root, keys, **kw):
    """A pod without index access that requires signatures by `prod`."""
    return restore(store, refs.RefCatalog(store), fp, root, trusted=(keys["prod"][1],), require_signature=True, **kw)


def _signed_ref_bytes(tmp_path, index, bundle_id, key, ttl=None) -> bytes:
    """What a ref signed for `bundle_id` looked like: the copy an attacker kept to replay later."""
    scratch = LocalStore(tmp_path / f"scratch-{bundle_id[:8]}-{ttl}")
    ref = refs.for_bundle(index, bundle_id)
    refs.advance(scratch, ref, signer=key, ttl=ttl)
    return scratch.get_bytes(ref_key(ref.bundle_key))


@pytest.fixture
def yanked_v2(tmp_path, store, sqlite_index, fp, keys):
    """v1 and v2 published signed, then v2 yanked with the key; returns (v1, v2)."""
    key = keys["prod"][0]
    v1 = _publish(tmp_path, store, sqlite_index, fp, b"good", key, "v1")
    v2 = _publish(tmp_path, store, sqlite_index, fp, b"broken", key, "v2")
    yank(store, sqlite_index, v2.bundle_id, "NaNs", signer=key)
    return v1, v2


def test_signed_publish_signs_the_ref_and_a_pod_follows_it(tmp_path, store, sqlite_index, fp, keys):
    published = _publish(tmp_path, store, sqlite_index, fp, b"a", keys["prod"][0])
    ref = refs.read(store, fp.bundle_key)
    assert dict(ref.signatures).keys() == {"prod"} and ref.expires > datetime.now(timezone.utc) + timedelta(hours=23)
    result = _pod(store, fp, tmp_path / "dst", keys)
    assert (result.status, result.bundle_id) == ("hit", published.bundle_id)


def test_yank_then_rewrite_the_ref_unsigned_is_a_miss(tmp_path, store, sqlite_index, fp, keys, yanked_v2):
    _v1, v2 = yanked_v2
    # The attack from issue 8: delete the marker and point the ref back at the yanked bundle.
    store.delete(refs.yank_key(v2.bundle_id))
    forged = refs.Ref(fp.bundle_key, v2.bundle_id, T0 + timedelta(days=999), generation=99)
    store.delete(ref_key(fp.bundle_key))
    store.put_if(ref_key(fp.bundle_key), forged.to_bytes(), None)
    result = _pod(store, fp, tmp_path / "dst", keys)
    assert result.status == "miss" and "not signed by a trusted key" in result.reason


def test_a_ref_whose_fields_were_edited_after_signing_is_a_miss(tmp_path, store, sqlite_index, fp, keys, yanked_v2):
    v1, v2 = yanked_v2
    doc = json.loads(store.get_bytes(ref_key(fp.bundle_key)))
    assert doc["signed"]["manifest"] == v1.bundle_id and doc["signed"]["yanked"] == [v2.bundle_id]
    doc["signed"]["manifest"], doc["signed"]["yanked"] = v2.bundle_id, []
    store.delete(ref_key(fp.bundle_key))
    store.put_if(ref_key(fp.bundle_key), json.dumps(doc).encode(), None)
    result = _pod(store, fp, tmp_path / "dst", keys)
    assert result.status == "miss" and "does not verify" in result.reason


def test_a_ref_signed_by_an_untrusted_key_is_a_miss(tmp_path, store, sqlite_index, fp, keys):
    _publish(tmp_path, store, sqlite_index, fp, b"a", keys["other"][0])
    result = _pod(store, fp, tmp_path / "dst", keys)
    assert result.status == "miss" and "not signed by a trusted key" in result.reason


def test_a_replayed_pre_yank_ref_is_refused_once_expired(tmp_path, store, sqlite_index, fp, keys):
    key = keys["prod"][0]
    _publish(tmp_path, store, sqlite_index, fp, b"good", key, "v1")
    v2 = _publish(tmp_path, store, sqlite_index, fp, b"broken", key, "v2")
    stale = _signed_ref_bytes(tmp_path, sqlite_index, v2.bundle_id, key, ttl=EXPIRED)
    yank(store, sqlite_index, v2.bundle_id, signer=key)
    replaced = refs.read(store, fp.bundle_key).generation
    store.delete(refs.yank_key(v2.bundle_id))
    store.delete(ref_key(fp.bundle_key))
    store.put_if(ref_key(fp.bundle_key), stale, None)
    result = _pod(store, fp, tmp_path / "dst", keys)
    assert result.status == "miss" and "expired" in result.reason and "kcache refresh" in result.reason
    refs.refresh(store, sqlite_index, fp.bundle_key, signer=key)  # the replay does not pull generations back
    assert refs.read(store, fp.bundle_key).generation >= replaced > refs.parse(stale, fp.bundle_key).generation


def test_replay_within_the_expiry_window_is_the_documented_limit(tmp_path, store, sqlite_index, fp, keys):
    """What a writer without keys can still do (docs/design.md, threat model): replay a signed ref
    that has not expired yet. Pinned in a test so the documentation cannot drift from the code."""
    key = keys["prod"][0]
    _publish(tmp_path, store, sqlite_index, fp, b"good", key, "v1")
    v2 = _publish(tmp_path, store, sqlite_index, fp, b"broken", key, "v2")
    fresh = store.get_bytes(ref_key(fp.bundle_key))
    yank(store, sqlite_index, v2.bundle_id, signer=key)
    store.delete(refs.yank_key(v2.bundle_id))
    store.delete(ref_key(fp.bundle_key))
    store.put_if(ref_key(fp.bundle_key), fresh, None)
    assert _pod(store, fp, tmp_path / "dst", keys).bundle_id == v2.bundle_id


def test_refs_never_name_a_yanked_bundle_and_generations_only_grow(tmp_path, store, sqlite_index, fp, keys, yanked_v2):
    v1, v2 = yanked_v2
    ref = refs.read(store, fp.bundle_key)
    assert (ref.manifest, ref.yanked) == (v1.bundle_id, (v2.bundle_id,))
    seen = [ref.generation]
    assert not refs.advance(store, refs.for_bundle(sqlite_index, v2.bundle_id), signer=keys["prod"][0])
    unyank(store, sqlite_index, v2.bundle_id, signer=keys["prod"][0])
    seen.append(refs.read(store, fp.bundle_key).generation)
    refs.refresh(store, sqlite_index, fp.bundle_key, signer=keys["prod"][0])
    seen.append(refs.read(store, fp.bundle_key).generation)
    assert seen == sorted(set(seen)) and refs.read(store, fp.bundle_key).manifest == v2.bundle_id


def test_pinned_yanked_bundle_is_a_miss_even_without_its_marker(tmp_path, store, sqlite_index, fp, keys, yanked_v2):
    _v1, v2 = yanked_v2
    store.delete(refs.yank_key(v2.bundle_id))
    by_index = restore(store, sqlite_index, fp, tmp_path / "i", bundle_id=v2.bundle_id)
    assert by_index.status == "miss" and "yanked" in by_index.reason
    by_ref = _pod(store, fp, tmp_path / "r", keys, bundle_id=v2.bundle_id)
    assert by_ref.status == "miss" and "yanked" in by_ref.reason
    store.delete(ref_key(fp.bundle_key))  # no signed yank list: a pod requiring signatures cannot check
    unchecked = _pod(store, fp, tmp_path / "n", keys, bundle_id=v2.bundle_id)
    assert unchecked.status == "miss" and "no ref" in unchecked.reason


@pytest.mark.parametrize("pod_index", ["empty", "fallback"])
def test_pinned_yanked_bundle_is_a_miss_through_an_index_that_never_saw_it(tmp_path, store, fp, keys, yanked_v2,
                                                                            pod_index):  # fmt: skip
    """The pod's index has no row for the pinned bundle: the signed ref's yank list must decide, as
    without an index, or deleting the marker un-yanks it."""
    from kcache.binding import FallbackCatalog

    _v1, v2 = yanked_v2
    store.delete(refs.yank_key(v2.bundle_id))
    own = Index.open(f"sqlite:///{tmp_path / 'pod.db'}")
    catalog = own if pod_index == "empty" else FallbackCatalog(own, refs.RefCatalog(store))
    try:
        result = restore(store, catalog, fp, tmp_path / "dst", bundle_id=v2.bundle_id, trusted=(keys["prod"][1],),
                         require_signature=True)  # fmt: skip
    finally:
        own.close()
    assert result.status == "miss" and "yanked" in result.reason


def test_publish_refreshes_a_ref_only_when_it_is_close_to_expiring(tmp_path, store, sqlite_index, fp, keys):
    key = keys["prod"][0]
    _publish(tmp_path, store, sqlite_index, fp, b"a", key)
    first = refs.read(store, fp.bundle_key)
    _publish(tmp_path, store, sqlite_index, fp, b"a", key)  # unchanged: nothing to write
    assert refs.read(store, fp.bundle_key) == first
    refs.refresh(store, sqlite_index, fp.bundle_key, signer=key, ttl=timedelta(hours=1))  # past half of the default day
    _publish(tmp_path, store, sqlite_index, fp, b"a", key)
    again = refs.read(store, fp.bundle_key)
    assert again.generation > first.generation and again.expires > first.expires


def test_an_unsigned_publish_does_not_strip_the_signature_of_the_same_bundle(tmp_path, store, sqlite_index, fp, keys):
    _publish(tmp_path, store, sqlite_index, fp, b"a", keys["prod"][0])
    _publish(tmp_path, store, sqlite_index, fp, b"a")
    assert _pod(store, fp, tmp_path / "dst", keys).status == "hit"


def test_cli_refresh_revives_an_expired_ref(tmp_path, store, sqlite_index, fp, keys, monkeypatch):
    key = keys["prod"][0]
    published = _publish(tmp_path, store, sqlite_index, fp, b"a", key)
    refs.refresh(store, sqlite_index, fp.bundle_key, signer=key, ttl=EXPIRED)
    assert _pod(store, fp, tmp_path / "before", keys).status == "miss"
    args = ["--store", f"file://{store.root}", "--index", f"sqlite:///{tmp_path / 'index.db'}"]
    out = CliRunner().invoke(main, ["refresh", "--signing-key", str(tmp_path / "keys/prod.key"), "--ttl", "1d",
                                    "--json", *args], catch_exceptions=False)  # fmt: skip
    assert out.exit_code == 0, out.output
    (row,) = json.loads(out.output)["refs"]
    assert (row["bundle_key"], row["bundle_id"]) == (fp.bundle_key, published.bundle_id)
    assert _pod(store, fp, tmp_path / "after", keys).status == "hit"
    missing = CliRunner().invoke(main, ["refresh", *args])
    assert missing.exit_code == 2 and "--signing-key" in missing.output


def test_cli_refresh_says_which_keys_lost_their_ref(tmp_path, store, sqlite_index, fp, keys):
    """A key whose only bundle is yanked has its ref removed; the text report sliced its missing bundle id
    and exited 70 after the work was done, on every run of the refresh CronJob from then on."""
    key = keys["prod"][0]
    published = _publish(tmp_path, store, sqlite_index, fp, b"a", key)
    yank(store, sqlite_index, published.bundle_id, signer=key)
    args = ["--store", f"file://{store.root}", "--index", f"sqlite:///{tmp_path / 'index.db'}"]
    out = CliRunner().invoke(main, ["refresh", "--signing-key", str(tmp_path / "keys/prod.key"), *args],
                             catch_exceptions=False)  # fmt: skip
    assert out.exit_code == 0, out.output
    assert f"{fp.bundle_key} removed (no active bundle)" in out.output and "re-signed 0 refs" in out.output


def test_cli_refresh_of_a_model_the_index_does_not_know_is_an_error(tmp_path, store, sqlite_index, fp, keys):
    """A typo in the refresh CronJob's --model re-signed nothing and exited 0 every day, until the
    signed refs expired and every pod requiring signatures started cold."""
    _publish(tmp_path, store, sqlite_index, fp, b"a", keys["prod"][0])
    args = ["--signing-key", str(tmp_path / "keys/prod.key"), "--store", f"file://{store.root}",
            "--index", f"sqlite:///{tmp_path / 'index.db'}"]  # fmt: skip
    typo = CliRunner().invoke(main, ["refresh", "--model", fp.facts["model.id"] + "x", *args])
    assert typo.exit_code == 3 and fp.facts["model.id"] + "x" in typo.output
    right = CliRunner().invoke(main, ["refresh", "--model", fp.facts["model.id"], "--json", *args])
    assert right.exit_code == 0 and [r["bundle_key"] for r in json.loads(right.output)["refs"]] == [fp.bundle_key]


def test_cli_refresh_names_the_variable_a_bad_ttl_came_from(tmp_path, store, sqlite_index, fp, keys, monkeypatch):
    _publish(tmp_path, store, sqlite_index, fp, b"a", keys["prod"][0])
    args = ["refresh", "--signing-key", str(tmp_path / "keys/prod.key"), "--store", f"file://{store.root}",
            "--index", f"sqlite:///{tmp_path / 'index.db'}"]  # fmt: skip
    monkeypatch.setenv("KCACHE_REF_TTL", "junk")
    from_env = CliRunner().invoke(main, args)
    assert from_env.exit_code == 2 and "KCACHE_REF_TTL" in from_env.output
    from_flag = CliRunner().invoke(main, [*args, "--ttl", "junk"])
    assert from_flag.exit_code == 2 and "--ttl" in from_flag.output and "KCACHE_REF_TTL" not in from_flag.output


def test_cli_yank_signs_the_ref(tmp_path, store, sqlite_index, fp, keys):
    key = keys["prod"][0]
    v1 = _publish(tmp_path, store, sqlite_index, fp, b"good", key, "v1")
    v2 = _publish(tmp_path, store, sqlite_index, fp, b"broken", key, "v2")
    args = ["--store", f"file://{store.root}", "--index", f"sqlite:///{tmp_path / 'index.db'}"]
    out = CliRunner().invoke(main, ["yank", v2.bundle_id, "--signing-key", str(tmp_path / "keys/prod.key"), *args],
                             catch_exceptions=False)  # fmt: skip
    assert out.exit_code == 0, out.output
    store.delete(refs.yank_key(v2.bundle_id))
    assert _pod(store, fp, tmp_path / "dst", keys).bundle_id == v1.bundle_id


def test_legacy_unsigned_refs_still_serve_pods_that_do_not_require_signatures(tmp_path, store, sqlite_index, fp):
    published = _publish(tmp_path, store, sqlite_index, fp, b"a")
    legacy = {"schema": 1, "bundle_key": fp.bundle_key, "manifest": published.bundle_id,
              "created_at": "2026-01-01T00:00:00+00:00"}  # fmt: skip
    store.delete(ref_key(fp.bundle_key))
    store.put_if(ref_key(fp.bundle_key), json.dumps(legacy).encode(), None)
    assert restore(store, refs.RefCatalog(store), fp, tmp_path / "dst").status == "hit"


def test_reindex_rebuilds_yank_status_from_markers_and_refs(tmp_path, store, sqlite_index, fp, keys, yanked_v2):
    v1, v2 = yanked_v2
    fresh = Index.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    reindex(store, fresh)
    assert fresh.get_bundle(v2.bundle_id).status == "yanked" and fresh.newest_bundle(fp.bundle_key).id == v1.bundle_id
    # After a lost index a yanked bundle is not the newest any more: restores fall back, not miss.
    assert restore(store, fresh, fp, tmp_path / "dst").bundle_id == v1.bundle_id
    store.delete(refs.yank_key(v2.bundle_id))  # the signed ref's yank list is enough on its own
    again = Index.open(f"sqlite:///{tmp_path / 'again.db'}")
    reindex(store, again)
    assert again.get_bundle(v2.bundle_id).status == "yanked"
    fresh.close()
    again.close()


HEX = st.text("0123456789abcdef", min_size=64, max_size=64)
ZONES = st.sampled_from([timezone.utc, timezone(timedelta(hours=-7, minutes=-30))])
MOMENTS = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2200, 1, 1), timezones=ZONES)


@settings(max_examples=60, deadline=None)
@given(bundle_key=st.text(min_size=1, max_size=40), manifest=HEX, created=MOMENTS, generation=st.integers(0, 2**70),
       expires=st.none() | MOMENTS, yanked=st.lists(HEX, max_size=4, unique=True))  # fmt: skip
def test_refs_round_trip_canonically_and_keep_their_signature(bundle_key, manifest, created, generation, expires,
                                                               yanked):  # fmt: skip
    key = signing.SigningKey("p", bytes(range(32)))
    draft = refs.Ref(bundle_key, manifest, created, generation, expires, tuple(sorted(yanked)))
    ref = refs.Ref(**{**draft.__dict__, "signatures": (("p", signing.sign_message(key, draft.message())),)})
    again = refs.parse(ref.to_bytes(), bundle_key)
    assert again == ref and again.to_bytes() == ref.to_bytes() and again.message() == draft.message()


def test_refresh_all_takes_every_key_or_one_models(tmp_path, store, sqlite_index, fp, keys):
    from kcache import fingerprint

    other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
    _publish(tmp_path, store, sqlite_index, fp, b"a", name="mine")
    _publish(tmp_path, store, sqlite_index, other, b"b", name="theirs")
    key = keys["prod"][0]
    only = refs.refresh_all(store, sqlite_index, model="another-model", signer=key)
    assert list(only) == [other.bundle_key] and refs.read(store, fp.bundle_key).signatures == ()
    everything = refs.refresh_all(store, sqlite_index, signer=key)
    assert set(everything) == {fp.bundle_key, other.bundle_key}
    assert all(dict(refs.read(store, k).signatures).keys() == {"prod"} for k in everything)


def test_signed_refs_over_s3(tmp_path, s3_store, sqlite_index, fp, keys):
    key = keys["prod"][0]
    _publish(tmp_path, s3_store, sqlite_index, fp, b"good", key, "v1")
    v2 = _publish(tmp_path, s3_store, sqlite_index, fp, b"broken", key, "v2")
    assert _pod(s3_store, fp, tmp_path / "a", keys).bundle_id == v2.bundle_id
    yank(s3_store, sqlite_index, v2.bundle_id, signer=key)
    s3_store.delete(refs.yank_key(v2.bundle_id))
    pinned = _pod(s3_store, fp, tmp_path / "b", keys, bundle_id=v2.bundle_id)
    assert pinned.status == "miss" and "yanked" in pinned.reason


def test_a_yank_between_a_publishs_commit_and_its_ref_write_keeps_the_ref_off_the_yanked_bundle(
        tmp_path, store, sqlite_index, fp, keys, monkeypatch):  # fmt: skip
    key = keys["prod"][0]
    v1 = _publish(tmp_path, store, sqlite_index, fp, b"good", key, "v1")
    real = refs.advance

    def yank_first(target, ref, **kw):  # the operator yanks the new bundle the moment it committed
        if ref.bundle_key == fp.bundle_key:  # not the layer refs publish moves too
            yank(store, sqlite_index, ref.manifest, "NaNs", signer=key)
        return real(target, ref, **kw)

    monkeypatch.setattr(refs, "advance", yank_first)
    v2 = _publish(tmp_path, store, sqlite_index, fp, b"broken", key, "v2")
    monkeypatch.setattr(refs, "advance", real)
    ref = refs.read(store, fp.bundle_key)
    assert ref.manifest == v1.bundle_id and v2.bundle_id in ref.yanked
    store.delete(refs.yank_key(v2.bundle_id))  # a store writer deletes the marker: nothing comes back
    assert _pod(store, fp, tmp_path / "dst", keys).bundle_id == v1.bundle_id


def test_a_ref_removal_racing_a_publish_leaves_the_ref_of_the_new_bundle(tmp_path, store, sqlite_index, fp,
                                                                          monkeypatch):  # fmt: skip
    v1 = _publish(tmp_path, store, sqlite_index, fp, b"one", None, "v1")
    real_delete, published = store.delete, {}

    def delete(key):  # the yank of v1 decided "no active bundle: remove the ref"; v2 commits meanwhile
        if key == ref_key(fp.bundle_key) and not published:
            published["v2"] = _publish(tmp_path, store, sqlite_index, fp, b"two", None, "v2")
        return real_delete(key)

    monkeypatch.setattr(store, "delete", delete)
    yank(store, sqlite_index, v1.bundle_id, "bad")
    monkeypatch.setattr(store, "delete", real_delete)
    ref = refs.read(store, fp.bundle_key)
    assert ref is not None and ref.manifest == published["v2"].bundle_id


def test_a_pinned_bundle_of_another_fingerprint_or_none_is_a_miss(tmp_path, store, sqlite_index, fp, keys):
    from kcache import fingerprint

    other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
    theirs = _publish(tmp_path, store, sqlite_index, other, b"theirs", keys["prod"][0], "o")
    for catalog in (sqlite_index, refs.RefCatalog(store)):
        result = restore(store, catalog, fp, tmp_path / "a", bundle_id=theirs.bundle_id, trusted=(keys["prod"][1],))
        assert result.status == "miss" and "another fingerprint" in result.reason, result.reason
        gone = restore(store, catalog, fp, tmp_path / "b", bundle_id="ab" * 32)
        assert gone.status == "miss" and "not in the store" in gone.reason, gone.reason


@pytest.mark.parametrize("verb", ["yank-older", "refresh"])
def test_an_unsigned_yank_or_refresh_leaves_a_signed_ref_signed(tmp_path, store, sqlite_index, fp, keys, verb, caplog):
    """README's `kcache yank ID --reason ...` has no key: rewritten unsigned, the ref of a bundle it
    did not even touch sent every pod requiring signatures cold until someone refreshed it."""
    key = keys["prod"][0]
    v1 = _publish(tmp_path, store, sqlite_index, fp, b"old", key, "v1")
    v2 = _publish(tmp_path, store, sqlite_index, fp, b"new", key, "v2")
    if verb == "yank-older":
        yank(store, sqlite_index, v1.bundle_id, "NaNs")
    else:
        refs.refresh(store, sqlite_index, fp.bundle_key)
    ref = refs.read(store, fp.bundle_key)
    assert ref.manifest == v2.bundle_id and dict(ref.signatures).keys() == {"prod"}
    pod = _pod(store, fp, tmp_path / "pod", keys)
    assert (pod.status, pod.bundle_id) == ("hit", v2.bundle_id), pod.reason
    assert verb != "yank-older" or "--signing-key" in caplog.text


def test_a_bad_ref_ttl_setting_stops_publish_before_its_commit_point(tmp_path, store, sqlite_index, fp, monkeypatch):
    """KCACHE_REF_TTL was read only when the ref was written, after the bundle's row: publish (and
    prebake and watch through it) committed the bundle, wrote no ref and exited 2, as if nothing
    had been published, and every pod restoring through refs/ missed it."""
    monkeypatch.setenv("KCACHE_REF_TTL", "abc")
    with pytest.raises(ConfigError, match="KCACHE_REF_TTL"):
        _publish(tmp_path, store, sqlite_index, fp, b"a")
    assert sqlite_index.newest_bundle(fp.bundle_key) is None
    assert not store.exists(ref_key(fp.bundle_key))


@pytest.mark.parametrize("undo", [False, True])
def test_a_bad_ref_ttl_setting_stops_yank_and_undo_before_they_change_anything(tmp_path, store, sqlite_index, fp,
                                                                              monkeypatch, undo):  # fmt: skip
    """yank set the row yanked and wrote the marker, then failed on the TTL with the ref (and the layer
    refs) still naming the yanked bundle: verify then called the store damaged."""
    published = _publish(tmp_path, store, sqlite_index, fp, b"a")
    if undo:
        yank(store, sqlite_index, published.bundle_id)
    monkeypatch.setenv("KCACHE_REF_TTL", "abc")
    with pytest.raises(ConfigError, match="KCACHE_REF_TTL"):
        (unyank if undo else yank)(store, sqlite_index, published.bundle_id)
    assert sqlite_index.get_bundle(published.bundle_id).status == ("yanked" if undo else "active")
    assert store.exists(refs.yank_key(published.bundle_id)) == undo


def test_cli_refresh_re_signs_every_other_key_past_one_it_cannot_refresh(tmp_path, store, sqlite_index, fp, keys):
    """One key whose rows do not load (a damaged row, an index writer's) stopped the refresh CronJob at
    that key on every run: every key sorted after it kept its old ref until it expired, and the pods
    requiring signatures started cold on all of them."""
    import sqlite3

    from kcache import fingerprint

    key = keys["prod"][0]
    other = fingerprint.compute({**fp.facts, "model.id": "another-model"})
    published = {f.bundle_key: (f, _publish(tmp_path, store, sqlite_index, f, f.bundle_key.encode(), key, name))
                 for f, name in ((fp, "mine"), (other, "theirs"))}  # fmt: skip
    broken, fine = sorted(published)  # the key refreshed first is the one that fails
    broken_id, fine_fp = published[broken][1].bundle_id, published[fine][0]
    refs.refresh(store, sqlite_index, fine, signer=key, ttl=EXPIRED)
    assert _pod(store, fine_fp, tmp_path / "before", keys).status == "miss"
    with sqlite3.connect(tmp_path / "index.db") as db:
        db.execute("UPDATE bundles SET facts = '{' WHERE bundle_key = ?", (broken,))
    args = ["--store", f"file://{store.root}", "--index", f"sqlite:///{tmp_path / 'index.db'}"]
    out = CliRunner().invoke(main, ["refresh", "--signing-key", str(tmp_path / "keys/prod.key"), *args])
    assert _pod(store, fine_fp, tmp_path / "after", keys).status == "hit"
    assert out.exit_code == 5, out.output  # the index error, once every other key is done
    assert broken in out.output and broken_id[:12] in out.output and fine in out.output
    doc = json.loads(CliRunner().invoke(main, ["refresh", "--signing-key", str(tmp_path / "keys/prod.key"), "--json",
                                               *args]).stdout)  # fmt: skip
    assert (doc["status"], doc["exit_code"], [r["bundle_key"] for r in doc["refs"]]) == ("error", 5, [fine])
    assert [r["bundle_key"] for r in doc["failed"]] == [broken]


def test_refresh_all_stops_once_keys_keep_failing_one_after_another(tmp_path, store, sqlite_index, fp, keys):
    """Going on past a key that fails must not try every key of a fleet against an index that has gone
    away, each after its own timeouts: keys failing one after another end it, with the first error."""
    from kcache import fingerprint
    from kcache.errors import IndexDbError

    for n in range(5):
        model = fingerprint.compute({**fp.facts, "model.id": f"model-{n}"})
        _publish(tmp_path, store, sqlite_index, model, str(n).encode(), name=f"m{n}")

    class GoneAway:
        def __init__(self, inner):
            self.inner, self.asked = inner, 0

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def newest_bundle(self, bundle_key):
            self.asked += 1
            raise IndexDbError(self.inner.url, "connection refused")

    gone, failed = GoneAway(sqlite_index), {}
    with pytest.raises(IndexDbError, match="connection refused"):
        refs.refresh_all(store, gone, signer=keys["prod"][0], failed=failed)
    assert gone.asked == 3 and len(failed) == 2


@pytest.mark.parametrize("broken", ["deleted", "garbage", "from the future"])
def test_a_signed_re_publish_of_an_older_bundle_does_not_roll_a_broken_ref_back_to_it(tmp_path, store, sqlite_index,
                                                                                      fp, keys, broken):  # fmt: skip
    """A store writer removed the ref, or wrote one that cannot be read or is dated ahead of every clock: the
    next signed publish took it for no ref at all, and one that re-published an older bundle's files (a kept
    ROOT, a rebuild that came out the same) signed a fresh ref to that bundle. Pods requiring signatures then
    restored it past the newest, for a whole TTL and with no replay needed."""
    key = keys["prod"][0]
    v1 = _publish(tmp_path, store, sqlite_index, fp, b"old", key, "v1")
    v2 = _publish(tmp_path, store, sqlite_index, fp, b"new", key, "v2")
    store.delete(ref_key(fp.bundle_key))
    if broken == "garbage":
        store.put_if(ref_key(fp.bundle_key), b"{not a ref", None)
    elif broken == "from the future":
        ahead = refs.Ref(fp.bundle_key, v2.bundle_id, datetime.now(timezone.utc) + timedelta(days=30))
        store.put_if(ref_key(fp.bundle_key), ahead.to_bytes(), None)
    again = _publish(tmp_path, store, sqlite_index, fp, b"old", key, "v1")
    assert (again.bundle_id, again.created) == (v1.bundle_id, False)
    try:
        assert _pod(store, fp, tmp_path / "dst", keys).bundle_id != v1.bundle_id
    except IntegrityError:  # the garbage ref, left as it was: the pod starts cold
        assert broken == "garbage"
    refs.refresh(store, sqlite_index, fp.bundle_key, signer=key)  # what the key's refresh CronJob writes
    assert _pod(store, fp, tmp_path / "dst2", keys).bundle_id == v2.bundle_id
