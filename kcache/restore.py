"""Restore: lay the bundle that matches this fingerprint into ROOT, or say why not.

    ROOT/
      kcache.env                   exports for torch, Triton, CUDA, vLLM (written on hit, miss, error)
      .kcache-state.json           outcome of the last restore: what `kcache ready` reads
      .kcache-lock                 flock'ed for the whole of a restore (kcache.rootdir)
      inductor/ triton/ cuda/ vllm/ megacache/ extra/<name>/
      tmp/torchinductor_<user>/precompiled_headers/
      .kcache-staging-<pid>-<rand>/  only while a restore runs:
          files/<manifest path>      verified blobs, laid out as the manifest says
          retired/<n>                the layers the swap replaced, deleted with the staging dir

Every blob is fetched into the staging directory and verified (size and SHA-256) before any
layer moves; then each layer is swapped in with renames. A failure or timeout before the swap
leaves ROOT as it was. Ranges of a pack that lie close together are fetched with one read.

Fail-open: everything a restore does, opening the store and the index and computing the
fingerprint included, runs inside its time budget, and whatever goes wrong, the restore that
holds ROOT's lock leaves kcache.env and an "error" marker behind, so the pod starts cold and
`kcache ready` sees that restore finished. Only a ROOT that cannot be written gets neither.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kcache import envfile, fetch, refs, rootdir, signing
from kcache import manifest as manifests
from kcache import sources as layers
from kcache.errors import (
    ConfigError,
    IntegrityError,
    KcacheError,
    RestoreTimeout,
    RootError,
    SignatureError,
    UnsafePath,
)
from kcache.fingerprint import Fingerprint
from kcache.packs import unpack_frame
from kcache.readiness import RESTORE_MARKER, read_marker, write_marker
from kcache.records import Event
from kcache.rootdir import STAGING_PREFIX
from kcache.store import Store, manifest_key
from kcache.untrusted import one_line

log = logging.getLogger(__name__)

# Seconds recording the outcome may take: a healthy index answers in milliseconds, and the pod
# is ready to start; at least a second even once the budget is spent.
_RECORD_LIMIT, _RECORD_GRACE = 5.0, 1.0
# Layers keyed by their own content (kernel source, graph hash): safe to share between workloads
# that run on one toolchain. vLLM's cache and user directories are keyed by the workload itself.
PARTIAL_LAYERS = ("inductor", "inductor-pch", "triton", "cuda")


@dataclass(frozen=True)
class RestoreResult:
    status: str  # hit | partial (--fallback toolchain) | miss (| error, only in the marker written on failure)
    bundle_key: str | None  # None when restore failed before it had a fingerprint
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


@dataclass(frozen=True)
class Opened:
    """What a restore works with. Opening it is part of the restore: it runs inside the budget."""

    store: Store
    index: Catalog
    fingerprint: Fingerprint
    trusted: tuple[signing.TrustedKey, ...] = ()


def restore(
    store: Store,
    index: Catalog,
    fingerprint: Fingerprint,
    root: Path,
    *,
    trusted: tuple[signing.TrustedKey, ...] = (),
    **options,
) -> RestoreResult:
    """Restore the newest bundle for `fingerprint` into `root` (see `restore_opening` for options)."""
    return restore_opening(lambda: Opened(store, index, fingerprint, trusted), root, **options)


def restore_opening(
    open_inputs: Callable[[], Opened],
    root: Path,
    *,
    jobs: int = 16,
    timeout: float | None = None,
    bundle_id: str | None = None,
    require_signature: bool = False,
    fallback: str | None = None,
) -> RestoreResult:
    """Open what `open_inputs` opens, then restore the newest bundle (or the pinned `bundle_id`).

    A pinned bundle must still match the fingerprint. With trusted keys, a signature that does
    not verify is refused; with `require_signature`, so is an unsigned bundle. With
    fallback="toolchain", a miss restores the kernel layers of the newest bundle built on the same
    toolchain (status "partial"). Raises KcacheError, or whatever `open_inputs` raised; either
    way kcache.env and an error marker are written first, unless ROOT itself is unusable
    (RootError) or another restore held ROOT for the whole budget (RootBusy: that one writes them).
    """
    started = time.perf_counter()
    deadline = None if timeout is None else time.monotonic() + timeout
    root = Path(root).absolute()
    rootdir.prepare(root)
    with rootdir.locked(root, timeout, deadline):
        rootdir.remove_staging(root)
        opened: list[Opened] = []  # filled by the worker, read here: what the error path may use

        def work(budget: _Budget) -> RestoreResult:
            return _open_and_restore(open_inputs, opened, root, jobs, budget, bundle_id, require_signature, fallback)

        try:
            try:
                result = _within(timeout, deadline, work)
                _finish(root, result)
            except OSError as exc:  # the disk, not the bundle: ENOSPC, EACCES, a read-only volume
                raise _root_error(root, exc) from exc
        except Exception as exc:  # noqa: BLE001 - any failure, a kcache bug included, must leave a pod that starts
            _fail(root, opened, exc, time.perf_counter() - started, deadline)
            raise
        _record(opened[0].index, Event("restore", result.status, result.bundle_key, result.bundle_id,
                                       result.files, result.bytes, result.seconds, result.reason or None),
                deadline)  # fmt: skip
        return result


def _open_and_restore(open_inputs, opened: list, root: Path, jobs: int, budget: _Budget, pinned: str | None,
                      require_signature: bool, fallback: str | None) -> RestoreResult:  # fmt: skip
    if fallback not in (None, "toolchain"):
        raise ConfigError("--fallback", str(fallback), "the only fallback is 'toolchain'")
    inputs = open_inputs()
    opened.append(inputs)
    if require_signature and not inputs.trusted:
        raise ConfigError("--require-signature", "on", "needs at least one --trusted-key (or KCACHE_TRUSTED_KEYS)")
    policy = _Policy(inputs.trusted, require_signature)
    return _restore(inputs.store, inputs.index, inputs.fingerprint, root, jobs, budget, pinned, policy, fallback)


def _fail(root: Path, opened: list[Opened], exc: Exception, seconds: float, deadline: float | None) -> None:
    """The pod starts cold, but with the right env and a marker that says why."""
    reason = one_line(exc if isinstance(exc, KcacheError) else f"{type(exc).__name__}: {exc}")
    bundle_key = opened[0].fingerprint.bundle_key if opened else None
    failed = RestoreResult("error", bundle_key, None, root, root / envfile.NAME, seconds=seconds, reason=reason)
    # Each on its own: a ROOT whose tmp/ links outside gets no env file, but still its marker.
    for what, write in (("kcache.env", lambda: _write_env(root, (), _env_comment(failed))),
                        ("the restore marker", lambda: _write_state(failed))):  # fmt: skip
        try:
            write()
        except (OSError, KcacheError) as write_error:
            log.warning("cannot write %s in %s: %s", what, root, one_line(write_error))
    if opened:
        _record(opened[0].index, Event("restore", "error", bundle_key, None, 0, 0, seconds, reason), deadline)


def _root_error(root: Path, exc: OSError) -> RootError:
    if exc.errno == errno.ENOSPC:
        return RootError(str(root), "no space left on device while staging the bundle; give the volume more room")
    return RootError(str(root), f"cannot write {exc.filename or root}: {exc.strerror or exc}")


def _within(timeout: float | None, deadline: float | None, work) -> RestoreResult:
    budget = _Budget()
    if deadline is None:
        return work(budget)
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = work(budget)
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    worker = threading.Thread(target=run, name="kcache-restore", daemon=True)
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    with budget.lock:
        if worker.is_alive() and not budget.swapping:
            budget.expired = True
            if budget.staging is not None:
                shutil.rmtree(budget.staging, ignore_errors=True)
            raise RestoreTimeout(timeout or 0.0)
    worker.join()  # the swap had begun: it is a few renames, let it finish
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclass(frozen=True)
class _Policy:
    trusted: tuple[signing.TrustedKey, ...]
    required: bool

    def check(self, store: Store, bundle_key: str, manifest_id: str, size: int) -> str | None:
        """Who signed the manifest (None when no trusted key did and none is required)."""
        if not self.trusted:
            return None
        signer = signing.verify(store, self.trusted, bundle_key, manifest_id, size)
        if signer is None and self.required:
            names = ", ".join(k.name for k in self.trusted)
            raise SignatureError(manifest_id, f"is not signed by a trusted key (trusted: {names})")
        if signer is None:
            log.warning("bundle %s is not signed by a trusted key; restoring it anyway", manifest_id[:12])
        return signer


def _restore(
    store: Store,
    index: Catalog,
    fp: Fingerprint,
    root: Path,
    jobs: int,
    budget: _Budget,
    pinned: str | None,
    policy: _Policy,
    fallback: str | None = None,
) -> RestoreResult:
    started = time.perf_counter()
    manifest_id, partial, miss_reason = _choose(store, index, fp, pinned, fallback)
    if manifest_id is None:
        return RestoreResult("miss", fp.bundle_key, None, root, root / envfile.NAME,
                             seconds=time.perf_counter() - started, reason=one_line(miss_reason))  # fmt: skip
    data = store.get_bytes(manifest_key(manifest_id))
    manifest = manifests.parse(data, manifest_id)
    if partial and manifest.toolchain_key != fp.toolchain_key:
        raise IntegrityError(
            "manifest", manifest_id, f"is for toolchain {manifest.toolchain_key}, not {fp.toolchain_key}"
        )
    if not partial and manifest.bundle_key != fp.bundle_key:
        raise IntegrityError("manifest", manifest_id, f"is for bundle key {manifest.bundle_key}, not {fp.bundle_key}")
    signer = policy.check(store, manifest.bundle_key, manifest_id, len(data))
    _check_layers(manifest)
    layer_names = tuple(n for n in manifest.layers if n in PARTIAL_LAYERS) if partial else manifest.layers
    entries = tuple(e for e in manifest.entries if not partial or e.path.split("/", 1)[0] in PARTIAL_LAYERS)
    _lay_out(store, root, entries, layers.for_manifest(layer_names), jobs, budget)
    reason = (
        f"kernel layers of bundle {manifest.id[:12]}, built on this toolchain for another workload" if partial else ""
    )
    return RestoreResult("partial" if partial else "hit", fp.bundle_key, manifest.id, root, root / envfile.NAME,
                         layer_names, len(entries), sum(e.size for e in entries), time.perf_counter() - started,
                         reason, signer)  # fmt: skip


def _check_layers(manifest: manifests.Manifest) -> None:
    """Every file must lie in one of the bundle's layers: nothing may land beside them in ROOT."""
    prefixes = tuple(source.subdir + "/" for source in layers.for_manifest(manifest.layers))
    for entry in manifest.entries:
        if not entry.path.startswith(prefixes):
            raise UnsafePath(entry.path, "belongs to no layer of the bundle that this kcache knows")


