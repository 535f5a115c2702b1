"""kcache.atomic: the one way kcache writes a file in place, and the one durability rule."""

import ast
import os
from pathlib import Path

import pytest

from kcache import atomic

PACKAGE = Path(__file__).resolve().parents[1] / "kcache"


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.startswith(".tmp")]


def test_write_replaces_with_mode_and_leaves_no_temp(tmp_path):
    target = tmp_path / "marker.json"
    target.write_text("old")
    assert atomic.write_text(target, "new", mode=0o640) is True
    assert target.read_text() == "new" and target.stat().st_mode & 0o777 == 0o640
    assert leftovers(tmp_path) == []


def test_without_overwrite_an_existing_file_is_kept(tmp_path):
    target = tmp_path / "obj"
    assert atomic.write_bytes(target, b"first", overwrite=False) is True
    assert atomic.write_bytes(target, b"second", overwrite=False) is False
    assert target.read_bytes() == b"first" and leftovers(tmp_path) == []


def test_a_failing_writer_changes_nothing(tmp_path):
    target = tmp_path / "obj"
    target.write_bytes(b"good")

    def half(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic.write(target, half)
    assert target.read_bytes() == b"good" and leftovers(tmp_path) == []


def test_durability_rule_fsync_file_then_rename_then_fsync_directory(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", os.path.isdir(f"/proc/self/fd/{fd}")))
                        or real_fsync(fd))  # fmt: skip
    monkeypatch.setattr(os, "replace", lambda a, b: calls.append(("replace", None)) or real_replace(a, b))
    atomic.write_bytes(tmp_path / "x", b"data")
    assert calls == [("fsync", False), ("replace", None), ("fsync", True)]


# Modules that may still rename or make temp files themselves, and why.
OWN_WRITES = {
    "atomic.py": "the helper itself",
    "packs.py": "a scratch file for building a pack, uploaded and deleted, never renamed into place",
    "restore.py": "swaps whole layer directories into place (directories, not files)",
    "rootdir.py": "renames what was planted at ROOT's lock, kcache.env or a marker aside to remove it",
    "store/nodedir.py": "renames a directory planted at a lock or pack path aside to remove it, nothing into place",
}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_files_are_written_in_place_only_through_atomic(path):
    rel = path.relative_to(PACKAGE).as_posix()
    if rel in OWN_WRITES:
        return
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("replace", "rename", "mkstemp", "NamedTemporaryFile"):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            assert owner not in ("os", "tempfile"), f"{rel}:{node.lineno} uses {owner}.{node.attr}; use kcache.atomic"
