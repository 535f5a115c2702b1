"""Markers under the restore root that say how far a pod has come.

    ROOT/.kcache-state.json    written by `kcache restore` (hit, miss or error): restore finished
    ROOT/.kcache-warmup.json   written by `kcache warmup`: {"status": "ok"|"failed", "seconds", "profiles", ...}
    ROOT/.kcache-watch.json    written by `kcache watch`: JIT compiles seen after the pod became ready

A pod is ready when four signals hold: restore has finished, whatever its outcome (a cold pod must
still serve); the weights loaded (the server's /health or /v1/models answered); the compiled graphs
are done (every warmup profile's first, compiling run returned); and warmup completed with status
"ok". The warmup marker carries the middle two under "signals" and is rewritten as they turn, with
status "running" until warmup ends. Markers are JSON, written atomically and world-readable,
because probes may run as another user than the init container.

The markers describe the model container's first start. When it restarts (a crash, an OOM kill) the
init container does not run again, and its markers go on saying ready while the new process loads
its weights. Given the model server's health URL (`--health-url`), a fifth signal, "engine", asks
it (at most once a second, however many checks arrive): ready also needs a 2xx answer there.

Markers are written by other containers: every string taken from one is shown bounded, on one line.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import xxhash

from kcache import atomic, boundedread, untrusted
from kcache.config import redact_text
from kcache.errors import ConfigError

RESTORE_MARKER = ".kcache-state.json"
WARMUP_MARKER = ".kcache-warmup.json"
WATCH_MARKER = ".kcache-watch.json"
# What the last restore laid down: one xxh3-64 digest of each manifest path per line (kcache.watch
# tells the pod's own files from restored ones by it; files' times do not say, see docs/gpu.md).
RESTORED_PATHS = ".kcache-restored"
MAX_RESTORED_PATHS_BYTES = 64 * 1024 * 1024  # 17 bytes a path: millions of files


def path_digest(manifest_path: str) -> str:
    """A manifest path's line in RESTORED_PATHS."""
    return xxhash.xxh3_64_hexdigest(manifest_path.encode("utf-8", "surrogateescape"))


def restored_paths(root: Path) -> frozenset[str] | None:
    """The digests of the paths the last restore laid down, or None when it recorded none."""
    try:
        text = boundedread.read_bytes(Path(root) / RESTORED_PATHS, MAX_RESTORED_PATHS_BYTES).decode("ascii")
    except (OSError, ValueError):
        return None
    return frozenset(text.split())


def write_marker(root: Path, name: str, doc: dict) -> Path:
    """Write ROOT/name atomically, stamped with finished_at (UTC)."""
    doc = {**doc, "finished_at": datetime.now(timezone.utc).isoformat()}
    target = Path(root) / name
    atomic.write_text(target, json.dumps(doc, sort_keys=True))
    return target


MAX_MARKER_BYTES = 4 * 1024 * 1024  # a warmup marker with 256 profiles is ~100 KB


