"""Typos never replace good bundles: missing paths are errors, empty bundles need --allow-empty, and
a publish from a restored ROOT publishes under the workload that restore used. A file rewritten
under a running publish never commits a bundle that restore cannot lay out."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from trees import read_tree, write_tree

from kcache import canonical
from kcache.cli import main
from kcache.hashcache import HashCache, stat_key
from kcache.packs import Hashed
from kcache.publish import PublishConfig, publish, restore_inputs
from kcache.restore import restore
from kcache.sources import TritonSource

WORKLOAD = ("--model", "my-llm", "--extra", "tp=2")


def _cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def _bundles():
    return json.loads(_cli("ls", "--json").output)


@pytest.mark.parametrize("model", [("--model", "m"), ()], ids=["model", "model-from-root"])
def test_missing_from_dir_is_an_error_not_an_empty_bundle(tmp_path, model):
    """Without --model the workload comes from ROOT's restore record: a ROOT that is not there is
    the error to name, not the model it would have recorded."""
    result = _cli("publish", "--from", tmp_path / "no" / "such" / "dir", *model)
    assert result.exit_code == 7 and "does not exist" in result.stderr
    assert _bundles() == []


def test_missing_extra_dir_is_an_error(tmp_path):
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    result = _cli("publish", "--from", tmp_path / "src", "--model", "m", "--extra-dir", f"trt={tmp_path / 'missing'}")
    assert result.exit_code == 7 and "--extra-dir trt" in result.stderr
    assert _bundles() == []


@pytest.mark.parametrize("flag", ["--from", "--extra-dir"])
def test_a_source_dir_that_does_not_exist_gets_a_publish_hint(tmp_path, flag):
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    src = tmp_path / ("missing" if flag == "--from" else "src")
    extra = ["--extra-dir", f"trt={tmp_path / 'missing'}"] if flag == "--extra-dir" else []
    result = _cli("publish", "--from", src, "--model", "m", *extra, "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == doc["exit_code"] == 7 and flag in doc["error"]
    assert "--into" not in doc["hint"] and "--from" in doc["hint"] and "--extra-dir" in doc["hint"]


@pytest.mark.parametrize("model", ["", "  ", "\t"])
def test_a_blank_model_is_refused_quoting_what_was_given(tmp_path, model):
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    result = _cli("publish", "--from", tmp_path / "src", "--model", model, "--json")
    doc = json.loads(result.stdout)
    assert result.exit_code == doc["exit_code"] == 2
    assert doc["error"].startswith(f"--model {model!r}") and "'none'" not in doc["error"]
    assert _bundles() == []


def test_from_root_carries_the_extra_dirs_named(tmp_path):
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    write_tree(tmp_path / "trt", {"engine.timing": b"timing cache"})
    result = _cli("publish", "--from", tmp_path / "src", "--model", "m", "--extra-dir", f"trt={tmp_path / 'trt'}",
                  "--json")  # fmt: skip
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.output)
    assert "extra:trt" in doc["layers"] and doc["files"] == 2


def test_empty_bundle_needs_allow_empty(tmp_path):
    (tmp_path / "empty").mkdir()
    refused = _cli("publish", "--from", tmp_path / "empty", "--model", "m")
    assert refused.exit_code == 2 and "--allow-empty" in refused.stderr
    assert _bundles() == []
    allowed = _cli("publish", "--from", tmp_path / "empty", "--model", "m", "--allow-empty", "--json")
    assert allowed.exit_code == 0 and json.loads(allowed.output)["files"] == 0


@pytest.mark.parametrize("where", ["live", "root"])
def test_publish_without_a_model_is_refused(tmp_path, monkeypatch, where):
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "src" / "inductor"))
    args = ["publish"] + (["--from", tmp_path / "src"] if where == "root" else [])
    result = _cli(*args)
    assert result.exit_code == 2 and "--model" in result.stderr
    assert _bundles() == []


def test_publish_from_a_restored_root_uses_the_restore_workload(tmp_path):
    root = tmp_path / "cache"
    missed = json.loads(_cli("restore", "--into", root, *WORKLOAD, "--json").output)
    assert missed["status"] == "miss"
    assert restore_inputs(root) == {"model.id": "my-llm", "extra.tp": "2"}
    write_tree(root, {"inductor/fxgraph/k.py": b"compiled while cold"})
    published = json.loads(_cli("publish", "--from", root, "--json").output)  # no --model: ROOT says
    assert published["bundle_key"] == missed["bundle_key"]
    again = json.loads(_cli("restore", "--into", tmp_path / "next-pod", *WORKLOAD, "--json").output)
    assert (again["status"], again["bundle_id"]) == ("hit", published["bundle_id"])


def test_hostile_restore_record_is_ignored(tmp_path):
    (tmp_path / ".kcache-state.json").write_text(json.dumps({"status": "miss", "inputs": {"gpu.sm": "sm_90"}}))
    assert restore_inputs(tmp_path) is None  # only workload facts may come from ROOT


def test_a_model_id_the_index_would_refuse_fails_before_any_upload(tmp_path):
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    result = _cli("publish", "--from", tmp_path / "src", "--model", "m" * 5000, "--store", f"file://{tmp_path / 's'}")
    assert result.exit_code == 2 and "longer than" in result.stderr
    assert not (tmp_path / "s" / "packs").exists()


def test_a_bundle_whose_manifest_no_restore_would_read_fails_before_any_upload(tmp_path, monkeypatch):
    """Every restore refuses a manifest over KCACHE_MAX_MANIFEST_BYTES: publishing one would only make
    every pod's restore fail. Its size is known from the paths before a byte is hashed."""
    write_tree(tmp_path / "src", {f"inductor/fx/{i:04d}.py": b"x" for i in range(40)})
    monkeypatch.setenv("KCACHE_MAX_MANIFEST_BYTES", "4096")  # 40 rows of ~190 bytes do not fit
    result = _cli("publish", "--from", tmp_path / "src", "--model", "m", "--store", f"file://{tmp_path / 's'}")
    assert result.exit_code == 2, result.output
    assert "KCACHE_MAX_MANIFEST_BYTES" in result.stderr and "40 files" in result.stderr
    assert not (tmp_path / "s" / "packs").exists()
    assert _bundles() == []


