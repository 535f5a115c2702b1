"""Refs a store writer without the signing key plants, as gc's check of its index meets them.

gc refuses an index that lacks a bundle some `refs/<bundle-key>` names (it is not the publishers'
index). A ref naming a manifest the store does not hold says nothing about which index is right,
and there is nothing of that bundle gc could delete: one such object must not stop every gc run.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from gc_helpers import publish_tree

from kcache import fingerprint, gc, refs
from kcache.errors import ConfigError
from kcache.index import Index
from kcache.store import manifest_key

POLICY = gc.Policy(keep_last=1, older_than=timedelta(days=7), grace=timedelta(hours=6))


def test_a_planted_ref_naming_no_manifest_does_not_stop_gc(tmp_path, store, sqlite_index, fp):
    publish_tree(tmp_path, store, sqlite_index, fp, b"kernel" * 100, "v1")
    planted = fingerprint.compute({**fp.facts, "model.id": "planted"}).bundle_key
    assert refs.advance(store, refs.Ref(planted, "f" * 64, datetime.now(timezone.utc)))
    plan = gc.plan(store, sqlite_index, POLICY)  # refused before: "has no row for 1 bundles the store's refs name"
    assert plan.delete_bundles == () and plan.orphans == ()


def test_the_refusal_names_the_ref_to_look_at(tmp_path, store, sqlite_index, fp):
    published = publish_tree(tmp_path, store, sqlite_index, fp, b"kernel" * 100, "v1")
    other = Index.open(f"sqlite:///{tmp_path / 'another.db'}")
    try:
        with pytest.raises(ConfigError, match=f"refs/{fp.bundle_key}"):
            gc.plan(store, other, POLICY)
    finally:
        other.close()
    assert store.exists(manifest_key(published.bundle_id))
