"""Restore: lay the bundle that matches this fingerprint into ROOT, or say why not.

    ROOT/
      kcache.env                   exports for torch, Triton, CUDA, vLLM (written on hit, miss, error)
      .kcache-state.json           outcome of the last restore: what `kcache ready` reads
      inductor/ triton/ cuda/ vllm/ megacache/ extra/<name>/
      tmp/torchinductor_<user>/precompiled_headers/
      .kcache-staging-<pid>-<rand>/  only while a restore runs:
          files/<manifest path>      verified blobs, laid out as the manifest says
          retired/<n>                the layers the swap replaced, deleted with the staging dir

Every blob is fetched into the staging directory and verified (size and SHA-256) before any
layer moves; then each layer is swapped in with renames. A failure or timeout before the swap
leaves ROOT as it was. Ranges of a pack that lie close together are fetched with one read.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kcache import choice, envfile, fetch, progress, signing
from kcache import manifest as manifests
from kcache import sources as layers
from kcache.errors import (
    ConfigError,
    KcacheError,
    RestoreTimeout,
    RootError,
    UnsafePath,
)
from kcache.fingerprint import Fingerprint
from kcache.packs import unpack_frame
from kcache.readiness import RESTORE_MARKER, read_marker, write_marker
from kcache.records import Event
from kcache.store import Store

log = logging.getLogger(__name__)

STAGING_PREFIX = ".kcache-staging-"
# Layers keyed by their own content (kernel source, graph hash): safe to share between workloads
# that run on one toolchain. vLLM's cache and user directories are keyed by the workload itself.
PARTIAL_LAYERS = ("inductor", "inductor-pch", "triton", "cuda")


@dataclass(frozen=True)
class RestoreResult:
    status: str  # hit | partial (--fallback toolchain) | miss (| error, only in the marker written on failure)
    bundle_key: str
    bundle_id: str | None
    root: Path
    env_file: Path
    layers: tuple[str, ...] = ()
    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    reason: str = ""
    signed_by: str | None = None


@dataclass
class _Budget:
    """Shared between the caller and the worker: once expired, the worker must not swap."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    expired: bool = False
    swapping: bool = False
    staging: Path | None = None  # removed by the caller on expiry: a hung worker may never return


class Catalog(Protocol):
    """Where restore finds the newest bundle: the SQL index, or refs in the store (kcache.refs)."""

    def newest_bundle(self, bundle_key: str): ...  # an object with .id (the manifest id), or None

    def newest_for_toolchain(self, toolchain_key: str): ...  # same, for --fallback toolchain

    def record_event(self, event: Event) -> None: ...


def restore(
    store: Store,
    index: Catalog,
    fingerprint: Fingerprint,
    root: Path,
    *,
    jobs: int = 16,
    timeout: float | None = None,
    bundle_id: str | None = None,
    trusted: tuple[signing.TrustedKey, ...] = (),
    require_signature: bool = False,
    fallback: str | None = None,
    report: progress.Report | None = None,
) -> RestoreResult:
    """Restore the newest bundle for `fingerprint` (or the pinned `bundle_id`) into `root`.

    A pinned bundle must still match the fingerprint. With trusted keys, a signature that does
    not verify is refused; with `require_signature`, so is an unsigned bundle. With
    fallback="toolchain", a miss restores the kernel layers of the newest bundle built on the same
    toolchain (status "partial"). `report` receives the fetch's progress (kcache.progress).
    Raises KcacheError.
    """
    if fallback not in (None, "toolchain"):
        raise ConfigError("--fallback", str(fallback), "the only fallback is 'toolchain'")
    if require_signature and not trusted:
        raise ConfigError("--require-signature", "on", "needs at least one --trusted-key (or KCACHE_TRUSTED_KEYS)")
    policy = choice.Policy(trusted, require_signature)
    started = time.perf_counter()
    root = Path(root).absolute()
    try:
        try:
            result = _within(timeout, lambda budget: _restore(store, index, fingerprint, root, jobs, budget,
                                                              bundle_id, policy, fallback, report))  # fmt: skip
        except OSError as exc:  # the disk, not the bundle: ENOSPC, EACCES, a read-only volume
            raise _root_error(root, exc) from exc
    except KcacheError as exc:
        seconds = time.perf_counter() - started
        _record(index, Event("restore", "error", fingerprint.bundle_key, None, 0, 0, seconds, str(exc)))
        failed = RestoreResult("error", fingerprint.bundle_key, None, root, root / envfile.NAME,
                               seconds=seconds, reason=str(exc))  # fmt: skip
        _finish_quietly(root, fingerprint, failed)  # the pod starts cold, but with the right env
        raise
    _record(index, Event("restore", result.status, result.bundle_key, result.bundle_id,
                         result.files, result.bytes, result.seconds, result.reason or None))  # fmt: skip
    _write_state(result)
    return result


