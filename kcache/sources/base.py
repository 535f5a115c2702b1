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

from kcache import manifest

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
    # Kernels built against the torch install (its headers, ABI, Inductor) and not keyed by its version
    # alone: publish refuses them under facts that name no torch (a kcache that could not see it).
    needs_torch: bool = False
    # Live, the layer is one file (and files named after it beside it): read while its directory is there,
    # whether the file itself is or not.
    one_file: bool = False

    def live_dirs(self, env: Mapping[str, str]) -> list[Path]:
        """Directories this layer is read from on a running machine, most specific first."""
        raise NotImplementedError

    def for_facts(self, facts: Mapping[str, str]) -> Source:
        """This layer as the bundle's facts place it; publish asks before reading live directories.
        Most layers are placed by the environment alone."""
        return self

    def restore_dir(self, root: Path) -> Path:
        """Where this layer's files go under the restore root (and are read from by --from ROOT)."""
        return root / self.subdir

    def layer_info(self) -> dict[str, str]:
        """What this layer's layout depends on, recorded in the manifest by publish (e.g. a user name)."""
        return {}

    def exports(self, root: Path) -> dict[str, str]:
        """Environment variables that point the tool at this layer under `root`."""
        return {self.env_var: str(self.restore_dir(root))} if self.env_var else {}

    def takes(self, rel: str) -> bool:
        """Whether a walk of this layer would take a file at `rel` by its names (junk and foreign
        names are left); for files known only from a manifest, such as another bundle's."""
        names = rel.split("/")
        return names[0] not in self.foreign and not any(self._junk_name(name) for name in names)

    def _junk_name(self, name: str) -> bool:
        pattern = _JUNK_RE.get(self.junk)
        if pattern is None:
            pattern = _JUNK_RE[self.junk] = re.compile("|".join(fnmatch.translate(p) for p in self.junk))
        return pattern.match(name) is not None

    def read_dirs(self, root: Path | None, env: Mapping[str, str]) -> list[Path]:
        """The directories publish reads this layer from: its place under ROOT, else its live ones.

        Under ROOT the layer is what restore laid down, always real directories; a link anywhere
        between ROOT and the layer (ROOT/vllm -> /etc/ssh) would publish what it points at.
        """
        if root is None:
            return self.live_dirs(env)
        place = self.restore_dir(Path(root))
        return [place] if _real_dir_below(Path(root), place) else []

    def walk(self, top: Path) -> Iterator[FileInfo]:
        """Regular files under `top` that are not junk and whose names a manifest can carry.

        Links are skipped: they could point anywhere. So are names that are not UTF-8 or hold a
        backslash, and paths longer or deeper than a manifest path may be: a manifest cannot carry
        them, and one such file would fail the whole publish.
        A directory's files come in name order, then its subdirectories, each the same way. A
        directory that cannot be listed (removed meanwhile, unreadable) is passed over.
        """
        yield from self._walk_dir(str(top), "")

    def _walk_dir(self, dirpath: str, prefix: str) -> Iterator[FileInfo]:
        # scandir, not os.walk plus lstat: the directory read already says which entries are
        # directories and links, and DirEntry.stat caches one lstat per file (a 20k-file tree
        # walked in 0.15 s instead of 0.5 s).
        try:
            with os.scandir(dirpath) as listing:
                entries = sorted(listing, key=lambda e: e.name)
        except OSError:
            return
        subdirs = []
        for entry in entries:
            name = entry.name
            if self._junk_name(name) or (not prefix and name in self.foreign) or not _nameable(dirpath, name):
                continue
            try:
                is_dir = entry.is_dir()  # through a link, as os.walk sorts them: a link to a directory is dropped
            except OSError:  # a link whose target cannot be looked at: not a directory (os.walk's rule)
                is_dir = False
            if is_dir:
                if not entry.is_symlink():
                    subdirs.append(entry)
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed while we walked: a temp file of a running compile
            except OSError as exc:  # EACCES (a directory listable, not searchable), ENAMETOOLONG (past PATH_MAX)
                _skip(entry.path, f"cannot be looked at: {exc.strerror or exc}")
                continue
            if not stat.S_ISREG(st.st_mode):
                _skip(entry.path, "not a regular file")
                continue
            if too_long := manifest.over_caps(f"{self.subdir}/{prefix}{name}"):
                _skip(entry.path, too_long)
                continue
            yield FileInfo(prefix + name, Path(entry.path), stat.S_IMODE(st.st_mode) & 0o777, st.st_size,
                           st.st_mtime_ns, st.st_ctime_ns, st.st_ino)  # fmt: skip
        for entry in subdirs:
            below = prefix + entry.name + "/"
            if too_deep := manifest.over_caps(f"{self.subdir}/{below}x"):  # what its shallowest file would be
                _skip(entry.path, f"a file in it {too_deep}")  # and the walk's recursion stays bounded
                continue
            yield from self._walk_dir(entry.path, below)


def _real_dir_below(root: Path, place: Path) -> bool:
    """True if `place` is a directory reached from `root` without passing through a link."""
    current = root
    for part in place.relative_to(root).parts:
        current = current / part
        if current.is_symlink():
            _skip(str(current), "a layer directory that is a symbolic link is not followed")
            return False
        if not current.is_dir():
            return False
    return True


def _nameable(dirpath: str, name: str) -> bool:
    """A name a manifest can carry: UTF-8 text without a backslash (restore refuses those)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        _skip(os.path.join(dirpath, name), "its name is not valid UTF-8")
        return False
    if "\\" in name:
        _skip(os.path.join(dirpath, name), "its name contains a backslash")
        return False
    return True


_warned: set[tuple[str, str]] = set()
_WARN_LIMIT = 10_000


def _skip(path: str, why: str) -> None:
    """Warn once per path and reason: `kcache watch` walks the same tree every few seconds."""
    if (path, why) in _warned:
        return
    if len(_warned) < _WARN_LIMIT:
        _warned.add((path, why))
    log.warning("skipping %r: %s", path, why)  # repr: a file name may hold escapes or newlines


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
