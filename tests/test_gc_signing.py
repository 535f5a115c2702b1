"""gc re-points a ref it must move (the bundle it named is deleted) with the signing key, and keeps
the key's yank list in it: an unsigned ref made every pod requiring signatures miss until refresh."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

from click.testing import CliRunner
from trees import write_tree

from kcache import gc, refs, signing, sources
from kcache.cli import main
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.yank import yank


def _publish(tmp_path, store, index, fp, content: bytes, key, name):
    write_tree(tmp_path / name, {"inductor/a": content})
    return publish(store, index, fp, sources.select(), root=tmp_path / name, env={},
                   config=PublishConfig(signing_key=key))  # fmt: skip


def test_gc_signs_the_ref_it_repoints_and_keeps_the_yank_list(tmp_path, store, sqlite_index, fp):
    private, public = signing.generate("prod", tmp_path / "keys")
    key, trusted = signing.load_signing_key(private), signing.load_trusted_keys([public])
    v1, v2, v3 = (_publish(tmp_path, store, sqlite_index, fp, c, key, n) for c, n in
                  ((b"one", "v1"), (b"two", "v2"), (b"three", "v3")))  # fmt: skip
    yank(store, sqlite_index, v1.bundle_id, "bad", signer=key)
    nothing = gc.plan(store, sqlite_index, gc.Policy(3, timedelta(days=7), timedelta(hours=6)))
    newest = sqlite_index.get_bundle(v3.bundle_id)
    keep_none = gc.Policy(0, timedelta(0), timedelta(hours=6))  # gc re-checks the policy before it deletes
    gc.execute(store, sqlite_index, replace(nothing, policy=keep_none, delete_bundles=(newest,)), signer=key)

    ref = refs.read(store, fp.bundle_key)
    assert (ref.manifest, ref.yanked) == (v2.bundle_id, (v1.bundle_id,))
    pod = restore(store, refs.RefCatalog(store), fp, tmp_path / "root", trusted=trusted, require_signature=True)
    assert (pod.status, pod.bundle_id) == ("hit", v2.bundle_id), pod.reason


def test_gc_takes_the_signing_key_flag_and_environment(tmp_path):
    missing = str(tmp_path / "no-such.key")
    for args, env in ((["--signing-key", missing], {}), ([], {"KCACHE_SIGNING_KEY": missing})):
        result = CliRunner().invoke(main, ["gc", "--dry-run", *args], env=env)
        assert result.exit_code == 2 and "no-such.key" in result.output + result.stderr, result.output
