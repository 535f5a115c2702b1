"""Which kcache this is: its version and the commit it was built from.

The commit is read from kcache/_commit.txt, which the Dockerfile writes from its KCACHE_COMMIT
build argument before building the wheel; when kcache runs from a git checkout without that file,
`git describe` answers; otherwise it is "unknown". Computed only when asked (`kcache --version`),
never at import: the readiness probe must stay fast.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from kcache import __version__

COMMIT_FILE = Path(__file__).with_name("_commit.txt")


def commit() -> str:
    try:
        baked = COMMIT_FILE.read_text(errors="replace").strip()
    except OSError:
        baked = ""
    if baked and baked != "unknown":
        return "".join(c for c in baked[:80] if c.isprintable())
    return _git_describe() or "unknown"


def _git_describe() -> str | None:
    checkout = Path(__file__).resolve().parent.parent
    if not (checkout / ".git").exists():  # a file in a worktree, a directory in a clone
        return None
    try:
        done = subprocess.run(["git", "-C", str(checkout), "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, timeout=5)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def version_line() -> str:
    return f"kcache {__version__} (commit {commit()})"
