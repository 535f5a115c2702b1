"""Build and read file trees for tests."""

from __future__ import annotations

import os
from pathlib import Path


def write_tree(root: Path, files: dict[str, bytes | tuple[bytes, int]]) -> None:
    """Create files under root; a value may be (content, mode)."""
    for rel, value in files.items():
        content, mode = value if isinstance(value, tuple) else (value, 0o644)
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        os.chmod(path, mode)


def read_tree(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every regular file under root with its content and permission bits."""
    result = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            result[path.relative_to(root).as_posix()] = (path.read_bytes(), path.stat().st_mode & 0o777)
    return result
