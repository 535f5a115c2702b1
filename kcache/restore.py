"""Restore: lay the bundle that matches this fingerprint into ROOT, or say why not.

    ROOT/
      kcache.env                   exports for torch, Triton, CUDA, vLLM (written on hit and miss)
      .kcache-state.json           outcome of the last restore: what `kcache ready` reads
      inductor/ triton/ cuda/ vllm/ extra/<name>/
      tmp/torchinductor_<user>/precompiled_headers/
      .kcache-staging-<pid>-<rand>/  only while a restore runs

Every blob is fetched into the staging directory and verified (size and SHA-256) before any
layer moves; then each layer is swapped in with renames. A failure or timeout before the swap
leaves ROOT as it was. Ranges of a pack that lie close together are fetched with one read.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kcache import envfile, fetch, signing
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
from kcache.packs import unpack_to
from kcache.readiness import RESTORE_MARKER, read_marker, write_marker
from kcache.records import Event
from kcache.store import Store, manifest_key

log = logging.getLogger(__name__)

STAGING_PREFIX = ".kcache-staging-"


@dataclass(frozen=True)
class RestoreResult:
    status: str  # hit | miss (| error, only in the marker written on failure)
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


class Catalog(Protocol):
    """Where restore finds the newest bundle: the SQL index, or refs in the store (kcache.refs)."""

    def newest_bundle(self, bundle_key: str): ...  # an object with .id (the manifest id), or None

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
) -> RestoreResult:
    """Restore the newest bundle for `fingerprint` (or the pinned `bundle_id`) into `root`.

    A pinned bundle must still match the fingerprint. With trusted keys, a signature that does
    not verify is refused; with `require_signature`, so is an unsigned bundle. Raises KcacheError.
    """
    if require_signature and not trusted:
        raise ConfigError("--require-signature", "on", "needs at least one --trusted-key (or KCACHE_TRUSTED_KEYS)")
    policy = _Policy(trusted, require_signature)
    started = time.perf_counter()
    root = Path(root).absolute()
    try:
        result = _within(
            timeout, lambda budget: _restore(store, index, fingerprint, root, jobs, budget, bundle_id, policy)
        )
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
            raise RestoreTimeout(timeout)
    worker.join()  # the swap had begun: it is a few renames, let it finish
    if "error" in box:
        raise box["error"]
    return box["result"]


@dataclass(frozen=True)
class _Policy:
    trusted: tuple[signing.TrustedKey, ...]
    required: bool

    def check(self, store: Store, fp: Fingerprint, manifest_id: str, size: int) -> str | None:
        """Who signed the manifest (None when no trusted key did and none is required)."""
        if not self.trusted:
            return None
        signer = signing.verify(store, self.trusted, fp.bundle_key, manifest_id, size)
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
) -> RestoreResult:
    started = time.perf_counter()
    _prepare_root(root)
    manifest_id = pinned or getattr(index.newest_bundle(fp.bundle_key), "id", None)
    if manifest_id is None:
        env_file = _write_env(root, fp, [], "miss, no bundle for this fingerprint")
        return RestoreResult("miss", fp.bundle_key, None, root, env_file, seconds=time.perf_counter() - started,
                             reason="no bundle published for this fingerprint")  # fmt: skip
    data = store.get_bytes(manifest_key(manifest_id))
    manifest = manifests.parse(data, manifest_id)
    if manifest.bundle_key != fp.bundle_key:
        raise IntegrityError("manifest", manifest_id, f"is for bundle key {manifest.bundle_key}, not {fp.bundle_key}")
    signer = policy.check(store, fp, manifest_id, len(data))
    sources = layers.for_manifest(manifest.layers)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=root))
    try:
        _fetch_all(store, manifest.entries, staging, jobs, budget)
        with budget.lock:
            if budget.expired:
                raise fetch.Cancelled()
            budget.swapping = True
        _swap(root, staging, sources)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    env_file = _write_env(root, fp, manifest.layers, f"hit, bundle {manifest.id}")
    seconds = time.perf_counter() - started
    return RestoreResult("hit", fp.bundle_key, manifest.id, root, env_file, manifest.layers,
                         len(manifest.entries), manifest.total_size, seconds, signed_by=signer)  # fmt: skip


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


def _fetch_all(store: Store, entries: tuple[manifests.Entry, ...], staging: Path, jobs: int, budget: _Budget) -> None:
    """Every blob into its staged path (verified), then the paths that share a blob as copies."""

    def place(entry: manifests.Entry, frame) -> None:
        dest = _staged(staging, entry)
        with open(dest, "xb") as out:
            unpack_to(frame, entry.blob, entry.size, out)
        os.chmod(dest, entry.mode)

    fetch.fetch_blobs(store, entries, place, jobs=jobs, cancelled=lambda: budget.expired)
    first_path = {}
    for entry in entries:
        origin = first_path.setdefault(entry.blob, entry.path)
        if origin != entry.path:  # already verified when its first path was written
            dest = _staged(staging, entry)
            shutil.copyfile(staging / origin, dest)
            os.chmod(dest, entry.mode)


def _staged(staging: Path, entry: manifests.Entry) -> Path:
    dest = staging / entry.path  # manifest.parse already refused absolute paths and '..'
    dest.parent.mkdir(parents=True, exist_ok=True)
    return dest


def _swap(root: Path, staging: Path, sources: list[layers.Source]) -> None:
    """Move each staged layer into place; the previous content goes into staging and is deleted with it."""
    retired = staging / ".retired"
    retired.mkdir()
    for i, source in enumerate(sources):
        staged = staging / source.subdir
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
        _inside(root, source.restore_dir(root)).mkdir(parents=True, exist_ok=True)
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
