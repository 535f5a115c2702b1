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


def nest(top: Path, names: list[str], file_name: str, data: bytes) -> None:
    """`file_name` under directories `names`, one below the other, made through directory descriptors
    (the whole path may be longer than the kernel takes at once)."""
    top.mkdir(parents=True, exist_ok=True)
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in names:
            try:
                os.mkdir(name, dir_fd=fd)
            except FileExistsError:
                pass
            below = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = below
        out = os.open(file_name, os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
        os.write(out, data)
        os.close(out)
    finally:
        os.close(fd)