def _choose(store: Store, index: Catalog, fp: Fingerprint, pinned: str | None, fallback: str | None):
    """(manifest id or None, partial?, why not) for this fingerprint."""
    manifest_id = pinned or getattr(index.newest_bundle(fp.bundle_key), "id", None)
    partial = False
    if manifest_id is None and fallback == "toolchain":
        manifest_id = getattr(index.newest_for_toolchain(fp.toolchain_key), "id", None)
        partial = manifest_id is not None
    if manifest_id is None:
        return None, False, "no bundle published for this fingerprint"
    # The index's word is not enough: a yank marker in the store stops the bundle everywhere.
    if store.exists(refs.yank_key(manifest_id)):
        return None, False, f"bundle {manifest_id[:12]} is yanked"
    return manifest_id, partial, ""


def _lay_out(store: Store, root: Path, entries, sources: list[layers.Source], jobs: int, budget: _Budget) -> None:
    """Fetch and verify everything into staging, then swap the layers in (unless time ran out)."""
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=root))
    with budget.lock:
        budget.staging = staging
    try:
        _fetch_all(store, entries, staging, jobs, budget)
        with budget.lock:
            if budget.expired:
                raise fetch.Cancelled()
            budget.swapping = True
        _swap(root, staging, sources)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _fetch_all(store: Store, entries: tuple[manifests.Entry, ...], staging: Path, jobs: int, budget: _Budget) -> None:
    """Every blob into its staged path (verified), then the paths that share a blob as copies."""
    files = staging / "files"
    shared = rootdir.group_shared(staging.parent)
    # Directories once up front: per-file mkdir calls cost more than the writes on small caches.
    made: set[Path] = set()
    for directory in sorted({(files / e.path).parent for e in entries}):
        rootdir.make_dirs(staging, directory, shared, made)
    umask = _umask()

    def lay(entry: manifests.Entry, write) -> None:
        path = files / entry.path  # manifest.parse already refused absolute paths and '..'
        mode = rootdir.file_mode(entry.mode, shared)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as out:
            write(out)
        if mode & umask:  # the umask took bits the manifest asks for
            os.chmod(path, mode)

    def place(entry: manifests.Entry, frame) -> None:
        lay(entry, lambda out: unpack_frame(frame, entry.blob, entry.size, out))

    fetch.fetch_blobs(store, entries, place, jobs=jobs, cancelled=lambda: budget.expired)
    first_path: dict[str, str] = {}
    for entry in entries:
        origin = first_path.setdefault(entry.blob, entry.path)
        if origin != entry.path:  # already verified when its first path was written
            with open(files / origin, "rb") as src:
                lay(entry, lambda out, src=src: shutil.copyfileobj(src, out))


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
        rootdir.make_dirs(root, target.parent, rootdir.group_shared(root))
        if target.exists() or target.is_symlink():
            os.rename(target, retired / str(i))
        os.rename(staged, target)


