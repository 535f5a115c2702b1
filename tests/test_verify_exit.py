"""`kcache verify` tells three outcomes apart: all sound (0), damage found (12), could not check (4)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from trees import write_tree

from kcache import signing, sources
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.errors import StoreError
from kcache.publish import PublishConfig, publish
from kcache.store import manifest_key, pack_key
from kcache.store.local import LocalStore
from kcache.verify import verify

LAYERS = sources.select()


class FailingReads:
    """Wraps a store: every read under `prefix` fails as an endpoint's 503s do once retries are spent."""

    def __init__(self, inner, prefix: str):
        self.inner, self.url, self.prefix = inner, inner.url, prefix

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open_range(self, key, offset, length):
        if key.startswith(self.prefix):
            raise StoreError(self.url, f"cannot read {key}: 503 Slow Down")
        return self.inner.open_range(key, offset, length)

    def get_versioned(self, key, limit=None):  # how refs are read: one GET of one version
        if key.startswith(self.prefix):
            raise StoreError(self.url, f"cannot read {key}: 503 Slow Down")
        return self.inner.get_versioned(key, limit)


def _publish(tmp_path, store, index, fp, name="src"):
    write_tree(tmp_path / name, {"inductor/a": name.encode() * 100, "triton/k/k.cubin": b"kernel"})
    return publish(store, index, fp, LAYERS, root=tmp_path / name, env={})


@pytest.mark.parametrize("prefix, read_data", [("manifests/", False), ("packs/", True), ("refs/", False)])
def test_reads_the_store_failed_are_unchecked_not_damage(tmp_path, store, sqlite_index, fp, prefix, read_data):
    _publish(tmp_path, store, sqlite_index, fp)
    assert verify(store, sqlite_index, read_data=read_data).status == "ok"
    result = verify(FailingReads(store, prefix), sqlite_index, read_data=read_data)
    assert result.problems == ()  # nothing is known to be wrong
    assert result.unchecked and all("503" in u for u in result.unchecked)
    assert result.status == "unchecked"


def test_damage_wins_over_reads_that_failed(tmp_path, store, sqlite_index, fp):
    published = _publish(tmp_path, store, sqlite_index, fp)
    store.delete(pack_key(next(iter(_packs(store)))))
    result = verify(FailingReads(store, "refs/"), sqlite_index)
    assert result.unchecked and any("missing" in p for p in result.problems) and result.status == "damaged"
    assert published.bundle_id[:12] in result.problems[0]


def _packs(store):
    return [info.key.rsplit("/", 1)[-1] for info in store.list("packs/")]


def test_cli_exit_codes_and_json_status(tmp_path, isolated_home, monkeypatch):
    runner = CliRunner()
    write_tree(tmp_path / "src", {"inductor/a": b"a", "triton/k/k.cubin": b"kernel"})
    out = runner.invoke(main, ["publish", "--from", str(tmp_path / "src"), "--model", "m1", "--json"])
    assert out.exit_code == 0, out.output
    bundle_id = json.loads(out.stdout)["bundle_id"]

    clean = runner.invoke(main, ["verify", "--json"])
    assert clean.exit_code == 0 and json.loads(clean.stdout)["status"] == "ok"
    assert json.loads(clean.stdout)["layer_refs"] >= 1

    # The store fails every read of a pack (the command opens its own store: the fault goes into the class).
    real = LocalStore.open_range

    def failing(self, key, offset, length):
        if key.startswith("packs/"):
            raise StoreError(self.url, f"cannot read {key}: 503 Slow Down")
        return real(self, key, offset, length)

    monkeypatch.setattr(LocalStore, "open_range", failing)
    unchecked = runner.invoke(main, ["verify", "--read-data", "--json"])
    assert unchecked.exit_code == ExitCode.STORE, unchecked.output
    doc = json.loads(unchecked.stdout)
    assert doc["status"] == "unchecked" and doc["problems"] == [] and "503" in doc["unchecked"][0]
    text = runner.invoke(main, ["verify", "--read-data"])
    assert text.exit_code == ExitCode.STORE and "could not check" in text.output
    monkeypatch.setattr(LocalStore, "open_range", real)

    manifest = isolated_home / "store" / manifest_key(bundle_id)
    manifest.chmod(0o644)
    manifest.write_bytes(manifest.read_bytes()[:-1] + b" ")  # damaged: hashes to another id
    damaged = runner.invoke(main, ["verify", "--json"])
    assert damaged.exit_code == ExitCode.PROBLEMS and json.loads(damaged.stdout)["status"] == "damaged"


