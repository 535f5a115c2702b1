"""Watch: notice cache files that appear after the pod became ready, count them, publish them.

    ROOT/.kcache-watch-baseline.json  the cache files present when the pod became ready (taken once)
    ROOT/.kcache-watch.json           WATCH_MARKER, rewritten when it changes:
        {"baseline_files": N, "new_files": {layer: count}, "new_bytes": {layer: bytes},
         "files": [[layer, path], ...] (at most MAX_LISTED), "publishes": N, "publish_errors": N,
         "last_publish": {"bundle_id", "created", "new_blobs", "uploaded_bytes"} | null}

Every file that appears after ready is a kernel compiled on the hot path: a shape warmup did not
cover. The baseline is the files present once readiness holds, less those modified after the
later of the restore and warmup markers, so a compile between "ready" and the first scan still
counts as new. It is kept on disk, so a restarted sidecar (or `--once`) compares with the same
moment. Scanning is a pure function of the tree and the baseline; the loop adds the clock, the
publish cadence and a stop event.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kcache import readiness
from kcache.config import redact_text
from kcache.errors import KcacheError, RootError
from kcache.publish import PublishResult
from kcache.sources import Source, in_root

log = logging.getLogger(__name__)

BASELINE_MARKER = ".kcache-watch-baseline.json"
MAX_LISTED = 200  # the marker lists this many new files; the counts are always complete

Publisher = Callable[[list[Source]], PublishResult]
# The share of the stop's grace a publish may spend waiting for the lease (the publisher's config asks
# Watcher.lease_deadline, kcache.publish.PublishConfig.lease_deadline): a Deployment's
# replicas stopped together would otherwise publish one after another, far past the grace, and be
# abandoned with their kernels in no bundle. Without the lease it uploads what the holder has not
# yet, and its commit keeps every other replica's kernels (kcache.publish._commit).
LEASE_SHARE = 0.5


@dataclass(frozen=True)
class CacheFile:
    layer: str
    rel: str  # POSIX path inside the layer directory
    size: int
    mtime: float


@dataclass(frozen=True)
class Baseline:
    files: frozenset[tuple[str, str]]  # (layer, rel)
    # Those this pod compiled before ready (newer than its restore: warmup's kernels, all of them on
    # a miss): no restore's files, so published at the first step like the files compiled after ready.
    own: frozenset[tuple[str, str]] = frozenset()


@dataclass(frozen=True)
class Step:
    ready: bool
    reason: str = ""  # why not ready yet
    new: tuple[CacheFile, ...] = ()  # every file not in the baseline
    fresh: tuple[CacheFile, ...] = ()  # those the previous steps had not reported
    published: PublishResult | None = None
    publish_error: str = ""


def layers_under(root: Path) -> list[Source]:
    """The built-in layers, plus each extra layer a restore laid down under ROOT/extra/."""
    return in_root(root)


def listing(root: Path, layers: list[Source]) -> list[CacheFile]:
    """Every non-junk regular file of each layer under ROOT."""
    found = []
    for source in layers:
        for top in source.read_dirs(Path(root), {}):
            for info in source.walk(top):
                try:
                    mtime = info.path.stat().st_mtime
                except FileNotFoundError:
                    continue
                found.append(CacheFile(source.name, info.rel, info.size, mtime))
    return found


def snapshot(root: Path, layers: list[Source], ready_at: float | None = None,
             restored_at: float | None = None) -> Baseline:
    """The files present now; with `ready_at` (epoch seconds), less those modified after it; with
    `restored_at`, those modified after it are the pod's own, unless the restore laid their path
    down (readiness.RESTORED_PATHS): the CUDA driver rewrites its restored files on a cache hit."""
    present = [f for f in listing(root, layers) if ready_at is None or f.mtime <= ready_at]
    laid = readiness.restored_paths(root) or frozenset()
    subdirs = {source.name: source.subdir for source in layers}
    own = [f for f in present if restored_at is not None and f.mtime > restored_at
           and readiness.path_digest(f"{subdirs.get(f.layer, f.layer)}/{f.rel}") not in laid]  # fmt: skip
    return Baseline(frozenset((f.layer, f.rel) for f in present), frozenset((f.layer, f.rel) for f in own))


def scan(root: Path, baseline: Baseline, layers: list[Source]) -> tuple[CacheFile, ...]:
    """Files under ROOT that are not in the baseline, sorted by layer and path."""
    return _not_in(baseline, listing(root, layers))


def _not_in(baseline: Baseline, files: list[CacheFile]) -> tuple[CacheFile, ...]:
    new = [f for f in files if (f.layer, f.rel) not in baseline.files]
    return tuple(sorted(new, key=lambda f: (f.layer, f.rel)))


def emptied(baseline: Baseline, files: list[CacheFile]) -> list[str]:
    """Layers that held files when the pod became ready and hold none now: a directory removed or
    unreadable (the walk passes over what it cannot list). Publish takes ROOT as it is, and restore
    prefers the newest bundle: publishing now would take those layers away from every later pod."""
    return sorted({layer for layer, _ in baseline.files} - {f.layer for f in files})


def restore_time(root: Path) -> float | None:
    """When the restore finished (its marker's mtime); a restored file is never newer."""
    return _marker_time(root, readiness.RESTORE_MARKER)


def ready_time(root: Path) -> float | None:
    """When the pod became ready: the later of the restore and warmup markers' mtimes."""
    times = [_marker_time(root, name) for name in (readiness.RESTORE_MARKER, readiness.WARMUP_MARKER)]
    return None if None in times else max(times)


def _marker_time(root: Path, name: str) -> float | None:
    try:
        return (Path(root) / name).stat().st_mtime
    except (FileNotFoundError, NotADirectoryError):  # a file above ROOT: no ROOT, as for a missing one
        return None


def load_baseline(root: Path) -> Baseline | None:
    """The saved baseline, unless a restore finished after it was taken (a reused root)."""
    taken, restored = _marker_time(root, BASELINE_MARKER), _marker_time(root, readiness.RESTORE_MARKER)
    if taken is None or restored is None or taken < restored:
        return None
    doc = readiness.read_marker(root, BASELINE_MARKER) or {}
    files = _pairs(doc.get("files"))
    return None if files is None else Baseline(files, _pairs(doc.get("own", [])) or frozenset())  # damaged: again


def _pairs(value) -> frozenset[tuple[str, str]] | None:
    """[[layer, path], ...] as a marker holds it, or None when it is anything else (a damaged file)."""
    if not isinstance(value, list):
        return None
    if not all(isinstance(item, list) and len(item) == 2 and all(isinstance(x, str) for x in item) for item in value):
        return None
    return frozenset((layer, rel) for layer, rel in value)


def _count(doc: dict, field: str) -> int:
    value = doc.get(field)
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63 else 0


def save_baseline(root: Path, baseline: Baseline) -> None:
    readiness.write_marker(root, BASELINE_MARKER, {"files": sorted(baseline.files), "own": sorted(baseline.own)})


def describe(exc: Exception) -> str:
    """kcache's own errors say what went wrong; anything else is named by its type too. Redacted:
    the text goes to --json and the pod log, and a driver's message may quote the index URL whole."""
    return redact_text(str(exc) if isinstance(exc, KcacheError) else f"{type(exc).__name__}: {exc}")


class Watcher:
    """Scans ROOT once per `step`; publishes the delta at most every `publish_every` seconds."""

    def __init__(
        self,
        root: Path,
        *,
        publisher: Publisher | None = None,
        publish_every: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():  # a FIFO or file: every marker write below would fail
            raise RootError(str(root), "is not a directory")
        self._publisher, self._every, self._clock = publisher, publish_every, clock
        self._baseline: Baseline | None = None
        self._since_publish = 0.0
        self._published: set[tuple[str, str]] = set()
        previous = readiness.read_marker(self.root, readiness.WATCH_MARKER) or {}
        # Counters survive a restart of the sidecar; the list only keeps the log from repeating itself.
        # The marker lies on a volume the model container shares: a damaged one starts from zero.
        self._publishes = _count(previous, "publishes")
        self._errors = _count(previous, "publish_errors")
        last = previous.get("last_publish")
        self._last_publish = last if isinstance(last, dict) else None
        self._reported = set(_pairs(previous.get("files")) or ())
        self._written: dict | None = None
        self._stopped_at: float | None = None  # time.monotonic() when run() saw the stop
        self._grace: float | None = None  # run()'s
        self.final_error = ""  # why the publish on stop failed (run), or ""

    def step(self, *, publish_now: bool = False) -> Step:
        if self._baseline is None:
            self._baseline = load_baseline(self.root)
            if self._baseline is None:
                state = readiness.check(self.root)
                if not state.ready:
                    return Step(False, state.reason)
                self._baseline = snapshot(self.root, layers_under(self.root), ready_time(self.root),
                                          restore_time(self.root))  # fmt: skip
                save_baseline(self.root, self._baseline)
                log.info("ready: watching %d cache files under %s (%d compiled here before ready)",
                         len(self._baseline.files), self.root, len(self._baseline.own))  # fmt: skip
            self._since_publish = self._clock()
            publish_now = publish_now or bool(self._baseline.own)  # later replicas need them now, not when due
        layers = layers_under(self.root)
        files = listing(self.root, layers)
        new = _not_in(self._baseline, files)
        own = tuple(f for f in files if (f.layer, f.rel) in self._baseline.own)
        fresh = tuple(f for f in new if (f.layer, f.rel) not in self._reported)
        for f in fresh:
            log.warning("compiled after ready (warmup did not cover it): layer %s file %s (%d bytes)",
                        f.layer, f.rel, f.size)  # fmt: skip
        self._reported.update((f.layer, f.rel) for f in fresh)
        published, error = self._maybe_publish(new + own, layers, publish_now, emptied(self._baseline, files))
        self._write_marker(new, layers)
        return Step(True, "", new, fresh, published, error)

    def run(self, stop: threading.Event, interval: float, grace: float | None = None) -> bool:
        """Step every `interval` seconds until `stop` is set; then publish what remains.

        The steps run in a thread of their own, so that the caller's wait on `stop` ends at once
        whatever a publish is waiting for. From then on the step under way and the last publish
        get `grace` seconds (None: no limit; keep it under the pod's terminationGracePeriod), then
        are abandoned: False. A publish cut short leaves only orphans for GC (kcache.publish), and
        what it would have published comes with the next pod's. Publishes whose config asks
        `lease_deadline` wait for another publish's lease of their key only up to LEASE_SHARE of `grace`."""
        worker = threading.Thread(target=self._loop, args=(stop, interval), name="kcache-watch", daemon=True)
        self._grace = grace
        worker.start()
        stop.wait()
        self._stopped_at = time.monotonic()
        worker.join(grace)
        if worker.is_alive():
            log.warning("the last publish did not finish within %g s of the stop; abandoned", grace)
            return False
        return True

    def lease_deadline(self) -> float | None:
        """When any publish of this watcher stops waiting for its key's lease: LEASE_SHARE of the
        grace after the stop (a periodic publish waiting when the stop came included), else None."""
        if self._stopped_at is None or self._grace is None:
            return None
        return self._stopped_at + self._grace * LEASE_SHARE

    def _loop(self, stop: threading.Event, interval: float) -> None:
        try:
            while True:
                self._step_logged()
                if stop.wait(interval):
                    break
            self._stopped_at = self._stopped_at or time.monotonic()  # run() may not have noted it yet
            if self._publisher is not None and self._baseline is not None:
                last = self._step_logged(publish_now=True)  # the pod is going away: keep what it compiled
                self.final_error = "the last scan failed (see the log)" if last is None else last.publish_error
        finally:
            stop.set()  # however the loop ended, run() stops waiting

    def _step_logged(self, **kwargs) -> Step | None:
        try:
            return self.step(**kwargs)
        except Exception as exc:  # the sidecar (and the /readyz it serves) outlives a bad scan; the next one retries
            log.warning("watch step failed: %s", describe(exc))
            log.debug("watch step failed", exc_info=True)
            return None

    def _maybe_publish(self, new, layers, publish_now: bool, gone: list[str]) -> tuple[PublishResult | None, str]:
        pending = {(f.layer, f.rel) for f in new} - self._published
        if self._publisher is None or not pending:
            return None, ""
        due = self._every is not None and self._clock() - self._since_publish >= self._every
        if not (publish_now or due):
            return None, ""
        self._since_publish = self._clock()
        if gone:  # counted as a failed publish (an alert on publish errors sees it); retried when next due
            self._errors += 1
            why = (
                f"not publishing: layer {', '.join(gone)} held files when the pod became ready and holds none now "
                "(its directory removed or unreadable); a bundle without it would replace the one restored"
            )
            log.warning("%s", why)
            return None, why
        try:
            result = self._publisher(layers)
        # Store or index away, a file unreadable, or a bug: count it, retry when next due. A sidecar
        # that died here would take the pod's /readyz with it.
        except Exception as exc:
            self._errors += 1
            log.warning("publishing %d new files failed: %s", len(pending), describe(exc))
            log.debug("publish failed", exc_info=True)
            return None, describe(exc)
        # Only what the bundle holds: a file publish skipped (a compile still writing it) is pending still.
        subdirs = {source.name: source.subdir for source in layers}
        skipped = set(result.skipped)
        self._published.update(p for p in pending if f"{subdirs.get(p[0], p[0])}/{p[1]}" not in skipped)
        self._publishes += 1
        self._last_publish = {"bundle_id": result.bundle_id, "created": result.created,
                              "new_blobs": result.new_blobs, "uploaded_bytes": result.uploaded_bytes}  # fmt: skip
        log.info("published %d files compiled in this pod: bundle %s, %d new blobs",
                 len(pending), result.bundle_id[:12], result.new_blobs)  # fmt: skip
        return result, ""

    def _write_marker(self, new: tuple[CacheFile, ...], layers: list[Source]) -> None:
        counts = {s.name: 0 for s in layers}
        sizes = {s.name: 0 for s in layers}
        for f in new:
            counts[f.layer] = counts.get(f.layer, 0) + 1
            sizes[f.layer] = sizes.get(f.layer, 0) + f.size
        doc = {
            "baseline_files": len(self._baseline.files) if self._baseline else 0,
            "new_files": counts,
            "new_bytes": sizes,
            "files": [[f.layer, f.rel] for f in new[:MAX_LISTED]],
            "publishes": self._publishes,
            "publish_errors": self._errors,
            "last_publish": self._last_publish,
        }
        if doc != self._written:  # unchanged scans leave the file (and its finished_at) alone
            readiness.write_marker(self.root, readiness.WATCH_MARKER, doc)
            self._written = doc