def _inside(root: Path, path: Path) -> Path:
    """`path`, if no link already in ROOT (say ROOT/tmp -> /) carries it outside the root."""
    if not path.parent.resolve().is_relative_to(root.resolve()):
        raise UnsafePath(str(path.relative_to(root)), f"resolves outside {root} through a symbolic link")
    return path


def _finish(root: Path, result: RestoreResult) -> None:
    """kcache.env, then the marker: once the marker is there, the env file matches it."""
    _write_env(root, result.layers, _env_comment(result))
    _write_state(result)


def _env_comment(result: RestoreResult) -> str:
    """Fixed text, the bundle id, the reason; envfile makes the whole of it one inert line."""
    what = f"{result.status}, bundle {result.bundle_id}" if result.bundle_id else result.status
    return f"kcache restore: {what}{', ' + result.reason if result.reason else ''}"


def _write_env(root: Path, layer_names, comment: str) -> Path:
    """Create every layer directory and write kcache.env.

    No TORCH_COMPILE_CACHE_KEY_TAG: torch puts the tag into its FX graph keys, so a bundle
    published from a run without kcache.env (the plain live directories) would miss every graph
    when restored with one. The bundle key already holds every fact the tag carried (toolchain
    key), restore only lays out a bundle whose key matches, and a tag the user sets is a keyed
    fact (env.*), so the same tag is in effect on both sides.
    """
    exports = layers.all_exports(root, layer_names)
    shared = rootdir.group_shared(root)
    for source in layers.BUILTIN:
        place = _inside(root, source.restore_dir(root))
        if place.is_symlink() and not place.exists():
            place.unlink()  # a dangling link would make every run fail: replace it with a directory
        rootdir.make_dirs(root, place, shared)
    return envfile.write(root, exports, comment)


