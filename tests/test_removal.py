"""kcache.removal.remove_tree: rm -rf for trees others wrote, at any depth, never through a link."""

from __future__ import annotations

import os
import subprocess

import pytest
from trees import nest

from kcache.removal import remove_tree


@pytest.fixture
def outside(tmp_path):
    out = tmp_path / "outside"
    (out / "dir").mkdir(parents=True)
    (out / "dir/keep").write_bytes(b"not ours")
    (out / "file").write_bytes(b"not ours either")
    return out


def test_a_tree_deeper_than_the_recursion_limit_goes_whole(tmp_path, outside):
    top = tmp_path / "top"
    names = ["d"] * 1500
    try:
        for depth in (0, 1, 700, 1500):
            nest(top, names[:depth], f"f{depth}", b"x")
        nest(top, names[:1000], "sub", b"")  # a second branch part way down
        os.symlink(outside / "dir", top / "d" / "to-dir")
        os.symlink(outside / "file", top / "d" / "d" / "to-file")
        os.mkfifo(top / "d" / "fifo")
        remove_tree(top)
        assert not os.path.lexists(top)
    finally:
        if top.exists():
            subprocess.run(["rm", "-rf", str(top)], check=False)  # only when the remover failed: no depth limit
    assert sorted(p.relative_to(outside).as_posix() for p in outside.rglob("*")) == ["dir", "dir/keep", "file"]


def test_a_link_at_the_path_is_removed_not_followed(tmp_path, outside):
    link = tmp_path / "link"
    link.symlink_to(outside / "dir")
    remove_tree(link)
    assert not os.path.lexists(link) and (outside / "dir/keep").read_bytes() == b"not ours"


def test_a_file_goes_and_a_missing_path_is_no_error(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    remove_tree(tmp_path / "f")
    remove_tree(tmp_path / "missing")
    assert sorted(os.listdir(tmp_path)) == []
