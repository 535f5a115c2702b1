"""Removing a directory tree however deep it goes: rm -rf, for trees others wrote.

Restore deletes the previous layers (the model compiled into them), and the node cache deletes a
directory a peer left where a pack or a lock goes. shutil.rmtree recursed once a level on the
Python versions kcache supports, so a tree about 1000 levels deep raised RecursionError, which its
`ignore_errors` does not cover: a restore without a budget failed as a bug, and a tree deleted in
the background stayed for every later try. Here the walk keeps one directory descriptor a level on
a list instead.

Like `rm -rf`: best effort (what cannot be removed is left and the rest still goes), and a link is
removed, never followed. Every step below the top goes through a directory descriptor opened with
O_NOFOLLOW, so a directory swapped for a link meanwhile is not entered.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: Path | str) -> None:
    """Remove what is at `path`: a file or link by unlinking it, a directory with all it holds."""
    try:
        os.unlink(path)
        return
    except FileNotFoundError:
        return
    except (IsADirectoryError, PermissionError):  # unlink(2) of a directory says EPERM on some systems
        pass
    except OSError:
        return
    try:
        top = os.open(path, _DIR_FLAGS)
    except OSError:
        return
    _empty(top)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _empty(top: int) -> None:
    """Remove everything below the directory open at `top` (closed when done)."""
    # One frame a level: (descriptor, its name in the level above, names here that would not go).
    stack: list[tuple[int, str, set[str]]] = [(top, "", set())]
    try:
        while stack:
            fd, name, stuck = stack[-1]
            below = _files_out(fd, stuck)
            if below is not None:
                try:
                    stack.append((os.open(below, _DIR_FLAGS, dir_fd=fd), below, set()))
                except OSError:  # unreadable, or no longer a directory: left as it is
                    stuck.add(below)
                continue
            stack.pop()
            os.close(fd)
            if stack:
                try:
                    os.rmdir(name, dir_fd=stack[-1][0])
                except OSError:
                    stack[-1][2].add(name)
    finally:
        for fd, _name, _stuck in stack:
            os.close(fd)


def _files_out(fd: int, stuck: set[str]) -> str | None:
    """Unlink what is not a directory in the directory open at `fd`, up to the first subdirectory
    not in `stuck`, whose name is returned; None once only what is stuck is left."""
    try:
        entries = os.scandir(fd)
    except OSError:
        return None
    with entries:
        for entry in entries:
            if entry.name in stuck:
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                return entry.name
            try:
                os.unlink(entry.name, dir_fd=fd)
            except IsADirectoryError:  # a directory since it was listed
                return entry.name
            except FileNotFoundError:
                pass
            except OSError:
                stuck.add(entry.name)
    return None
