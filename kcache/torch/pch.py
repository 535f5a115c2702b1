"""Inductor's precompiled headers, named in this process for caches that `kcache restore` laid down.

Before it loads a C++ kernel, every torch process asks where the precompiled header for that
kernel's flags lives (torch 2.13's `codecache._precompile_header`): it runs g++ to preprocess the
header, hashes the output with `openssl sha512`, and names the header by that hash. When the kernel
is already built (a warm start), the answer is only written into a command line that never runs:
the kernel's own cache key does not include it. That is ~0.25 s of every warm start here (one g++
preprocessing ~0.2 s, one openssl, the compiler version queries they need).

A process that calls `remember_headers()` writes down each answer torch gives it, beside the
headers, in a file that the inductor-pch layer publishes with them:

    $TMPDIR/torchinductor_<user>/precompiled_headers/
        <hash>.h, <hash>.h.gch       torch's own
        kcache-headers.json          {"schema": 1, "headers": {request key: "<hash>.h"}}

and in a root that a restore hit laid down, it answers from that file instead of preprocessing:

    ROOT/.kcache-state.json          status "hit", "inductor-pch" among its layers
    ROOT/tmp/torchinductor_<user>/precompiled_headers/kcache-headers.json, <hash>.h, <hash>.h.gch
                                     each not newer than that marker: restored bytes, verified
                                     against a manifest published under the same fingerprint

The request key is the header, the command line torch hashes for it and every compile option, so
a header asked for with other flags is a miss and torch works it out as before. What the
preprocessing would add is the content of the headers themselves; the fingerprint already holds
what decides it (torch's version and install path, the compiler's `-v` text, libc), as it does for
every restored kernel, whose cache key never held header content either. And the answer only
reaches a compile: g++ refuses a precompiled header built for other options and reads the header
itself.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from kcache import atomic, canonical
from kcache.readiness import RESTORE_MARKER, read_marker
from kcache.torch.isa import is_restored, vouches

log = logging.getLogger(__name__)

NAME = "kcache-headers.json"
SCHEMA = 1
MAX_BYTES = 1024 * 1024  # a real file names a few headers; one from the store is read no further
_HEADER_NAME = re.compile(r"[A-Za-z0-9_]{1,128}\.h\Z")
_KEY = re.compile(r"[0-9a-f]{64}\Z")
_PATCHED = "_kcache_headers"


def remember_headers(env: Mapping[str, str] | None = None) -> bool:
    """Record torch's precompiled-header answers, and in a restored root reuse them; True when on.

    Call it once at start-up, before the first compile (beside `trust_restored_probes()`). False,
    changing nothing, when this torch has no `codecache._precompile_header` (torch 2.13's seam).
    """
    env = os.environ if env is None else env
    from torch._inductor import codecache

    original = getattr(codecache, "_precompile_header", None)
    header_dir = getattr(codecache, "_HEADER_DIR", None)
    if original is None or header_dir is None:
        log.info("this torch has no codecache._precompile_header; precompiled headers are found as torch does")
        return False
    original = getattr(original, _PATCHED, original)  # calling twice must not stack wrappers
    codecache._precompile_header = _answering(original, Path(header_dir), _restored_root(Path(header_dir), env))
    return True


def request_key(header: str, hashable_cmd_line: str, compile_command: Mapping[str, object]) -> str:
    """What torch's answer depends on, besides the headers' content: one hex digest."""
    options = sorted((str(name), _stable(value)) for name, value in compile_command.items())
    return hashlib.sha256(canonical.dumps([header, hashable_cmd_line, options])).hexdigest()


def _stable(value: object) -> str:
    """`value` as the same text in every process: an object's repr may hold its address (torch's
    VecISA shows its __hash__ function's), so an object is named by its class and its str()."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}[{', '.join(_stable(v) for v in value)}]"
    return f"{type(value).__module__}.{type(value).__qualname__}:{value}"


def _restored_root(header_dir: Path, env: Mapping[str, str]) -> Path | None:
    """The root a restore hit (or partial restore) laid `header_dir` down in with the inductor-pch layer,
    else None (see isa.restored_inductor_dir)."""
    configured = env.get("TORCHINDUCTOR_CACHE_DIR")
    if not configured:
        return None
    root = Path(configured).absolute().parent
    marker = read_marker(root, RESTORE_MARKER)
    if not vouches(marker, "inductor-pch"):
        return None
    return root if header_dir.absolute().is_relative_to(root) else None


def _answering(original: Callable[..., str], header_dir: Path, root: Path | None) -> Callable[..., str]:
    """`original`, answered from the restored file under `root`, or recording into it without one.
    A restored root's file is only read: rewritten, it would be no restored file for the next process."""
    recorded = _read(header_dir, root)

    @functools.cache
    def precompile_header(header: str, hashable_cmd_line: str, **compile_command) -> str:
        key = request_key(header, hashable_cmd_line, compile_command)
        name = recorded.get(key)
        if name is not None and root is not None and _restored_pair(header_dir, name, root):
            return os.path.join(str(header_dir), name)  # the string torch's own answer is
        path = original(header, hashable_cmd_line, **compile_command)
        if root is None and os.path.dirname(path) == str(header_dir) and _HEADER_NAME.match(os.path.basename(path)):
            recorded[key] = os.path.basename(path)
            _write(header_dir, recorded)
        return path

    setattr(precompile_header, _PATCHED, original)
    return precompile_header


def _restored_pair(header_dir: Path, name: str, root: Path) -> bool:
    return all(is_restored(str(header_dir / n), header_dir, root) for n in (name, f"{name}.gch"))


def _read(header_dir: Path, root: Path | None) -> dict[str, str]:
    """The answers recorded beside the headers; in a restored root, only a restored file's. The file
    may come from the store: anything but a map of hex keys to plain header names is ignored."""
    path = header_dir / NAME
    if root is not None and not is_restored(str(path), header_dir, root):
        return {}
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read(MAX_BYTES + 1))
    except (OSError, ValueError, RecursionError):
        return {}
    headers = doc.get("headers") if type(doc) is dict and doc.get("schema") == SCHEMA else None
    if type(headers) is not dict:
        return {}
    plain = lambda k, v: type(k) is str and _KEY.match(k) and type(v) is str and _HEADER_NAME.match(v)  # noqa: E731
    return {k: v for k, v in headers.items() if plain(k, v)}


def _write(header_dir: Path, recorded: Mapping[str, str]) -> None:
    """Best effort: a file that cannot be written costs the next restored pod a preprocessing."""
    data = canonical.dumps({"schema": SCHEMA, "headers": dict(recorded)})
    if len(data) > MAX_BYTES:
        return
    try:
        atomic.write_bytes(header_dir / NAME, data)
    except OSError as exc:
        log.info("cannot record precompiled headers in %s: %s", header_dir, exc)