def _write_state(result: RestoreResult) -> None:
    """The restore marker: restore has finished, with what outcome (readiness and /metrics read it)."""
    write_marker(result.root, RESTORE_MARKER, {
        "status": result.status, "bundle_key": result.bundle_key, "bundle_id": result.bundle_id,
        "files": result.files, "bytes": result.bytes, "seconds": round(result.seconds, 4),
        "reason": result.reason, "layers": list(result.layers),
    })  # fmt: skip


def read_state(root: Path) -> dict | None:
    """The outcome of the last restore into `root`, or None if none finished there."""
    return read_marker(root, RESTORE_MARKER)


def _record(index: Catalog, event: Event, deadline: float | None) -> None:
    """Record the outcome, but never hold the pod up for it: the marker and env are written, and
    an index that hangs (the reason a restore timed out, say) gets a few seconds at most."""

    def run() -> None:
        try:
            index.record_event(event)
        except KcacheError as exc:  # stats are worth less than the pod's start
            log.warning("cannot record restore event: %s", one_line(exc))

    if deadline is None:
        return run()
    worker = threading.Thread(target=run, name="kcache-record", daemon=True)
    worker.start()
    worker.join(max(_RECORD_GRACE, min(_RECORD_LIMIT, deadline - time.monotonic())))
    if worker.is_alive():
        log.warning("gave up recording the restore event: the index did not answer")
