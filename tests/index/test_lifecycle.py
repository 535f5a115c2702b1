"""gc's, verify's and the layer refs' walks over every bundle: the rule each keeps, and what each loads.

At 110k bundles every row held with its parsed facts took ~1.3 GiB (docs/index-scale.md): the walks
hold heads without facts, or stream rows and stop. What they load is counted in Bundles made."""

from datetime import datetime, timedelta, timezone

import pytest

from kcache import gc, layerkeys, verify
from kcache.index import Bundle, lifecycle, repo

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def add(index, n: int, key: str, minutes: int, *, layers=("cuda",), status="active", ok="1") -> str:
    bundle_id = f"{n:064x}"
    index.add_bundle(Bundle(bundle_id, key, "tk", "wk", "m", {"ok": ok, "gpu.sm": "90"}, tuple(layers), 1, 10,
                            T0 + timedelta(minutes=minutes), "host", status), keep_time=True)  # fmt: skip
    return bundle_id


def test_newest_holders_are_each_keys_newest_active_bundle_listing_the_layer(index):
    a_old = add(index, 1, "A", 1)  # A's newest lists no cuda: no A bundle is a holder
    add(index, 2, "A", 5, layers=("triton",))
    b_new = add(index, 3, "B", 4, status="yanked")  # B's newest active one is b
    b = add(index, 4, "B", 2)
    add(index, 5, "C", 3, ok="0")  # its key's newest, but `gives` refuses it
    add(index, 6, "D", 6, layers=("cuda-extra", "inductor"))  # "cuda" only as part of another name
    e_without = add(index, 7, "E", 7)  # left out: E's newest is then e
    e = add(index, 8, "E", -1)
    f_tie = add(index, 9, "F", 0)  # the same time as the next: the lower id is the newer
    add(index, 10, "F", 0)
    gives = lambda b: b.facts["ok"] == "1"  # noqa: E731

    found = lifecycle.newest_holders(index, "cuda", gives, 20, without=e_without)
    assert [h.id for h in found] == [b, f_tie, e]
    assert [h.id for h in lifecycle.newest_holders(index, "cuda", gives, 1, without=e_without)] == [b]
    assert [h.id for h in lifecycle.newest_holders(index, "cuda", gives, 20)][0] == e_without
    assert a_old not in {h.id for h in found} and b_new not in {h.id for h in found}
    assert [h.id for h in lifecycle.newest_holders(index, "deep_gemm", gives, 20)] == []  # "_" is no wildcard


def test_bundle_heads_are_every_bundle_newest_first(index):
    ids = [add(index, i, f"k{i % 3}", i, status="yanked" if i == 4 else "active") for i in range(1, 8)]
    heads = lifecycle.bundle_heads(index)
    assert [h.id for h in heads] == ids[::-1]
    assert heads[3] == lifecycle.BundleHead(ids[3], "k1", "m", "yanked", T0 + timedelta(minutes=4))
    assert lifecycle.bundle(index, ids[0]).facts == {"ok": "1", "gpu.sm": "90"}
    assert lifecycle.bundle(index, "f" * 64) is None
    assert lifecycle.bundle_keys(index) == ["k0", "k1", "k2"] and lifecycle.bundle_keys(index, "other") == []


@pytest.fixture
def loaded(monkeypatch):
    """How many bundle rows were made into Bundles (their facts parsed), however they were read."""
    made, bundle_of = [], repo.bundle_of

    def counting(row):
        made.append(row.id)
        return bundle_of(row)

    for module in (repo, lifecycle):
        monkeypatch.setattr(module, "bundle_of", counting)
    return made


def test_a_donor_lookup_loads_no_more_bundles_than_it_may_read_manifests_of(sqlite_index, store, loaded):
    """gc and yank ask once per layer ref they move: each ask loaded every bundle with its facts."""
    for i in range(3 * layerkeys._DONOR_READS):  # each its key's newest, each holding cuda under one layer key
        add(sqlite_index, i, f"key{i}", i)
    key = layerkeys.layer_key("cuda", {"ok": "1", "gpu.sm": "90"})
    assert layerkeys.donor_ref(store, sqlite_index, "cuda", key) is None  # the store holds no manifest
    assert 0 < len(loaded) <= layerkeys._DONOR_READS


def test_gc_plan_and_verify_load_no_bundle_facts(sqlite_index, store, loaded):
    for i in range(30):
        add(sqlite_index, i, f"key{i % 10}", i)
    plan = gc.plan(store, sqlite_index, gc.Policy(keep_last=3), now=T0 + timedelta(days=1))
    assert len(plan.delete_bundles) == 0 and len(plan.broken) == 30  # the store holds no manifest: all were looked at
    result = verify.verify(store, sqlite_index)
    assert result.bundles == 30
    assert loaded == []


def test_a_spared_bundle_holds_no_keep_last_place_in_the_delete_check(index):
    """gc's delete re-checks its rule in one statement; a half-yanked bundle (kcache.gc._half_yanked)
    must not count there as the one active bundle kept."""
    old = add(index, 1, "A", 1)
    half = add(index, 2, "A", 2)
    cutoff = T0 + timedelta(days=1)
    old_bundle = index.get_bundle(old)
    assert not lifecycle.delete_expired_bundle(index, old_bundle, 1, cutoff, spare=[half])
    assert lifecycle.has_bundle(index, old)
    assert lifecycle.delete_expired_bundle(index, old_bundle, 1, cutoff)
