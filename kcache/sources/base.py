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
_JUNK_RE: dict[tuple[str, ...], re.Pattern] = {}  # compiled once per junk list


@dataclass(frozen=True)
class FileInfo:
    rel: str  # POSIX path relative to the layer directory
    path: Path  # absolute path on this machine
    mode: int
    size: int
    # What the hash cache keys on (kcache.hashcache), taken from the walk's own lstat.
    mtime_ns: int = 0
    ctime_ns: int = 0
    ino: int = 0


class Source:
    """Base layer. Subclasses set the class attributes and override `live_dirs`."""

    name: str = ""
    subdir: str = ""  # the layer's prefix in manifest paths; also its place under ROOT by default
    env_var: str | None = None
    junk: tuple[str, ...] = COMMON_JUNK
    # Top-level directories inside this layer's tree that belong to another layer.
    foreign: tuple[str, ...] = ()
    # Index files holding absolute paths that restore rewrites (names in kcache.relocate.REWRITERS).
    # Triton's groups by default: a Triton cache can sit inside any engine's directory.
    rewriters: tuple[str, ...] = ("triton-groups",)

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        """Directories this layer is read from on a running machine, most specific first."""
        raise NotImplementedError

    def restore_dir(self, root: Path) -> Path:
        """Where this layer's files go under the restore root (and are read from by --from ROOT)."""
        return root / self.subdir

    def layer_info(self) -> dict[str, str]:
        """What this layer's layout depends on, recorded in the manifest by publish (e.g. a user name)."""
        return {}

    def exports(self, root: Path) -> dict[str, str]:
        """Environment variables that point the tool at this layer under `root`."""
        return {self.env_var: str(self.restore_dir(root))} if self.env_var else {}

    def is_junk(self, rel: str) -> bool:
        parts = rel.split("/")
        return parts[0] in self.foreign or any(self._junk_name(part) for part in parts)

    def _junk_name(self, name: str) -> bool:
        pattern = _JUNK_RE.get(self.junk)
        if pattern is None:
            pattern = _JUNK_RE[self.junk] = re.compile("|".join(fnmatch.translate(p) for p in self.junk))
        return pattern.match(name) is not None

    def walk(self, top: Path) -> Iterator[FileInfo]:
        """Regular files under `top` that are not junk. Links are skipped: they could point anywhere."""
        for dirpath, dirs, files in os.walk(top):
            rel_dir = os.path.relpath(dirpath, top)
            prefix = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            # Directory names are checked as we descend, so a file only needs its own name checked.
            dirs[:] = sorted(
                d for d in dirs
                if not self._junk_name(d) and not (not prefix and d in self.foreign)
                and not os.path.islink(os.path.join(dirpath, d))
            )  # fmt: skip
            for name in sorted(files):
                if self._junk_name(name) or (not prefix and name in self.foreign):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except FileNotFoundError:
                    continue  # removed while we walked: a temp file of a running compile
                if not stat.S_ISREG(st.st_mode):
                    log.warning("skipping %s: not a regular file", path)
                    continue
                yield FileInfo(prefix + name, Path(path), stat.S_IMODE(st.st_mode) & 0o777, st.st_size,
                               st.st_mtime_ns, st.st_ctime_ns, st.st_ino)  # fmt: skip


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
