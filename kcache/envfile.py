"""`ROOT/kcache.env`: the shell exports that point torch, Triton and the CUDA driver into ROOT.

    # kcache restore: bundle <id> (hit)
    export TORCHINDUCTOR_CACHE_DIR='/cache/inductor'
    ...

Source it (`. /cache/kcache.env`) before the model starts, or read it with `read()`.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from collections.abc import Mapping
from pathlib import Path

NAME = "kcache.env"


def render(exports: Mapping[str, str], comment: str = "") -> str:
    lines = [f"# {comment}"] if comment else []
    lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(exports.items())]
    return "\n".join(lines) + "\n"


def write(root: Path, exports: Mapping[str, str], comment: str = "") -> Path:
    """Write ROOT/kcache.env atomically (temp sibling, then rename)."""
    target = root / NAME
    fd, tmp = tempfile.mkstemp(prefix=".kcache-env-", dir=root)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(render(exports, comment))
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def read(path: Path) -> dict[str, str]:
    """Parse a file written by `write` back into a mapping."""
    exports: dict[str, str] = {}
    for line in Path(path).read_text().splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, _, value = words[1].partition("=")
            exports[name] = value
    return exports