def _root_error(root: Path, exc: OSError) -> RootError:
    if exc.errno == errno.ENOSPC:
        return RootError(str(root), "no space left on device while staging the bundle; give the volume more room")
    return RootError(str(root), f"cannot write {exc.filename or root}: {exc.strerror or exc}")


def _within(timeout: float | None, work) -> RestoreResult:
    budget = _Budget()
    if timeout is None:
        return work(budget)
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = work(budget)
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    worker = threading.Thread(target=run, name="kcache-restore", daemon=True)
    worker.start()
    worker.join(timeout)
    with budget.lock:
        if worker.is_alive() and not budget.swapping:
            budget.expired = True
            if budget.staging is not None:
                shutil.rmtree(budget.staging, ignore_errors=True)
            raise RestoreTimeout(timeout)
    worker.join()  # the swap had begun: it is a few renames, let it finish
    if "error" in box:
        raise box["error"]
    return box["result"]


def _restore(
    store: Store,
    index: Catalog,
    fp: Fingerprint,
    root: Path,
    jobs: int,
    budget: _Budget,
    pinned: str | None,
    policy: choice.Policy,
    fallback: str | None = None,
    report: progress.Report | None = None,
) -> RestoreResult:
    started = time.perf_counter()
    _prepare_root(root)
    if fp.mismatches:  # the facts file describes another machine: its bundle would be a wrong hit
        chosen = fp.mismatch_reason()
    else:
        chosen = choice.pick(store, index, fp, pinned, fallback, policy)
    if isinstance(chosen, str):
        env_file = _write_env(root, fp, [], f"miss, {chosen}")
        return RestoreResult("miss", fp.bundle_key, None, root, env_file, seconds=time.perf_counter() - started,
                             reason=chosen)  # fmt: skip
    partial = chosen.partial
    manifest, signer = choice.read_manifest(store, chosen, fp, policy)
    _check_layers(manifest)
    layer_names = tuple(n for n in manifest.layers if n in PARTIAL_LAYERS) if partial else manifest.layers
    entries = tuple(e for e in manifest.entries if not partial or e.path.split("/", 1)[0] in PARTIAL_LAYERS)
    _lay_out(store, root, entries, layers.for_manifest(layer_names), jobs, budget, report)
    env_file = _write_env(root, fp, layer_names, f"{'partial' if partial else 'hit'}, bundle {manifest.id}")
    reason = (
        f"kernel layers of bundle {manifest.id[:12]}, built on this toolchain for another workload" if partial else ""
    )
    return RestoreResult("partial" if partial else "hit", fp.bundle_key, manifest.id, root, env_file, layer_names,
                         len(entries), sum(e.size for e in entries), time.perf_counter() - started, reason,
                         signer)  # fmt: skip


def _check_layers(manifest: manifests.Manifest) -> None:
    """Every file must lie in one of the bundle's layers: nothing may land beside them in ROOT."""
    prefixes = tuple(source.subdir + "/" for source in layers.for_manifest(manifest.layers))
    for entry in manifest.entries:
        if not entry.path.startswith(prefixes):
            raise UnsafePath(entry.path, "belongs to no layer of the bundle that this kcache knows")


