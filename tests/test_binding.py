"""An index describes one store: never used for another, never created by a reader, and restore
falls back to refs/ for keys the index has never seen."""

import json

import pytest
from click.testing import CliRunner
from trees import read_tree, write_tree

from kcache import binding, config
from kcache.cli import main
from kcache.errors import StoreMismatch
from kcache.index import Index
from kcache.store import open_store
from kcache.store.local import LocalStore

TREE = {"inductor/fxgraph/k.py": b"kernel source" * 50, "triton/abc/k.cubin": b"cubin" * 80}


def _cli(*args, ok=True):
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    if ok:
        assert result.exit_code == 0, result.output + result.stderr
    return result


def _publish(src, store_url, *extra):
    args = ("publish", "--from", str(src), "--model", "m", "--store", store_url, "--json", *extra)
    return json.loads(_cli(*args).output)


def test_publishing_to_a_second_store_with_the_same_index_is_refused(tmp_path):
    write_tree(tmp_path / "src", TREE)
    first = _publish(tmp_path / "src", f"file://{tmp_path / 'a'}")
    assert first["new_blobs"] == 2
    refused = _cli("publish", "--from", str(tmp_path / "src"), "--model", "m", "--store", f"file://{tmp_path / 'b'}",
                   ok=False)  # fmt: skip
    assert refused.exit_code == 2 and "describes the store" in refused.stderr and str(tmp_path / "a") in refused.stderr
    assert not (tmp_path / "b" / "packs").exists()  # nothing half-published
    # With its own index, the second store gets every pack it needs and restores.
    second = _publish(tmp_path / "src", f"file://{tmp_path / 'b'}", "--index", f"sqlite:///{tmp_path / 'b.db'}")
    assert second["new_blobs"] == 2
    _cli("restore", "--into", str(tmp_path / "dst"), "--model", "m", "--store", f"file://{tmp_path / 'b'}",
         "--index", "none", "--strict")  # fmt: skip
    assert read_tree(tmp_path / "dst" / "inductor") == {"fxgraph/k.py": (TREE["inductor/fxgraph/k.py"], 0o644)}


def test_store_id_is_written_once_and_survives_a_url_alias(tmp_path):
    store = LocalStore(tmp_path / "s")
    first = binding.ensure_store_id(store)
    assert binding.ensure_store_id(store) == first
    (tmp_path / "alias").symlink_to(tmp_path / "s")
    alias = LocalStore(tmp_path / "alias")
    index = Index.open(f"sqlite:///{tmp_path / 'i.db'}")
    binding.check(index, store, write=True)
    binding.check(index, alias, write=True)  # another URL, the same store: accepted
    with pytest.raises(StoreMismatch):
        binding.check(index, LocalStore(tmp_path / "other"), write=False)
    index.close()


def test_hostile_store_id_is_refused(tmp_path):
    from kcache.errors import IntegrityError

    store = LocalStore(tmp_path / "s")
    store.put_bytes(binding.STORE_ID_KEY, b'{"store_id": "../../etc"}')
    with pytest.raises(IntegrityError):
        binding.read_store_id(store)


@pytest.mark.parametrize("command", [["ls"], ["show", "abcdef012345"], ["stats"], ["explain", "--model", "m"],
                                     ["verify"]])  # fmt: skip
def test_read_only_commands_create_no_index(tmp_path, isolated_home, command):
    _cli(*command, ok=False)
    assert not (isolated_home / "index.db").exists()


def test_ls_on_a_fresh_home_leaves_refs_restores_hitting(tmp_path, isolated_home):
    store_url = f"file://{tmp_path / 'shared'}"
    write_tree(tmp_path / "src", TREE)
    _publish(tmp_path / "src", store_url, "--index", f"sqlite:///{tmp_path / 'publisher.db'}")
    listed = _cli("ls", "--json", "--store", store_url)
    assert json.loads(listed.output) == []
    restored = _cli("restore", "--into", str(tmp_path / "dst"), "--model", "m", "--store", store_url, "--json")
    assert json.loads(restored.output)["status"] == "hit"
    assert not (isolated_home / "index.db").exists()


