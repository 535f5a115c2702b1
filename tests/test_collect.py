"""What publish collects from a layer: files a manifest can carry, inside the layer, and nothing half-written.

Each case is a real tree on disk: a file name that is not UTF-8, a file removed between the walk and
the hash, a layer root that is a symbolic link out of ROOT, Triton's temporary directories.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner
from trees import nest, read_tree, write_tree

from kcache import manifest as manifests
from kcache import sources
from kcache.cli import main
from kcache.publish import collect, publish
from kcache.removal import remove_tree
from kcache.restore import restore
from kcache.sources import TritonSource
from kcache.sources.base import torch_user
from kcache.store import manifest_key

NON_UTF8 = b"k\xff\xfe.cubin"  # a byte sequence no UTF-8 text can hold


def published_paths(store, result) -> set[str]:
    return {e.path for e in manifests.parse(store.get_bytes(manifest_key(result.bundle_id)), result.bundle_id).entries}


def test_a_file_name_that_is_not_utf8_is_skipped_with_a_warning(tmp_path, store, sqlite_index, fp, caplog):
    root = tmp_path / "root"
    write_tree(root, {"triton/k1/good.cubin": b"kernel"})
    (root / "triton/k1").joinpath(os.fsdecode(NON_UTF8)).write_bytes(b"odd name")
    os.mkdir(os.path.join(os.fsencode(root / "triton"), b"dir\xff"))
    (root / "triton").joinpath(os.fsdecode(b"dir\xff"), "inside.cubin").write_bytes(b"under an odd directory")
    with caplog.at_level("WARNING", logger="kcache.sources.base"):
        result = publish(store, sqlite_index, fp, sources.select(), root=root)
    assert published_paths(store, result) == {"triton/k1/good.cubin"}
    assert "not valid UTF-8" in caplog.text
    dest = tmp_path / "dest"
    assert restore(store, sqlite_index, fp, dest).status == "hit"
    assert read_tree(dest / "triton") == {"k1/good.cubin": (b"kernel", 0o644)}


def test_a_file_name_a_manifest_refuses_is_skipped(tmp_path, store, sqlite_index, fp, caplog):
    root = tmp_path / "root"
    write_tree(root, {"inductor/fxgraph/a": b"graph", "inductor/fxgraph/back\\slash": b"x"})
    with caplog.at_level("WARNING", logger="kcache.sources.base"):
        result = publish(store, sqlite_index, fp, sources.select(), root=root)
    assert published_paths(store, result) == {"inductor/fxgraph/a"}
    assert "backslash" in caplog.text
    assert restore(store, sqlite_index, fp, tmp_path / "dest").status == "hit"


def test_cli_publish_with_an_odd_name_succeeds(tmp_path):
    root = tmp_path / "root"
    write_tree(root, {"cuda/ok": b"sass"})
    (root / "cuda").joinpath(os.fsdecode(NON_UTF8)).write_bytes(b"x")
    result = CliRunner().invoke(main, ["publish", "--from", str(root), "--model", "m", "--json"],
                                catch_exceptions=False)  # fmt: skip
    assert result.exit_code == 0, result.output


class Vanishing(TritonSource):
    """Triton's layer, whose `victim` is removed once the walk has listed it (a compile cleaning up)."""

    def __init__(self, victim: Path):
        self.victim = victim

    def walk(self, top: Path):
        listed = list(super().walk(top))
        assert any(info.path == self.victim for info in listed)
        self.victim.unlink()
        yield from listed