def _lay_out(store: Store, root: Path, entries, sources: list[layers.Source], jobs: int, budget: _Budget,
             report: progress.Report | None = None) -> None:  # fmt: skip
    """Fetch and verify everything into staging, then swap the layers in (unless time ran out)."""
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=root))
    with budget.lock:
        budget.staging = staging
    try:
        with progress.Meter("restoring", files=len(entries), bytes=sum(e.size for e in entries),
                            report=report) as meter:  # fmt: skip
            _fetch_all(store, entries, staging, jobs, budget, meter)
        with budget.lock:
            if budget.expired:
                raise fetch.Cancelled()
            budget.swapping = True
        _swap(root, staging, sources)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _prepare_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise RootError(str(root), "exists and is not a directory; pass an empty or kcache-managed directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RootError(str(root), f"cannot be created: {exc.strerror}") from None
    for stale in root.glob(STAGING_PREFIX + "*"):
        pid = stale.name.removeprefix(STAGING_PREFIX).split("-", 1)[0]
        if not (pid.isdigit() and _alive(int(pid))):
            shutil.rmtree(stale, ignore_errors=True)  # left by a restore that was killed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fetch_all(store: Store, entries: tuple[manifests.Entry, ...], staging: Path, jobs: int, budget: _Budget,
               meter: progress.Meter) -> None:  # fmt: skip
    """Every blob into its staged path (verified), then the paths that share a blob as copies."""
    files = staging / "files"
    # Directories once up front: per-file mkdir calls cost more than the writes on small caches.
    for directory in sorted({(files / e.path).parent for e in entries}):
        directory.mkdir(parents=True, exist_ok=True)
    umask = _umask()

    def create(entry: manifests.Entry):
        path = files / entry.path  # manifest.parse already refused absolute paths and '..'
        # Readable too: a blob fetched in parts is hashed by reading its chunks back (kcache.fetch).
        return open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, entry.mode), "r+b")

    def finish(entry: manifests.Entry) -> None:
        """After the last write and close of a verified file."""
        if entry.mode & umask:  # the umask took bits the manifest asks for
            os.chmod(files / entry.path, entry.mode)

    def lay(entry: manifests.Entry, write) -> None:
        with create(entry) as out:
            write(out)
        finish(entry)

    def place(entry: manifests.Entry, frame) -> None:
        lay(entry, lambda out: unpack_frame(frame, entry.blob, entry.size, out))

    fetch.fetch_blobs(store, entries, place, jobs=jobs, cancelled=lambda: budget.expired, open_blob=create,
                      closed=finish, meter=meter)  # fmt: skip
    first_path: dict[str, str] = {}
    for entry in entries:
        origin = first_path.setdefault(entry.blob, entry.path)
        if origin != entry.path:  # already verified when its first path was written
            with open(files / origin, "rb") as src:
                lay(entry, lambda out, src=src: shutil.copyfileobj(src, out))
            meter.add(files=1, bytes=entry.size)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask would race with other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o777  # unknown: always chmod


def _swap(root: Path, staging: Path, sources: list[layers.Source]) -> None:
    """Move each staged layer into place; the previous content goes into staging and is deleted with it."""
    # Staged files live under staging/files and retired layers under staging/retired, so no
    # manifest path can collide with the retirement directory.
    retired = staging / "retired"
    retired.mkdir()
    for i, source in enumerate(sources):
        staged = staging / "files" / source.subdir
        if not staged.is_dir():
            continue
        target = _inside(root, source.restore_dir(root))
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists() or target.is_symlink():
            os.rename(target, retired / str(i))
        os.rename(staged, target)


def _inside(root: Path, path: Path) -> Path:
    """`path`, if no link already in ROOT (say ROOT/tmp -> /) carries it outside the root."""
    if not path.parent.resolve().is_relative_to(root.resolve()):
        raise UnsafePath(str(path.relative_to(root)), f"resolves outside {root} through a symbolic link")
    return path


def _write_env(root: Path, fp: Fingerprint, layer_names, comment: str) -> Path:
    """Create every layer directory and write kcache.env."""
    exports = layers.all_exports(root, layer_names)
    # Torch's own keys then carry the toolchain: a cache that reaches another machine by other
    # means misses instead of running kernels built for another ISA.
    exports["TORCH_COMPILE_CACHE_KEY_TAG"] = key_tag(fp)
    for source in layers.BUILTIN:
        place = _inside(root, source.restore_dir(root))
        if place.is_symlink() and not place.exists():
            place.unlink()  # a dangling link would make every run fail: replace it with a directory
        place.mkdir(parents=True, exist_ok=True)
    return envfile.write(root, exports, f"kcache restore: {comment}")


def _write_state(result: RestoreResult) -> None:
    """The restore marker: restore has finished, with what outcome (readiness and /metrics read it)."""
    write_marker(result.root, RESTORE_MARKER, {
        "status": result.status, "bundle_key": result.bundle_key, "bundle_id": result.bundle_id,
        "files": result.files, "bytes": result.bytes, "seconds": round(result.seconds, 4),
        "reason": result.reason, "layers": list(result.layers),
    })  # fmt: skip


def key_tag(fp: Fingerprint) -> str:
    return f"kcache-{fp.toolchain_key}"


def _finish_quietly(root: Path, fp: Fingerprint, failed: RestoreResult) -> None:
    try:
        if root.is_dir():
            _write_env(root, fp, [], f"error, {failed.reason}")
            _write_state(failed)
    except (OSError, KcacheError) as exc:
        log.warning("cannot write kcache.env in %s: %s", root, exc)


def read_state(root: Path) -> dict | None:
    """The outcome of the last restore into `root`, or None if none finished there."""
    return read_marker(root, RESTORE_MARKER)


def _record(index: Catalog, event: Event) -> None:
    try:
        index.record_event(event)
    except KcacheError as exc:  # stats are worth less than the pod's start
        log.warning("cannot record restore event: %s", exc)