def test_restore_falls_back_to_refs_for_keys_the_index_never_saw(tmp_path, isolated_home):
    store_url = f"file://{tmp_path / 'shared'}"
    write_tree(tmp_path / "a", {"inductor/a.py": b"model a"})
    write_tree(tmp_path / "b", TREE)
    _cli("publish", "--from", str(tmp_path / "a"), "--model", "a", "--store", store_url)  # the default index
    _publish(tmp_path / "b", store_url, "--index", f"sqlite:///{tmp_path / 'other.db'}")  # model m elsewhere
    assert (isolated_home / "index.db").exists()
    restored = _cli("restore", "--into", str(tmp_path / "dst"), "--model", "m", "--store", store_url, "--json")
    assert json.loads(restored.output)["status"] == "hit"


def test_a_yank_the_index_knows_is_not_undone_by_refs(tmp_path, store, sqlite_index, fp):
    from kcache import sources
    from kcache.publish import publish
    from kcache.refs import RefCatalog
    from kcache.yank import yank

    write_tree(tmp_path / "src", TREE)
    binding.check(sqlite_index, store, write=True)
    published = publish(store, sqlite_index, fp, sources.select(), root=tmp_path / "src", env={})
    yank(store, sqlite_index, published.bundle_id, "bad")
    catalog = binding.FallbackCatalog(sqlite_index, RefCatalog(store))
    assert catalog.newest_bundle(fp.bundle_key) is None


def test_default_index_of_another_store_is_skipped_by_restore_and_a_named_one_refused(tmp_path, isolated_home):
    write_tree(tmp_path / "src", TREE)
    _publish(tmp_path / "src", f"file://{tmp_path / 'a'}")  # binds the default index to store a
    _publish(tmp_path / "src", f"file://{tmp_path / 'b'}", "--index", f"sqlite:///{tmp_path / 'b.db'}")
    store_b = open_store(f"file://{tmp_path / 'b'}")
    cfg = config.resolve(f"file://{tmp_path / 'b'}")
    catalog = binding.open_for_restore(cfg, store_b)
    assert type(catalog).__name__ == "RefCatalog"
    assert catalog.newest_bundle(
        json.loads(_cli("fingerprint", "--model", "m", "--json").output)["bundle_key"]) is not None  # fmt: skip
    named = config.resolve(f"file://{tmp_path / 'b'}", f"sqlite:///{isolated_home / 'index.db'}")
    with pytest.raises(StoreMismatch):
        binding.open_for_restore(named, store_b)


def test_refresh_never_signs_refs_from_the_index_of_another_store(tmp_path):
    write_tree(tmp_path / "src", TREE)
    _publish(tmp_path / "src", f"file://{tmp_path / 'a'}")
    _cli("keygen", "prod", "--dir", str(tmp_path / "keys"))
    key = str(tmp_path / "keys" / "prod.key")
    (tmp_path / "b").mkdir()  # another store, empty (one that does not exist is a StoreError before any check)
    refused = _cli("refresh", "--signing-key", key, "--store", f"file://{tmp_path / 'b'}", ok=False)
    assert refused.exit_code == 2 and "describes the store" in refused.stderr
    assert not (tmp_path / "b" / "refs").exists()  # no ref signed for bundles store b does not hold


def test_a_default_index_that_cannot_be_opened_leaves_restore_the_refs(tmp_path, isolated_home, monkeypatch):
    """A read-only KCACHE_HOME (its SQLite file cannot be opened for writing its journal) must not
    cost the pod its bundle: the default index is only a guess, refs/ still answer. A named index
    that cannot be opened stays an error."""
    from kcache.errors import IndexDbError

    write_tree(tmp_path / "src", TREE)
    _publish(tmp_path / "src", f"file://{tmp_path / 'a'}")  # writes the default index, and refs
    store = open_store(f"file://{tmp_path / 'a'}")

    def unopenable(url, *a, **kw):
        raise IndexDbError(url, "cannot connect: unable to open database file")

    monkeypatch.setattr(Index, "open", staticmethod(unopenable))
    catalog = binding.open_for_restore(config.resolve(f"file://{tmp_path / 'a'}"), store)
    assert type(catalog).__name__ == "RefCatalog"
    named = config.resolve(f"file://{tmp_path / 'a'}", f"sqlite:///{isolated_home / 'index.db'}")
    with pytest.raises(IndexDbError):
        binding.open_for_restore(named, store)