def test_a_file_removed_between_walk_and_hash_is_skipped(tmp_path, store, sqlite_index, fp, caplog):
    root = tmp_path / "root"
    write_tree(root, {"triton/k1/a.cubin": b"stays", "triton/k1/b.cubin": b"goes"})
    with caplog.at_level("WARNING", logger="kcache.publish"):
        result = publish(store, sqlite_index, fp, [Vanishing(root / "triton/k1/b.cubin")], root=root)
    assert published_paths(store, result) == {"triton/k1/a.cubin"}
    assert "b.cubin" in caplog.text and "removed" in caplog.text
    assert restore(store, sqlite_index, fp, tmp_path / "dest").status == "hit"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A directory outside ROOT that must never be published (it stands for /etc/ssh)."""
    write_tree(tmp_path / "outside", {"ssh_host_ed25519_key": b"SECRET", "sub/more": b"SECRET too"})
    return tmp_path / "outside"


@pytest.mark.parametrize("link", ["vllm", "triton", "extra", "extra/trt", "tmp"])
def test_a_layer_root_that_is_a_link_is_not_followed(tmp_path, store, sqlite_index, fp, outside, link, caplog):
    root = tmp_path / "root"
    write_tree(root, {"cuda/entry": b"sass"})
    if link == "extra":  # ROOT/extra/NAME as restore lays it, but the link is one level up
        (root / "extra").symlink_to(tmp_path / "extras")
        write_tree(tmp_path / "extras", {"trt/timing": b"SECRET", "init.d/ssh": b"not a layer name"})
    elif link == "extra/trt":  # the extra layer's own directory is the link
        (root / "extra").mkdir()
        (root / "extra/trt").symlink_to(outside)
    elif link == "tmp":  # the precompiled header's layer root lies under ROOT/tmp
        (root / "tmp").symlink_to(tmp_path / "faketmp")
        write_tree(tmp_path / "faketmp", {f"torchinductor_{torch_user()}/precompiled_headers/h": b"SECRET"})
    else:
        (root / link).symlink_to(outside)
    with caplog.at_level("WARNING", logger="kcache.sources.base"):
        found = collect(sources.in_root(root), root=root, env={})
        result = publish(store, sqlite_index, fp, sources.in_root(root), root=root)
    assert [info.rel for _, info in found] == ["entry"]
    assert published_paths(store, result) == {"cuda/entry"}
    assert "symbolic link" in caplog.text


def test_a_directory_under_extra_that_restore_cannot_have_made_is_ignored(tmp_path, store, sqlite_index, fp):
    root = tmp_path / "root"
    write_tree(root, {"extra/trt/timing": b"t", "extra/init.d/x": b"no layer has this name"})
    result = publish(store, sqlite_index, fp, sources.in_root(root), root=root)
    assert published_paths(store, result) == {"extra/trt/timing"}


def test_links_inside_a_layer_are_not_followed(tmp_path, store, sqlite_index, fp, outside):
    root = tmp_path / "root"
    write_tree(root, {"inductor/fxgraph/a": b"graph"})
    (root / "inductor/fxgraph/dir").symlink_to(outside)
    (root / "inductor/fxgraph/key").symlink_to(outside / "ssh_host_ed25519_key")
    result = publish(store, sqlite_index, fp, sources.select(), root=root)
    assert published_paths(store, result) == {"inductor/fxgraph/a"}


def test_triton_temporary_directories_are_junk(tmp_path, store, sqlite_index, fp):
    # triton/runtime/cache.py (FileCacheManager.put, triton 3.9): a file is written into
    # <kernel dir>/tmp.pid_<pid>_<uuid>/ and then os.replace'd into the kernel dir.
    root = tmp_path / "root"
    write_tree(root, {
        "triton/HASH/add_kernel.cubin": b"done",
        "triton/HASH/tmp.pid_4242_0b7c0f7e-1b2c-4d5e-9f00-123456789abc/add_kernel.json": b'{"half',
        # torch's TritonBundler (_inductor/triton_bundler.py) writes a bundled kernel into
        # <cache dir>/tmp.<uuid4>/ and renames it; one that lost the rename race is left there.
        "triton/tmp.0b7c0f7e-1b2c-4d5e-9f00-123456789abc/triton_poi_fused_0.cubin": b"half",
        "triton/tmp.notauuid/kept.cubin": b"a kernel directory of another name",
    })  # fmt: skip
    result = publish(store, sqlite_index, fp, sources.select(), root=root)
    assert published_paths(store, result) == {"triton/HASH/add_kernel.cubin", "triton/tmp.notauuid/kept.cubin"}


def test_a_linked_device_directory_under_inductor_is_not_read(tmp_path, outside):
    inductor = tmp_path / "live/inductor"
    write_tree(inductor, {"triton/0/HASH/k.cubin": b"kernel"})
    (inductor / "triton/1").symlink_to(outside)
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "HOME": str(tmp_path / "home")}
    found = collect(sources.select(["triton"]), root=None, env=env)
    assert [info.rel for _, info in found] == ["HASH/k.cubin"]


def test_the_walk_lists_regular_files_in_name_order_and_skips_links_fifos_and_junk(tmp_path, outside, caplog):
    """A directory's files in name order, then its subdirectories the same way; a link to a directory is
    not entered, a link to a file or a dangling one is skipped with a warning, and so is a FIFO."""
    top = tmp_path / "inductor"
    write_tree(top, {"b.py": b"b", "a.py": b"a", "z/2.so": b"2", "z/1.so": b"1", "y/x/deep.cpp": b"d",
                     "c.lock": b"junk"})  # fmt: skip
    (top / "linked_dir").symlink_to(outside)
    (top / "linked_file").symlink_to(top / "a.py")
    (top / "dangling").symlink_to(tmp_path / "nowhere")
    os.mkfifo(top / "fifo")
    listed = [info.rel for info in sources.InductorSource().walk(top)]
    assert listed == ["a.py", "b.py", "y/x/deep.cpp", "z/1.so", "z/2.so"]
    for name in ("linked_file", "dangling", "fifo"):
        assert f"{name}'" in caplog.text
    assert "linked_dir" not in caplog.text


def test_paths_deeper_or_longer_than_a_manifest_carries_are_skipped_not_fatal(
    tmp_path, store, sqlite_index, fp, caplog
):
    # One such file made the whole publish fail as "hostile or corrupt", and a tree ~1000 deep made the
    # walk itself a RecursionError: the workload's own cache dir could stop every publish of the pod.
    root = tmp_path / "root"
    layer = root / "inductor"
    write_tree(root, {"inductor/fxgraph/a": b"graph"})
    deepest = manifests.MAX_PATH_COMPONENTS - 2  # "inductor/" + directories + the file name
    nest(layer, ["d"] * deepest, "in", b"at the cap")
    nest(layer, ["d"] * (deepest + 1), "out", b"one past it")
    nest(layer, ["e"] * 1100, "far", b"past the recursion limit")
    nest(layer, ["n" * 250] * 17, "long", b"over the bytes a path may have")
    try:
        with caplog.at_level("WARNING", logger="kcache.sources.base"):
            result = publish(store, sqlite_index, fp, sources.select(), root=root)
    finally:
        remove_tree(layer / "e")  # pytest's own cleanup would recurse into it
    assert not (layer / "e").exists()
    assert published_paths(store, result) == {"inductor/fxgraph/a", "inductor/" + "d/" * deepest + "in"}
    assert "components, over the" in caplog.text and "bytes a path may have" in caplog.text
    assert restore(store, sqlite_index, fp, tmp_path / "dest").status == "hit"
