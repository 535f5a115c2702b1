"""`ROOT/kcache.env`: the shell exports that point torch, Triton and the CUDA driver into ROOT.

    # kcache restore: bundle <id> (hit)
    export TORCHINDUCTOR_CACHE_DIR='/cache/inductor'
    ...

Source it (`. /cache/kcache.env`) before the model starts, or read it with `read()`.

A shell runs this file, so nothing that came from the store, the index or the network reaches
it except as a shlex-quoted value: the comment is made one line (kcache.untrusted) and every
variable name must be a plain shell name.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from pathlib import Path

from kcache import atomic
from kcache.errors import ConfigError
from kcache.untrusted import one_line

NAME = "kcache.env"
_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def render(exports: Mapping[str, str], comment: str = "") -> str:
    lines = [f"# {one_line(comment)}"] if comment else []
    for name, value in sorted(exports.items()):
        if not _SHELL_NAME.match(name):
            raise ConfigError("environment variable", name, "is not a shell variable name")
        if "\0" in value:  # a shell cannot hold it: bash would drop the byte and change the value
            raise ConfigError(name, value, "contains a NUL byte")
        lines.append(f"export {name}={shlex.quote(value)}")
    return "\n".join(lines) + "\n"


def write(root: Path, exports: Mapping[str, str], comment: str = "") -> Path:
    """Write ROOT/kcache.env atomically (kcache.atomic: temp sibling, fsync, rename)."""
    target = root / NAME
    # surrogateescape: a ROOT given as non-UTF-8 bytes is written back as those bytes.
    atomic.write_bytes(target, render(exports, comment).encode("utf-8", errors="surrogateescape"), mode=0o644)
    return target


def read(path: Path) -> dict[str, str]:
    """Parse a file written by `write` back into a mapping, as a shell reads it: the whole text at
    once, since a quoted value (a ROOT whose name holds a line break) may span lines."""
    exports: dict[str, str] = {}
    text = Path(path).read_bytes().decode("utf-8", errors="surrogateescape")  # no newline translation: \r is a byte
    words = shlex.split(text, comments=True)
    for verb, assignment in zip(words, words[1:]):
        if verb == "export" and "=" in assignment:
            name, _, value = assignment.partition("=")
            exports[name] = value
    return exports