def read_marker(root: Path, name: str) -> dict | None:
    """The marker's content, or None when it is absent or unreadable. Another container can write
    under ROOT, so a FIFO, a device or a huge file in a marker's place reads as no marker."""
    try:
        doc = json.loads(boundedread.read_bytes(Path(root) / name, MAX_MARKER_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    return doc if isinstance(doc, dict) else None


def restore_stamp(root: Path) -> str | None:
    """The restore marker's finished_at, or None: which restore a warmup that starts now follows."""
    stamp = (read_marker(root, RESTORE_MARKER) or {}).get("finished_at")
    return stamp if isinstance(stamp, str) else None


# The warmup marker's field naming the restore it followed (restore_stamp when warmup started).
AFTER_RESTORE = "restore_finished_at"

SIGNALS = ("restore", "weights", "graphs", "warmup")
ON_FAILURE = ("unready", "ready-cold")


@dataclass(frozen=True)
class Signal:
    name: str  # one of SIGNALS
    ok: bool
    detail: str  # what the marker says, for an operator


@dataclass(frozen=True)
class Readiness:
    ready: bool
    restore: dict | None
    warmup: dict | None
    reason: str  # why not ready; empty when ready
    signals: tuple[Signal, ...] = ()
    cold: bool = False  # ready although warmup failed: the marker asked for ready-cold

    def signal(self, name: str) -> Signal:
        return next(s for s in self.signals if s.name == name)


# Under the kubelet's default probe timeoutSeconds (1 s): a probe that sets none must get kcache's
# verdict, not its own timeout. The example's probe sets timeoutSeconds above it all the same.
ENGINE_TIMEOUT = 0.8
ENGINE_FRESH = 1.0  # seconds an answer serves every check that arrives: /readyz and /metrics cost one GET
MAX_ENGINE_ANSWER = 64 * 1024


class EngineHealth:
    """GET on the model server's health URL (vLLM, SGLang and TGI all serve /health): 2xx is healthy.

    No redirects, one deadline for the whole request (name resolution included), a bounded body
    (kcache.http_client); the path and query are sent as written. Single-flight: checks that arrive
    while a GET is out wait for its answer, and an answer younger than `fresh` seconds is reused.
    """

    def __init__(self, url: str, timeout: float = ENGINE_TIMEOUT, fresh: float = ENGINE_FRESH):
        from kcache import http_client  # only commands given --health-url pay for http.client

        try:
            parts = http_client.parse(url)
        except ConfigError as exc:
            raise ConfigError("--health-url", url, exc.why) from None
        if "@" in parts.netloc:  # http.client would send no credentials: a 401 would read as "down"
            raise ConfigError("--health-url", url, "a user name or password in the URL is not supported")
        self.url, self.timeout, self.fresh, self._client = url, timeout, fresh, http_client
        self._shown = http_client.printable(redact_text(url))
        self._lock = threading.Lock()
        self._last: tuple[float, tuple[bool, str]] | None = None  # (monotonic time, answer)
        self._flight: _Flight | None = None

    def __call__(self) -> tuple[bool, str]:
        """(healthy, what happened), the second safe to print."""
        with self._lock:
            if self._last is not None and time.monotonic() - self._last[0] < self.fresh:
                return self._last[1]
            flight, leader = self._flight, self._flight is None
            if leader:
                flight = self._flight = _Flight()
        if not leader:
            flight.done.wait()
            return flight.answer
        try:
            flight.answer = self._ask()
        finally:
            with self._lock:
                self._last, self._flight = (time.monotonic(), flight.answer), None
            flight.done.set()
        return flight.answer

    def _ask(self) -> tuple[bool, str]:
        try:
            answer = self._client.request("GET", self.url, timeout=self.timeout, max_body=MAX_ENGINE_ANSWER)
        except self._client.RequestFailed as exc:
            return False, f"GET {self._shown}: {exc.why}"
        return 200 <= answer.status < 300, f"GET {self._shown}: {answer.status} {answer.reason}".rstrip()


class _Flight:
    """One GET in progress; `answer` is set before `done`."""

    def __init__(self):
        self.done = threading.Event()
        self.answer: tuple[bool, str] = (False, "the health check failed")


def check(root: Path, engine: EngineHealth | None = None) -> Readiness:
    """Ready = restore finished (any outcome), the weights loaded, the graphs compiled and warmup ok.

    A warmup marker whose `on_failure` is "ready-cold" turns a failed warmup into ready-but-cold,
    as long as the weights loaded: a rollout must not stall because one warmup request failed, and
    `kcache_ready_cold` shows it. Markers from before the signals existed count weights and graphs
    as done when warmup was ok. With `engine`, the model server must also answer its health check
    (after the markers, which say why first); under ready-cold its healthy answer also counts as
    loaded weights, since a server that loaded after warmup gave up leaves a marker nothing rewrites.
    """
    restore = read_marker(root, RESTORE_MARKER)
    warmup = read_marker(root, WARMUP_MARKER)
    stale = _follows_another_restore(restore, warmup)
    if stale:  # the last pod's, on a kept volume: a warmup that outlived its pod wrote it after our restore
        warmup = None
    signals = _signals(restore, warmup)
    healthy, detail = engine() if engine is not None else (False, "")
    if healthy and (warmup or {}).get("on_failure") == "ready-cold" and not signals[1].ok:
        signals = (signals[0], Signal("weights", True, "the model server answers its health check"), *signals[2:])
    reason = _reason(warmup, {s.name: s for s in signals}, stale)
    warmed = signals[-1].ok
    if engine is not None:
        signals += (Signal("engine", healthy, detail),)
        if not healthy and not reason:
            reason = f"the model server is not healthy: {detail}"
    return Readiness(not reason, restore, warmup, reason, signals, cold=not reason and not warmed)


def _shown(value: object) -> str:
    """A marker's value as /readyz, `kcache ready` and /metrics show it: one line, bounded."""
    return untrusted.one_line(value, MAX_SHOWN)


MAX_SHOWN = 200


def _follows_another_restore(restore: dict | None, warmup: dict | None) -> bool:
    """A warmup marker that names the restore it followed, and not the one in place. (Markers that
    name none, from before the field existed, count as following it.)"""
    if warmup is None or AFTER_RESTORE not in warmup:
        return False
    return warmup[AFTER_RESTORE] != (restore or {}).get("finished_at")


def _reason(warmup: dict | None, signal: dict[str, Signal], stale: bool = False) -> str:
    """Why not ready (the first signal that holds the pod back); empty when ready."""
    if not signal["restore"].ok:
        return "restore has not finished"
    if warmup is None:
        return "warmup has not completed" + (" (its marker follows an earlier restore)" if stale else "")
    status = _shown(warmup.get("status", "unknown"))
    if status == "running" and _lapsed(warmup):  # killed mid-way (OOM): nothing will rewrite it
        if warmup.get("on_failure") == "ready-cold" and signal["weights"].ok:
            return ""
        return f"warmup stopped without finishing (its marker expired at {_shown(warmup.get('expires_at'))})"
    if status == "running":
        if not signal["weights"].ok:
            return "warmup running: weights not loaded yet"
        return "warmup running: compiled graphs not done" if not signal["graphs"].ok else "warmup running"
    if status == "ok":
        return ""
    loaded = signal["weights"].ok or "signals" not in warmup  # markers from before the signals: unknown
    if warmup.get("on_failure") == "ready-cold" and signal["weights"].ok:
        return ""
    return f"warmup {status}" + ("" if loaded else " (weights not loaded)")


def _lapsed(warmup: dict) -> bool:
    """A "running" marker past the `expires_at` its writer set (its --budget and a grace): the
    warmup was killed. No expiry, or one that does not parse, never lapses."""
    try:
        expires = datetime.fromisoformat(str(warmup.get("expires_at")))
    except ValueError:
        return False
    if expires.tzinfo is None:
        expires = expires.replace(tzinfo=timezone.utc)
    return expires < datetime.now(timezone.utc)


def _signals(restore: dict | None, warmup: dict | None) -> tuple[Signal, ...]:
    status = _shown((warmup or {}).get("status", ""))
    marked = (warmup or {}).get("signals")
    marked = marked if isinstance(marked, dict) else {"weights": status == "ok", "graphs": status == "ok"}
    weights, graphs = marked.get("weights") is True, marked.get("graphs") is True
    not_started = "warmup has not started"
    return (
        Signal("restore", restore is not None, _shown((restore or {}).get("status", "not finished"))),
        Signal("weights", weights, "loaded" if weights else (f"warmup {status}" if warmup else not_started)),
        Signal("graphs", graphs, "compiled" if graphs else (f"warmup {status}" if warmup else not_started)),
        Signal("warmup", status == "ok", status or "not completed"),
    )


def to_dict(state: Readiness) -> dict:
    """What /readyz and `kcache ready --json` answer: the verdict and each signal apart."""
    return {
        "ready": state.ready,
        "reason": state.reason,
        "cold": state.cold,
        "restore": _status(state.restore),
        "warmup": _status(state.warmup),
        "signals": {s.name: {"ok": s.ok, "detail": s.detail} for s in state.signals},
    }


def _status(marker: dict | None) -> str | None:
    status = (marker or {}).get("status")
    return None if status is None else _shown(status)