def test_a_manifest_just_over_the_cap_is_refused_before_it_is_committed(tmp_path, monkeypatch):
    """The early bound counts each row's ids and least numbers; the real manifest is checked again."""
    write_tree(tmp_path / "src", {f"inductor/fx/{i:04d}.py": b"x" * 100_000 for i in range(10)})
    src = f"file://{tmp_path / 'probe'}"
    probe = json.loads(_cli("publish", "--from", tmp_path / "src", "--model", "m", "--store", src, "--json").output)
    size = (tmp_path / "probe" / "manifests" / probe["bundle_id"][:2] / probe["bundle_id"]).stat().st_size
    monkeypatch.setenv("KCACHE_MAX_MANIFEST_BYTES", str(size - 1))
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path / "other-home"))  # an index that has not seen the bundle
    result = _cli("publish", "--from", tmp_path / "src", "--model", "m", "--store", f"file://{tmp_path / 's'}")
    assert result.exit_code == 2, result.output
    assert "KCACHE_MAX_MANIFEST_BYTES" in result.stderr
    assert not (tmp_path / "s" / "manifests").exists() and _bundles() == []


def test_yank_with_wildcards_yanks_nothing(tmp_path):
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    assert _cli("publish", "--from", tmp_path / "src", "--model", "m").exit_code == 0
    result = _cli("yank", "%%%%%%")
    assert result.exit_code == 2  # not a hex prefix: a usage error
    assert [b["status"] for b in _bundles()] == ["active"]


def test_publish_without_a_writable_home_skips_the_hash_cache(tmp_path, monkeypatch):
    write_tree(tmp_path / "src", {"inductor/a.py": b"a"})
    (tmp_path / "home-is-a-file").write_text("")
    monkeypatch.setenv("KCACHE_HOME", str(tmp_path / "home-is-a-file" / "home"))  # cannot be created
    store, index = f"file://{tmp_path / 's'}", f"sqlite:///{tmp_path / 'i.db'}"
    result = _cli("publish", "--from", tmp_path / "src", "--model", "m", "--store", store, "--index", index)
    assert result.exit_code == 0, result.stderr


def test_workload_flags_win_over_the_restore_record_fact_by_fact(tmp_path):
    """--extra and --fact model.* without --model are not dropped: they win over ROOT's record, as
    every later source wins over an earlier one, and the model still comes from the record."""
    root = tmp_path / "cache"
    _cli("restore", "--into", root, "--model", "my-llm", "--extra", "tp=1", "--extra", "pp=2")
    write_tree(root, {"inductor/fxgraph/k.py": b"compiled with tp=2"})
    published = json.loads(_cli("publish", "--from", root, "--extra", "tp=2", "--fact", "model.dtype=bf16",
                                "--json").output)  # fmt: skip
    (row,) = _bundles()
    assert row["bundle_id"] == published["bundle_id"]
    assert {k: v for k, v in row["facts"].items() if k.startswith(("model.", "extra."))} == {
        "model.id": "my-llm", "extra.tp": "2", "extra.pp": "2", "model.dtype": "bf16"}  # fmt: skip
    pod = ("--model", "my-llm", "--extra", "tp=2", "--extra", "pp=2", "--fact", "model.dtype=bf16")
    again = json.loads(_cli("restore", "--into", tmp_path / "next-pod", *pod, "--json").output)
    assert (again["status"], again["bundle_id"]) == ("hit", published["bundle_id"])


# ---- a file rewritten between the walk and its hash ----------------------------------------------


