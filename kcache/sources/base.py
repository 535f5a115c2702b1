"""A source is one cache layer: where it lives, what in it is junk, where it goes on restore.

Publish asks each source for its live directories and walks them; restore asks each source
where its files go under ROOT and which variables point the tool there. Nothing else in kcache
knows a layer by name, so adding a layer is a new module plus one line in sources/__init__.py.
"""

from __future__ import annotations

import fnmatch
import getpass
import logging
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Names that are never worth carrying: lock files, atomic-write temporaries, bytecode.
COMMON_JUNK = ("*.lock", "*.tmp", "*.tmp.*", ".tmp*", "__pycache__", "*.pyc")


@dataclass(frozen=True)
class FileInfo:
    rel: str  # POSIX path relative to the layer directory
    path: Path  # absolute path on this machine
    mode: int
    size: int


class Source:
    """Base layer. Subclasses set the class attributes and override `live_dirs`."""

    name: str = ""
    subdir: str = ""  # the layer's prefix in manifest paths; also its place under ROOT by default
    env_var: str | None = None
    junk: tuple[str, ...] = COMMON_JUNK
    # Top-level directories inside this layer's tree that belong to another layer.
    foreign: tuple[str, ...] = ()

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        """Directories this layer is read from on a running machine, most specific first."""
        raise NotImplementedError

    def restore_dir(self, root: Path) -> Path:
        """Where this layer's files go under the restore root (and are read from by --from ROOT)."""
        return root / self.subdir

    def exports(self, root: Path) -> dict[str, str]:
        """Environment variables that point the tool at this layer under `root`."""
        return {self.env_var: str(self.restore_dir(root))} if self.env_var else {}

    def is_junk(self, rel: str) -> bool:
        parts = rel.split("/")
        if parts[0] in self.foreign:
            return True
        return any(fnmatch.fnmatchcase(part, pattern) for part in parts for pattern in self.junk)

    def walk(self, top: Path) -> Iterator[FileInfo]:
        """Regular files under `top` that are not junk. Links are skipped: they could point anywhere."""
        for dirpath, dirs, files in os.walk(top):
            base = Path(dirpath)
            rel_dir = base.relative_to(top).as_posix()
            prefix = "" if rel_dir == "." else rel_dir + "/"
            dirs[:] = sorted(d for d in dirs if not self.is_junk(prefix + d) and not (base / d).is_symlink())
            for name in sorted(files):
                rel = prefix + name
                if self.is_junk(rel):
                    continue
                try:
                    st = (base / name).lstat()
                except FileNotFoundError:
                    continue  # removed while we walked: a temp file of a running compile
                if not stat.S_ISREG(st.st_mode):
                    log.warning("skipping %s: not a regular file", base / name)
                    continue
                yield FileInfo(rel, base / name, stat.S_IMODE(st.st_mode) & 0o777, st.st_size)


def torch_user() -> str:
    """The user name as torch puts it into its default cache directory names."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):  # torch's own fallback
        user = f"uid_{os.getuid()}"
    return re.sub(r'[\\/:*?"<>|]', "_", user)


def temp_dir(env: Mapping[str, str]) -> Path:
    """tempfile.gettempdir() as a process started with `env` would see it (on Linux)."""
    for var in ("TMPDIR", "TEMP", "TMP"):
        if env.get(var):
            return Path(env[var])
    return Path("/tmp")


def home_dir(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or Path.home())