def test_a_subset_without_read_data_is_refused_not_ignored(isolated_home):
    """--subset slices the packs whose data is read: without --read-data a nightly job that meant to
    read a seventh of the packs would check existence only, and report "ok" every night."""
    runner = CliRunner()
    alone = runner.invoke(main, ["verify", "--subset", "3/7", "--json"])
    assert alone.exit_code == ExitCode.USAGE, alone.output
    error = json.loads(alone.stdout)
    assert "--subset" in error["error"] and "--read-data" in error["error"], error
    assert runner.invoke(main, ["verify", "--subset", "1/1", "--read-data", "--json"]).exit_code == 0
    blank = runner.invoke(main, ["verify", "--subset", "", "--read-data", "--json"])  # a variable expanded to nothing
    assert blank.exit_code == ExitCode.USAGE and "--subset" in json.loads(blank.stdout)["error"], blank.output


class PublishedAfterListing:
    """Wraps a store: `publish()` runs once verify has listed `prefix`, before it reads anything
    else (a pod's publish committing while verify works through a large store)."""

    def __init__(self, inner, prefix: str, publish):
        self.inner, self.url, self.prefix, self._publish = inner, inner.url, prefix, publish

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def list(self, prefix):
        yield from self.inner.list(prefix)
        if prefix == self.prefix and self._publish is not None:
            run, self._publish = self._publish, None
            run()


@pytest.mark.parametrize("listed", ["packs/", "signatures/", "manifests/"])
def test_a_publish_committed_while_verify_runs_is_no_damage(tmp_path, store, sqlite_index, fp, listed):
    """verify lists packs/ and signatures/ (and manifests/, for the refs) before it reads the bundles
    (and the refs): a bundle a publish committed in between named packs, a signature and its ref a
    manifest that the listing lacked, and a sound store was reported damaged (exit 12) to whoever
    runs verify beside a fleet."""
    private, public = signing.generate("k1", tmp_path / "keys")
    config = PublishConfig(signing_key=signing.load_signing_key(private))

    def publish_tree(name: str):
        write_tree(tmp_path / name, {"inductor/a": name.encode() * 100, "triton/k/k.cubin": b"kernel"})
        return publish(store, sqlite_index, fp, LAYERS, root=tmp_path / name, env={}, config=config)

    publish_tree("src")
    late = PublishedAfterListing(store, listed, lambda: publish_tree("late"))
    trusted = tuple(signing.load_trusted_keys([public]))
    result = verify(late, sqlite_index, trusted=trusted)
    assert late._publish is None  # the publish did run in between
    assert result.problems == () and result.status == "ok"
    assert verify(store, sqlite_index, trusted=trusted).bundles == 2


class CollectedBeforeFirstManifest:
    """Wraps a store: `collect()` runs before verify first asks for a manifest, once it has read the
    index's bundles (a gc CronJob deleting an expired bundle while verify works)."""

    def __init__(self, inner, collect):
        self.inner, self.url, self._collect = inner, inner.url, collect

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def size(self, key):
        if key.startswith("manifests/") and self._collect is not None:
            run, self._collect = self._collect, None
            run()
        return self.inner.size(key)


def test_a_bundle_gc_deleted_while_verify_runs_is_no_damage(tmp_path, store, sqlite_index, fp):
    """verify reads the index's bundles, then each one's manifest: a bundle gc deleted in between
    (row, then manifest) was reported as a bundle whose manifest is missing, exit 12."""
    from datetime import timedelta

    from kcache import gc

    _publish(tmp_path, store, sqlite_index, fp, name="v1")
    _publish(tmp_path, store, sqlite_index, fp, name="v2")
    policy = gc.Policy(keep_last=1, older_than=timedelta(0), grace=timedelta(hours=6))
    collecting = CollectedBeforeFirstManifest(store, lambda: gc.execute(store, sqlite_index,
                                                                        gc.plan(store, sqlite_index, policy)))
    result = verify(collecting, sqlite_index)
    assert collecting._collect is None and sqlite_index.count_bundles() == 1  # gc did delete one in between
    assert result.problems == () and result.status == "ok"
