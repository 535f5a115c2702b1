"""Markers under the restore root that say how far a pod has come.

    ROOT/.kcache-state.json    written by `kcache restore` (hit, miss or error): restore finished
    ROOT/.kcache-warmup.json   written by `kcache warmup`: {"status": "ok"|"failed", "seconds", "profiles", ...}
    ROOT/.kcache-watch.json    written by `kcache watch`: JIT compiles seen after the pod became ready

A pod is ready when restore has finished, whatever its outcome (a cold pod must still serve), and
warmup has completed with status "ok". Markers are JSON, written atomically and world-readable,
because probes may run as another user than the init container.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kcache import atomic

RESTORE_MARKER = ".kcache-state.json"
WARMUP_MARKER = ".kcache-warmup.json"
WATCH_MARKER = ".kcache-watch.json"


def write_marker(root: Path, name: str, doc: dict) -> Path:
    """Write ROOT/name atomically, stamped with finished_at (UTC)."""
    doc = {**doc, "finished_at": datetime.now(timezone.utc).isoformat()}
    target = Path(root) / name
    atomic.write_text(target, json.dumps(doc, sort_keys=True))
    return target


def read_marker(root: Path, name: str) -> dict | None:
    """The marker's content, or None when it is absent or unreadable."""
    try:
        doc = json.loads((Path(root) / name).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


@dataclass(frozen=True)
class Readiness:
    ready: bool
    restore: dict | None
    warmup: dict | None
    reason: str  # why not ready; empty when ready


def check(root: Path) -> Readiness:
    """Ready = restore finished (any outcome) and warmup completed with status ok."""
    restore = read_marker(root, RESTORE_MARKER)
    warmup = read_marker(root, WARMUP_MARKER)
    if restore is None:
        reason = "restore has not finished"
    elif warmup is None:
        reason = "warmup has not completed"
    elif warmup.get("status") != "ok":
        reason = f"warmup {warmup.get('status', 'unknown')}"
    else:
        reason = ""
    return Readiness(not reason, restore, warmup, reason)