class RewrittenAfterTheWalk(TritonSource):
    """The triton layer, with one file rewritten by a compile once the walk has listed it."""

    def __init__(self, victim: Path, content: bytes):
        self.victim, self.content = victim, content

    def walk(self, top):
        listed = list(super().walk(top))
        self.victim.write_bytes(self.content)
        yield from listed


KEPT = {"k1/b.cubin": (b"hello", 0o644)}


@pytest.mark.parametrize("content", [
    b"hello",  # the very bytes of another file of this publish (one blob, one pack entry)
    b"",  # the empty blob, which the index already holds
    b"hello world, and then some more",  # longer: no blob anywhere has these bytes yet
], ids=["another-files-bytes", "bytes-the-index-has", "grown"])  # fmt: skip
def test_a_file_whose_size_changed_since_the_walk_is_skipped(tmp_path, store, sqlite_index, fp, caplog, content):
    first = tmp_path / "first"
    write_tree(first, {"triton/k0/empty": b""})
    publish(store, sqlite_index, fp, [TritonSource()], root=first)  # the empty blob is in the index now
    root = tmp_path / "root"
    write_tree(root, {"triton/k1/a.cubin": b"kernel bytes", "triton/k1/b.cubin": b"hello"})
    result = publish(store, sqlite_index, fp, [RewrittenAfterTheWalk(root / "triton/k1/a.cubin", content)], root=root)
    assert result.files == 1
    assert "a.cubin" in caplog.text and "changed size since it was listed" in caplog.text
    out = restore(store, sqlite_index, fp, tmp_path / "dest")
    assert out.status == "hit" and read_tree(tmp_path / "dest/triton") == KEPT


def test_a_hash_cache_entry_naming_a_blob_of_another_size_never_reaches_the_manifest(tmp_path, store, sqlite_index,
                                                                                      fp, caplog):  # fmt: skip
    """Whatever the hash cache says (a file of a kcache before this check, a damaged one), the size
    a manifest records beside a blob is that blob's."""
    first = tmp_path / "first"
    write_tree(first, {"triton/k0/empty": b""})
    publish(store, sqlite_index, fp, [TritonSource()], root=first)
    root = tmp_path / "root"
    write_tree(root, {"triton/k1/a.cubin": b"kernel bytes", "triton/k1/b.cubin": b"hello"})
    cache = HashCache(tmp_path / "hashes.db")
    lie = Hashed(canonical.sha256(b""), 0)  # the empty blob, for a 12-byte file
    cache.remember([(stat_key(root / "triton/k1/a.cubin"), lie, 0)], hashing_started=10**19)
    result = publish(store, sqlite_index, fp, [TritonSource()], root=root, config=PublishConfig(hash_cache=cache))
    cache.close()
    assert result.files == 1 and "a.cubin" in caplog.text
    out = restore(store, sqlite_index, fp, tmp_path / "dest")
    assert out.status == "hit" and read_tree(tmp_path / "dest/triton") == KEPT


@pytest.mark.parametrize("how", ["--layers", "emptied"])
def test_a_publish_from_root_that_leaves_out_a_restored_layer_is_refused(tmp_path, how):
    """The newest bundle wins on restore: a publish --from ROOT without a layer the restore into ROOT
    laid down would take it from every later pod (and gc then deletes the last bundle holding it)."""
    write_tree(tmp_path / "src", {"inductor/fx/a": b"graph", "triton/t/b": b"kernel"})
    assert _cli("publish", "--from", tmp_path / "src", *WORKLOAD).exit_code == 0
    root = tmp_path / "root"
    assert "hit" in _cli("restore", "--into", root, *WORKLOAD).output
    write_tree(root, {"triton/t/c": b"new kernel"})
    before = _bundles()
    args = ("--layers", "triton") if how == "--layers" else ()
    if how == "emptied":
        (root / "inductor/fx/a").unlink()
    refused = _cli("publish", "--from", root, *WORKLOAD, *args)
    assert refused.exit_code == 2 and "inductor" in refused.stderr and "--drop-layers" in refused.stderr
    assert _bundles() == before
    assert _cli("publish", "--from", root, *WORKLOAD, *args, "--drop-layers").exit_code == 0
    assert len(_bundles()) == len(before) + 1


def test_a_manifest_every_restore_would_refuse_is_not_published(tmp_path):
    """Restore refuses a manifest of more than MAX_LAYERS layers (a store writer's 2M of them took a
    restore to 1.4 GiB); publish wrote one from 257 --extra-dir, and every pod of the key missed."""
    from kcache.manifest import MAX_LAYERS

    extras = []
    for i in range(MAX_LAYERS + 1):
        write_tree(tmp_path / "x" / str(i), {"f": str(i).encode()})
        extras += ["--extra-dir", f"x{i}={tmp_path / 'x' / str(i)}"]
    result = _cli("publish", "--from", tmp_path / "x", "--model", "m", *extras, "--allow-empty")
    assert result.exit_code != 0 and "every restore would refuse" in result.stderr, result.stderr
    assert _bundles() == []
