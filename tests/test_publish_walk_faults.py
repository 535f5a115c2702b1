"""Publish against a cache that changes under it or cannot all be looked at: what cannot be read is
skipped with a warning, never a bug exit (70), and a publish left with nothing never replaces a
bundle. Changes between the walk and hashing are made by wrapping `collect`."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from trees import nest, write_tree

from kcache import publish as publishing
from kcache import sources
from kcache.errors import ConfigError
from kcache.publish import PublishConfig, publish
from kcache.restore import restore
from kcache.sources import TritonSource
from kcache.store import ref_key


def after_the_walk(monkeypatch, change) -> None:
    walk = publishing.collect

    def walked_then_changed(*args, **kwargs):
        found = walk(*args, **kwargs)
        change()
        return found

    monkeypatch.setattr(publishing, "collect", walked_then_changed)


def to_socket(path: Path) -> None:
    path.unlink()
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.close()


def to_file(path: Path) -> None:
    for child in path.iterdir():
        child.unlink()
    path.rmdir()
    path.write_bytes(b"no longer a directory")


@pytest.mark.parametrize("change", ["file-became-a-socket", "directory-became-a-file"])
def test_a_file_that_changed_kind_since_the_walk_is_skipped(tmp_path, store, sqlite_index, fp, monkeypatch, caplog,
                                                            change):  # fmt: skip
    """open() said ENXIO (a socket) or ENOTDIR (a directory above it is a file now): both escaped as bugs."""
    root = tmp_path / "root"
    write_tree(root, {"inductor/keep.py": b"kept", "inductor/d/f": b"changes"})
    after_the_walk(monkeypatch, {"file-became-a-socket": lambda: to_socket(root / "inductor/d/f"),
                                 "directory-became-a-file": lambda: to_file(root / "inductor/d")}[change])  # fmt: skip
    result = publish(store, sqlite_index, fp, sources.select(), root=root)
    assert result.files == 1 and "d/f" in caplog.text and "since it was listed" in caplog.text
    assert restore(store, sqlite_index, fp, tmp_path / "dest").status == "hit"
    assert (tmp_path / "dest/inductor/keep.py").read_bytes() == b"kept"


def test_a_publish_that_loses_every_file_after_the_walk_replaces_no_bundle(tmp_path, store, sqlite_index, fp,
                                                                           monkeypatch):  # fmt: skip
    """The empty-bundle check looked at what the walk found: every file gone by the time it was hashed
    committed a 0-file bundle, the key's newest, and every later pod restored nothing from it."""
    root = tmp_path / "root"
    write_tree(root, {"inductor/k.so": b"kernel"})
    good = publish(store, sqlite_index, fp, sources.select(), root=root)
    ref = store.get_bytes(ref_key(fp.bundle_key))
    (root / "inductor/k.so").write_bytes(b"kernel, rebuilt")
    after_the_walk(monkeypatch, lambda: (root / "inductor/k.so").unlink())
    with pytest.raises(ConfigError, match="allow-empty"):
        publish(store, sqlite_index, fp, sources.select(), root=root)
    assert sqlite_index.newest_bundle(fp.bundle_key).id == good.bundle_id
    assert store.get_bytes(ref_key(fp.bundle_key)) == ref
    write_tree(root, {"inductor/k.so": b"kernel", "triton/t/k.cubin": b"cubin"})
    monkeypatch.undo()
    after_the_walk(monkeypatch, lambda: (root / "triton/t/k.cubin").unlink())
    partial = publish(store, sqlite_index, fp, sources.select(), root=root, config=PublishConfig(allow_empty=True))
    assert list(partial.layers) == ["inductor"]  # a layer left with no file is not listed


def test_a_file_past_the_path_length_the_kernel_takes_is_skipped(tmp_path, store, sqlite_index, fp, caplog):
    """Its manifest path fits (4079 of 4096 bytes) but its absolute path is past PATH_MAX: lstat said
    ENAMETOOLONG, and the walk let only FileNotFoundError pass."""
    root = tmp_path / "root"
    write_tree(root, {"inductor/keep.py": b"kept"})
    nest(root / "inductor", ["n" * 250] * 16, "f" * 60, b"too far down for one path")
    with caplog.at_level("WARNING"):
        result = publish(store, sqlite_index, fp, sources.select(), root=root)
    assert result.files == 1 and "cannot be looked at" in caplog.text


@pytest.mark.parametrize("where", ["extra", "inductor/triton"])
def test_a_directory_that_cannot_be_listed_is_passed_over(tmp_path, store, sqlite_index, fp, monkeypatch, where):
    """ROOT/extra (publish --from ROOT) and the Inductor cache's triton/ (a live publish) were listed
    without a guard: PermissionError from another user's directory was a bug exit."""
    root = tmp_path / "root"
    write_tree(root, {"inductor/keep.py": b"kept", f"{where}/x/f": b"x"})
    unlistable = root / where
    listing = Path.iterdir

    def refuse(self):
        if self == unlistable:
            raise PermissionError(13, "Permission denied", str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", refuse)
    if where == "extra":
        result = publish(store, sqlite_index, fp, sources.in_root(root), root=root)
    else:
        env = {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "HOME": str(tmp_path / "home")}
        result = publish(store, sqlite_index, fp, sources.select(), env=env)
    assert "inductor" in result.layers and not any(layer.startswith("extra") for layer in result.layers)


def test_a_file_in_one_merged_directory_and_a_directory_in_another_publish_the_first(tmp_path, store, sqlite_index,
                                                                                      fp, caplog):  # fmt: skip
    """Triton's per-device directories merge into one layer: `K` a file in triton/0 and a directory in
    triton/1 made both `triton/K` and `triton/K/kernel.cubin`, which no manifest may hold; publish
    failed as hostile after uploading, every time."""
    inductor = tmp_path / "inductor"
    write_tree(inductor, {"triton/0/K": b"a file", "triton/1/K/kernel.cubin": b"a kernel", "triton/1/L": b"other"})
    env = {"TORCHINDUCTOR_CACHE_DIR": str(inductor), "HOME": str(tmp_path / "home")}
    result = publish(store, sqlite_index, fp, [TritonSource()], env=env)
    assert result.files == 2 and "K/kernel.cubin" in caplog.text
    assert restore(store, sqlite_index, fp, tmp_path / "dest").status == "hit"
    assert (tmp_path / "dest/triton/K").read_bytes() == b"a file"
    assert (tmp_path / "dest/triton/L").read_bytes() == b"other"
    assert list(result.layers) == ["triton"]
    assert os.path.isfile(tmp_path / "dest/triton/K")
