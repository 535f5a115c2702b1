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
Through a node cache (kcache.store.nodecache), a pack whose copy there fails its blobs' check (a
peer on the node rewrote it after it was hashed) is dropped, and the blobs not yet staged are read
from the store itself, once, within the same budget: the node cache can only cost time.

Fail-open: everything a restore does, opening the store and the index and computing the
fingerprint included, runs inside its time budget, and whatever goes wrong, the restore that
holds ROOT's lock leaves kcache.env and an "error" marker behind, so the pod starts cold and
`kcache ready` sees that restore finished. Only a ROOT that cannot be written gets neither.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from kcache import atomic, choice, envfile, fetch, layerkeys, progress, rootdir, signing
from kcache import manifest as manifests
from kcache import sources as layers
from kcache.config import redact_text
from kcache.errors import (
    ConfigError,
    IntegrityError,
    KcacheError,
    RestoreTimeout,
    RootError,
    RootFull,
    StoreError,
    Terminated,
    UnsafePath,
)
from kcache.fingerprint import Fingerprint, is_bundle_key, is_workload_fact
from kcache.packs import CHUNK_BYTES, unpack_bytes, unpack_frame
from kcache.readiness import (
    RESTORE_MARKER,
    RESTORED_PATHS,
    WARMUP_MARKER,
    WATCH_MARKER,
    path_digest,
    read_marker,
    write_marker,
)
from kcache.records import Event
from kcache.relocate import relocate_staged
from kcache.rootdir import STAGING_PREFIX
from kcache.sources.base import torch_user
from kcache.sources.inductor import RUN_AS_VAR, torch_user_name
from kcache.store import Store
from kcache.untrusted import one_line

log = logging.getLogger(__name__)

# Bytes set aside for kcache.env and the restore marker (each a few KiB at most; see _room_for_outcome).
ENV_RESERVE = 16 * 1024
MARKER_RESERVE = 64 * 1024

# Seconds recording the outcome may take: a healthy index answers in milliseconds, and the pod
# is ready to start; at least a second even once the budget is spent.
_RECORD_LIMIT, _RECORD_GRACE = 5.0, 1.0
# Layers keyed by their own content (kernel source, graph hash): safe to share between workloads
# that run on one toolchain. vLLM's cache and user directories are keyed by the workload itself.
PARTIAL_LAYERS = ("inductor", "inductor-pch", "triton", "cuda")


@dataclass(frozen=True)
class RestoreResult:
    status: str  # hit | partial (--fallback toolchain|layers) | miss (| error, only in the marker on failure)
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
    donors: tuple[tuple[str, str], ...] = ()  # (layer, bundle id) of a --fallback layers restore
    # (bundle id, bundle key) of each bundle laid that another key built: a donor, a --fallback toolchain partial's
    donor_keys: tuple[tuple[str, str], ...] = ()
    user: str | None = None  # the user the precompiled header was laid out for (None: this process's)


@dataclass
class _Budget:
    """Shared between the caller and the worker: once expired, the worker must not swap."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    expired: bool = False
    swapping: bool = False
    staging: Path | None = None  # removed by the caller on expiry: a hung worker may never return
    deadline: float | None = None  # time.monotonic(): when the pod's budget ends


@dataclass
class _KeptLayers:
    """Under which bundle key ROOT's layers are made, once this restore has compared them with its own
    key: by the worker after opening, or by the error path when the worker never got that far."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    compared: bool = False
    key: str | None = None
    retired: Path | None = None  # where another key's layers went: deleted once the restore is done
    # Layers of another key that could not be set aside (a volume mounted at one: EBUSY), by place
    # under ROOT: left out of kcache.env, named in the marker so `publish --from ROOT` refuses them.
    kept_back: dict[str, str] = field(default_factory=dict)
    # The bundle whose files each layer that stays holds, by place under ROOT (the marker's `layers_from`):
    # a kept ROOT's next start sets aside the layers of a bundle yanked since.
    came_from: dict[str, str] = field(default_factory=dict)
    # The bundle key of each bundle in `came_from` that another key built (the marker's `bundle_keys`): a donor
    # is checked for yanks against its own key's ref, as the restore that took it checked it.
    owners: dict[str, str] = field(default_factory=dict)


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
    run_as: str | None = None,
    report: progress.Report | None = None,
    computed: Callable[[], Fingerprint | None] = lambda: None,
) -> RestoreResult:
    """Open what `open_inputs` opens, then restore the newest bundle (or the pinned `bundle_id`).

    `run_as` is the user the model will run as (torch names the precompiled header's directory for
    it); default KCACHE_RUN_AS, else the user publish recorded, else the current user.

    A pinned bundle must still match the fingerprint. With trusted keys, a signature that does
    not verify is refused; with `require_signature`, so is an unsigned bundle. With
    fallback="toolchain", a miss restores the kernel layers of the newest bundle built on the same
    toolchain (status "partial"); with fallback="layers", each reusable layer of the newest bundle
    whose layer key matches ours (kcache.layerkeys; status "partial", donors say from where).
    `report` receives the fetch's progress (kcache.progress). `computed` gives the fingerprint once
    `open_inputs` has computed it: a failure while it still opens the store or the index (the
    budget ran out on a hung index) then keeps this pod's bundle key and workload in the marker.
    Raises KcacheError, or whatever `open_inputs` raised; either
    way kcache.env and an error marker are written first, unless ROOT itself is unusable
    (RootError) or another restore held ROOT for the whole budget (RootBusy: that one writes them).
    """
    started = time.perf_counter()
    deadline = None if timeout is None else time.monotonic() + timeout
    root = Path(root).absolute()
    rootdir.prepare(root)
    with rootdir.locked(root, timeout, deadline), _room_for_outcome(root), sigterm_interrupts(), \
            rootdir.staging_removed(root, deadline):  # a killed restore's leftovers: beside this one, not before
        _forget_last_start(root)
        opened: list[Opened] = []  # filled by the worker, read here: what the error path may use
        kept = _KeptLayers()

        def work(budget: _Budget) -> RestoreResult:
            return _open_and_restore(open_inputs, opened, kept, root, jobs, budget, bundle_id, require_signature,
                                     fallback, run_as, report)  # fmt: skip

        try:
            try:
                result = _within(timeout, deadline, work)
                _finish(root, result, opened[0].fingerprint, kept)
            except OSError as exc:  # the disk, not the bundle: ENOSPC, EACCES, a read-only volume
                raise _root_error(root, exc) from exc
        except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 - any failure, a kcache bug or a signal
            # included, must leave a pod that starts
            _fail(root, opened, kept, computed, exc, time.perf_counter() - started, deadline)
            raise
        _record(opened[0].index, Event("restore", result.status, result.bundle_key, result.bundle_id,
                                       result.files, result.bytes, result.seconds, result.reason or None),
                deadline)  # fmt: skip
        _delete_retired(kept, deadline)
        return result


def _open_and_restore(open_inputs, opened: list, kept: _KeptLayers, root: Path, jobs: int, budget: _Budget,
                      pinned: str | None, require_signature: bool, fallback: str | None, run_as: str | None,
                      report: progress.Report | None) -> RestoreResult:  # fmt: skip
    if fallback not in (None, "toolchain", "layers"):
        raise ConfigError("--fallback", str(fallback), "a fallback is 'toolchain' or 'layers'")
    inputs = open_inputs()
    opened.append(inputs)
    policy = choice.Policy(inputs.trusted, require_signature)
    _compare_layers(root, inputs.fingerprint.bundle_key, kept,
                    yanked=lambda owned: _yanked(inputs.store, inputs.index, owned, policy))
    if require_signature and not inputs.trusted:
        raise ConfigError("--require-signature", "on", "needs at least one --trusted-key (or KCACHE_TRUSTED_KEYS)")
    # What earlier restores laid and this one's comparison left in place (checked for yanks just now).
    in_place = {place: bundle for place, bundle in kept.came_from.items() if place not in kept.kept_back}
    return _restore(inputs.store, inputs.index, inputs.fingerprint, root, jobs, budget, pinned, policy, fallback,
                    run_as, report, in_place)


def _compare_layers(root: Path, bundle_key: str, kept: _KeptLayers, *, wait: bool = True,
                    yanked: Callable[[Mapping[str, str]], set[str]] | None = None) -> None:  # fmt: skip
    """Empty layers made under another bundle key, or holding a bundle that `yanked` names
    (`_set_aside_other_keys_layers`), once per restore: `kept` then says they are `bundle_key`'s.
    Without `wait`, nothing is done while the worker compares.
    What was set aside is deleted by `_delete_retired` once the restore is done: a hundred thousand
    files on a slow volume must not take the budget the bundle's fetch needs."""
    if not kept.lock.acquire(blocking=wait):
        return
    try:
        if not kept.compared:
            kept.retired, kept.kept_back, kept.came_from, kept.owners = _set_aside_other_keys_layers(
                root, bundle_key, yanked)
            kept.compared, kept.key = True, bundle_key
    finally:
        kept.lock.release()


def _delete_retired(kept: _KeptLayers, deadline: float | None) -> None:
    """What `_compare_layers` set aside, as much of it as the budget allows (the next restore deletes the
    rest, and all of it while a worker that outlived the budget still holds `kept`)."""
    if not kept.lock.acquire(blocking=False):
        return
    try:
        retired, kept.retired = kept.retired, None
    finally:
        kept.lock.release()
    if retired is not None:
        rootdir.delete_until(retired, deadline)


def _yanked(store: Store, index: Catalog, owned: Mapping[str, str], policy: choice.Policy) -> set[str]:
    """Which of the bundles `owned` names (bundle id: the key that built it) are yanked: `choice.yanked_among`
    for each key, each against its own ref; none of a key whose store or index cannot say (the restore meets
    that again)."""
    by_key: dict[str, set[str]] = {}
    for bundle_id, bundle_key in owned.items():
        by_key.setdefault(bundle_key, set()).add(bundle_id)
    bad: set[str] = set()
    for bundle_key, ids in sorted(by_key.items()):
        try:
            bad |= choice.yanked_among(store, index, bundle_key, ids, policy)
        except KcacheError as exc:
            log.warning("cannot tell whether the bundles in the kept layers were yanked: %s", one_line(exc))
    return bad


def _set_aside_other_keys_layers(root: Path, bundle_key: str,
                                 yanked: Callable[[Mapping[str, str]], set[str]] | None = None
                                 ) -> tuple[Path | None, dict[str, str], dict[str, str], dict[str, str]]:  # fmt: skip
    """Empty layers when the last restore into ROOT (its marker says) was under another bundle key, and
    layers that hold a bundle yanked since (`yanked` says which of the ids it is given are).

    A kept ROOT (a hostPath, a volume that moves with the pod) holds what was restored or compiled
    under the last start's key: on another kind of node, or with another image, its kernels are for
    that one (torch's own keys do not see -march=native), and a miss left them in place, exported by
    kcache.env and published by `publish --from ROOT` under the new key. They are moved into a
    staging directory, returned to be deleted (within the budget, or by the next restore), with the
    layers that could not be moved and the key each was made under, the bundle each layer left in
    place holds, and the key of each such bundle another key built. A ROOT without a marker names no
    key, and is left as it is.

    A yanked bundle's layers go too: a miss keeps the key's layers (the pod's own compiles), and a kept
    ROOT whose last start restored the bundle had its kernels loaded again on every restart after the
    yank. The pod's compiles beside them go with them: they were made on top of the yanked kernels. A
    bundle another key built (a donor) is looked up under that key (`bundle_keys`): this key's ref knows
    nothing of it, and often there is none (a fallback's usual case)."""
    previous = read_state(root) or {}
    made_under = _layers_key(previous)
    kept_back = _kept_back(previous)
    came_from = _came_from(previous)
    owners = _owners(previous)
    if made_under is None:
        return None, {}, {}, {}
    other_key = made_under != bundle_key or not set(kept_back.values()) <= {bundle_key}
    users: set[str | None] = {None}
    try:  # the last restore's model user, whose header directory that restore laid out
        users.add(torch_user_name(previous["run_as"]) if isinstance(previous.get("run_as"), str) else None)
    except ConfigError:  # ROOT is written by every container of the pod: a name that is none is skipped
        pass
    users |= _header_users(root)
    places = []
    for place in sorted({source.restore_dir(root) for user in users for source in layers.builtin(user)}
                        | {root / "extra"}):  # fmt: skip
        rel = place.relative_to(root).as_posix()
        under = {p for p in came_from if p == rel or p.startswith(rel + "/")}  # extra/<name> lie under extra
        places.append((place, rel, kept_back.get(rel, made_under), under))
    # Only what would stay is looked up for yanks (under another key too: a layer of a yanked bundle that
    # could not be set aside is kept back under this key, and must not come back when a start under this
    # key follows one under another); another key's layers go first, whatever bundle they hold: a store
    # or an index that hangs on the look-up must not keep them past the budget.
    staying = {came_from[p]: owners.get(came_from[p], bundle_key)
               for _place, _rel, key, under in places if key == bundle_key for p in under}  # fmt: skip
    if not other_key:
        bad = yanked(staying) if yanked is not None and staying else set()
        if not bad:
            return None, {}, came_from, owners
    retired = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=root))
    stuck: dict[str, str] = {}

    def set_aside(i: int, place: Path, rel: str, key: str, under: set[str]) -> None:
        try:
            if os.path.lexists(_inside(root, place)):
                os.rename(place, retired / str(i))  # a link is moved, never followed
            for gone in under:
                del came_from[gone]
        except (UnsafePath, OSError) as exc:
            stuck[rel] = key
            log.warning("cannot set aside %s, made under bundle key %s: %s; kcache.env leaves it out",
                        place, one_line(key[:80]), one_line(exc))  # from a file every container may write

    for i, (place, rel, key, under) in enumerate(places):
        if key != bundle_key:
            set_aside(i, place, rel, key, under)
    if other_key:
        bad = yanked(staying) if yanked is not None and staying else set()
    spoilt = {place for place, bundle in came_from.items() if bundle in bad}
    for i, (place, rel, key, under) in enumerate(places):
        if key == bundle_key and under & spoilt:
            set_aside(i, place, rel, key, under)
    if bad:
        log.warning("the layers in %s hold bundle %s, yanked since: starting from empty layers", root,
                    ", ".join(sorted(i[:12] for i in bad)))  # fmt: skip
    else:
        log.info("the layers in %s were made under bundle key %s, not %s: starting from empty layers",
                 root, one_line(made_under[:80]), bundle_key)  # fmt: skip
    if other_key:  # what stays is this key's from now on: the layers kept back, and this key's left in place
        came_from = {place: bundle for place, bundle in came_from.items()
                     if any(place in under for _place, _rel, _key, under in places)}  # fmt: skip
    return retired, stuck, came_from, owners


def _header_users(root: Path) -> set[str]:
    """Every user whose precompiled header directory ROOT/tmp holds (at most _MAX_PLACES of them). Not only
    this process's and the last start's: a start as alice, one as bob, then one under another key as alice
    left alice's header of the first key in place, for torch running as her to load."""
    tmp = root / "tmp"
    if tmp.is_symlink():  # what a link leads to is not ROOT's; its header place is kept back as before
        return set()
    found: set[str] = set()
    try:
        with os.scandir(tmp) as entries:
            for entry in entries:
                user = entry.name.removeprefix("torchinductor_")
                if user != entry.name and layers.is_place(f"tmp/{entry.name}/precompiled_headers"):
                    found.add(user)
                    if len(found) >= _MAX_PLACES:
                        break
    except OSError:  # none, or not a directory
        pass
    return found


def _fail(root: Path, opened: list[Opened], kept: _KeptLayers, computed: Callable[[], Fingerprint | None],
          exc: Exception, seconds: float, deadline: float | None) -> None:  # fmt: skip
    """The pod starts cold, but with the right env and a marker that says why."""
    # Redacted: a driver's or a bug's message may quote a URL with its password, and every
    # container of the pod reads ROOT.
    if isinstance(exc, KeyboardInterrupt):
        reason = str(exc) or "interrupted"
    else:
        reason = one_line(redact_text(str(exc) if isinstance(exc, KcacheError) else f"{type(exc).__name__}: {exc}"))
    fp = opened[0].fingerprint if opened else computed()
    bundle_key = fp.bundle_key if fp is not None else None
    if fp is not None:  # opening the store or the index failed after the fingerprint: the layers were never compared
        try:  # not while a worker that outlived the budget compares them: then they are the last key's
            _compare_layers(root, fp.bundle_key, kept, wait=False)
        except OSError as set_aside_error:
            log.warning("cannot set aside the layers in %s: %s", root, set_aside_error.strerror or set_aside_error)
    # The key ROOT's layers were made under: this restore's once it compared them, else (the fingerprint
    # failed, or the layers could not be set aside) the last one's, carried over for the next start.
    if kept.compared:
        layers_key, kept_back, came_from, owners = kept.key, kept.kept_back, kept.came_from, kept.owners
    else:
        last = read_state(root) or {}
        layers_key, kept_back, came_from, owners = _layers_key(last), _kept_back(last), _came_from(last), _owners(last)
    failed = RestoreResult("error", bundle_key, None, root, root / envfile.NAME, seconds=seconds, reason=reason)
    # Each on its own (the marker still goes where the env file cannot); a layer whose place a link
    # carries out of ROOT, or that a file blocks (ROOT/tmp), is left out of the env file, not the whole
    # file. A directory planted at either name is moved aside, and deleted only while the budget lasts.
    for what, write in (("kcache.env", lambda: _write_env(root, (), _env_comment(failed), _safe_user(failed.user),
                                                          deadline, leave_out_unsafe=True, kept_back=kept_back)),
                        ("the restore marker", lambda: _write_state(failed, fp, layers_key, kept_back, came_from,
                                                                    owners, deadline))):  # fmt: skip
        try:
            write()
        except (OSError, KcacheError) as write_error:
            log.warning("cannot write %s in %s: %s", what, root, one_line(write_error))
    if opened:
        _record(opened[0].index, Event("restore", "error", bundle_key, None, 0, 0, seconds, reason), deadline)
    _delete_retired(kept, deadline)


@contextmanager
def sigterm_interrupts():
    """SIGTERM raises Terminated in the main thread while the restore runs, so its error path still
    writes kcache.env and the marker (Python's default for SIGTERM ends the process on the spot).
    Only where nobody installed a handler of their own, and only from the main thread."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return

    def interrupt(signum, _frame):
        raise Terminated(signum)

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _forget_last_start(root: Path) -> None:
    """A restore begins a pod's start: the warmup and watch markers of the last one (an init
    container run again on a kept volume) would make the new server ready before it loaded."""
    for name in (WARMUP_MARKER, WATCH_MARKER, RESTORED_PATHS):
        rootdir.clear(root / name)  # a directory too: warmup could never write its marker over one


@contextmanager
def _room_for_outcome(root: Path):
    """Room set aside for kcache.env and the marker while the bundle is laid out.

    The bundle may take the last free bytes of the volume; then neither the final files nor the
    error path's could be written, and a pod without kcache.env (its command sources it) or
    without a marker (readiness waits for one) would never start. kcache.atomic writes them into
    the reserved blocks when the volume is full.
    """
    targets = (root / envfile.NAME, root / RESTORE_MARKER)
    for target, size in zip(targets, (ENV_RESERVE, MARKER_RESERVE)):
        try:
            atomic.reserve(target, size)
        except OSError as exc:  # already full: the restore itself will say so
            log.warning("cannot set room aside in %s: %s", root, exc.strerror or exc)
    try:
        yield
    finally:
        for target in targets:
            try:
                atomic.release(target)
            except OSError as exc:  # ENAMETOOLONG under a ROOT near PATH_MAX: the failure already raised says why
                log.warning("cannot give back the room set aside in %s: %s", root, exc.strerror or exc)


def _safe_user(user: str | None) -> str:
    """The user whose header directory the error path lays out: a bad KCACHE_RUN_AS, which may be
    what failed, must not also cost the pod its kcache.env (that user is then ours)."""
    if user:
        return user
    try:
        return layers.run_as_user(None, {})
    except ConfigError:
        return torch_user()


def _root_error(root: Path, exc: OSError) -> RootError:
    if exc.errno == errno.ENOSPC:
        return RootFull(str(root), "no space left on device for the bundle")
    if exc.errno == errno.EDQUOT:
        return RootFull(str(root), "disk quota exceeded by the bundle")
    if exc.errno == errno.EFBIG:  # RLIMIT_FSIZE (Python ignores its SIGXFSZ), or the file system's own cap
        return RootFull(str(root), "a file of the bundle is over the file size limit (ulimit -f) or what the "
                                   "file system allows")  # fmt: skip
    return RootError(str(root), f"cannot write {exc.filename or root}: {exc.strerror or exc}")


def _within(timeout: float | None, deadline: float | None, work) -> RestoreResult:
    budget = _Budget(deadline=deadline)
    # A worker even without a deadline (prebake's restore): the main thread is where SIGTERM's
    # exception lands, and one landing between the swap's renames left ROOT half swapped.
    box: dict = {}
    # An event rather than Thread.join: a join that a signal's exception interrupts can leave the
    # thread marked stopped while it runs (CPython 3.11), and later joins then return at once.
    done = threading.Event()

    def run() -> None:
        try:
            box["result"] = work(budget)
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc
        finally:
            done.set()

    def give_up() -> bool:
        """Stop the worker before its swap; False when the swap has begun."""
        with budget.lock:
            if done.is_set() or budget.swapping:
                return False
            budget.expired = True
            if budget.staging is not None:  # the next restore deletes what is left when we exit
                rootdir.delete_in_background(budget.staging)
            return True

    worker = threading.Thread(target=run, name="kcache-restore", daemon=True)
    try:
        worker.start()  # inside: start() waits for the thread, which may already be reading when a signal lands
        done.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except BaseException:  # SIGTERM (Terminated): the worker must not swap the bundle in after it
        if give_up():
            raise
    else:
        if give_up():
            raise RestoreTimeout(timeout or 0.0)
    done.wait()  # the swap had begun (or the work ended): it is a few renames, let it finish
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
    run_as: str | None = None,
    report: progress.Report | None = None,
    in_place: Mapping[str, str] = {},
) -> RestoreResult:
    """`in_place`: the bundle each layer place of ROOT holds from an earlier restore (checked for yanks)."""
    started = time.perf_counter()
    if fp.mismatches:  # the facts file (or a --fact) describes another machine: its bundle would be a wrong hit
        chosen = fp.mismatch_reason()
    else:
        chosen = choice.pick(store, index, fp, pinned, fallback, policy)
    if isinstance(chosen, str) and fallback == "layers" and not pinned and not fp.mismatches:
        donors = _donors(store, index, fp, policy)
        if donors:
            pch = next((d.manifest.layer_info for d in donors if d.layer == "inductor-pch"), {})
            own = _compiled_here(root, fp.bundle_key, [d.layer for d in donors], layers.run_as_user(run_as, pch))
            donors = [d for d in donors if d.layer not in own]
            if donors:
                return _from_layers(store, fp, root, jobs, budget, donors, run_as, started, report, in_place)
            chosen = f"{one_line(chosen)}; ROOT keeps the layers it compiled under this key"
    if not isinstance(chosen, str) and chosen.partial:
        manifest, signer, _size = choice.read_manifest(store, chosen, fp, policy)
        user = layers.run_as_user(run_as, manifest.layer_info)
        own = _compiled_here(root, fp.bundle_key, PARTIAL_LAYERS, user)
        if own and set(PARTIAL_LAYERS) & set(manifest.layers) <= own:
            chosen = "no bundle for this key; ROOT keeps the layers it compiled under it"
    else:
        own = set()
    if isinstance(chosen, str):
        # The user named (--run-as, KCACHE_RUN_AS) for whom TMPDIR is laid out; else nobody: the
        # restoring user of an init container says nothing of the model's (the marker's run_as).
        named = run_as or os.environ.get(RUN_AS_VAR)
        return RestoreResult("miss", fp.bundle_key, None, root, root / envfile.NAME,
                             seconds=time.perf_counter() - started, reason=one_line(chosen),
                             user=layers.run_as_user(run_as, {}) if named else None)  # fmt: skip
    partial = chosen.partial
    if not partial:
        manifest, signer, _size = choice.read_manifest(store, chosen, fp, policy)
    _check_layers(manifest)
    taken = tuple(n for n in PARTIAL_LAYERS if n not in own)
    layer_names = tuple(n for n in manifest.layers if n in taken) if partial else manifest.layers
    entries = tuple(e for e in manifest.entries if not partial or e.path.split("/", 1)[0] in taken)
    user = layers.run_as_user(run_as, manifest.layer_info)
    there = _in_place(root, manifest, layer_names, user, in_place) if partial else set()  # as for donors
    fetched = tuple(e for e in entries if e.path.split("/", 1)[0] not in there)
    if fetched or not there:
        _lay_out(store, root, fetched, layers.for_manifest([n for n in layer_names if n not in there], user), jobs,
                 budget, report, manifest.chunks)  # fmt: skip
    if there:
        _record_laid(root, entries)
    reason = (
        f"kernel layers of bundle {manifest.id[:12]}, built on this toolchain for another workload" if partial else ""
    ) + (f" ({', '.join(sorted(there))} in place)" if there else "")
    return RestoreResult("partial" if partial else "hit", fp.bundle_key, manifest.id, root, root / envfile.NAME,
                         layer_names, len(fetched), sum(e.size for e in fetched), time.perf_counter() - started,
                         reason, signer, user=user,
                         donor_keys=((manifest.id, manifest.bundle_key),) if partial else ())  # fmt: skip


def _compiled_here(root: Path, bundle_key: str, names: Iterable[str], user: str) -> set[str]:
    """The layers among `names` whose place in ROOT holds files compiled there under `bundle_key` (the
    last restore into ROOT says its layers are this key's, names no bundle that laid that place down
    (`layers_from`, kept through misses and errors: that bundle may be yanked since), and did not keep
    its place back): a kept ROOT's own compiles for this very workload. A partial restore leaves them
    be: another workload's layer swapped in over them made the pod compile again what it had compiled
    on its last start."""
    state = read_state(root) or {}
    if _layers_key(state) != bundle_key:
        return set()
    not_ours = _kept_back(state).keys() | _came_from(state).keys()
    own = set()
    for source in layers.for_manifest(names, user):
        place = source.restore_dir(root)
        if place.relative_to(root).as_posix() in not_ours or place.is_symlink():
            continue
        if next(source.walk(place), None) is not None:
            own.add(source.name)
    if own:
        log.info("ROOT keeps layer %s, compiled under this bundle key: not taken from another bundle",
                 ", ".join(sorted(own)))  # fmt: skip
    return own


def _donors(store: Store, index: Catalog, fp: Fingerprint, policy: choice.Policy) -> list[layerkeys.Donor]:
    """For each reusable layer, the newest bundle with our layer key that the trust policy accepts.

    Each donor's manifest is read once, however many layers it gives, and all of them together
    within the manifest cap: one restore holds no more than one manifest's worth, whoever donates.
    """
    donors, read = [], {}
    left = policy.max_manifest_bytes
    for layer in layerkeys.FACTS:
        found = layerkeys.holder(store, layer, fp.facts)
        if found is None:
            continue
        try:
            chosen = choice.newest_of(store, index, found.bundle_key, policy)
            if isinstance(chosen, str):
                log.warning("layer %s: no bundle of key %s to take it from: %s", layer, found.bundle_key, chosen)
                continue
            manifest = read.get(chosen.manifest_id)
            if manifest is None:
                manifest, _signer, size = choice.read_manifest(store, chosen, fp, policy, cap=left)
                read[manifest.id], left = manifest, left - size
            refused = layerkeys.refusal(layer, found.key, manifest)
            if refused:
                log.warning("layer %s: %s; not used", layer, refused)
                continue
            _check_layers(manifest)
        except KcacheError as exc:  # one untrusted or unreadable donor costs its layer, not the restore
            log.warning("layer %s: not taken from bundle key %s: %s", layer, found.bundle_key, exc)
            continue
        donors.append(layerkeys.Donor(layer, found.key, manifest))
    return donors


def _from_layers(store: Store, fp: Fingerprint, root: Path, jobs: int, budget: _Budget,
                 donors: list[layerkeys.Donor], run_as: str | None, started: float,
                 report: progress.Report | None = None, in_place: Mapping[str, str] = {}) -> RestoreResult:  # fmt: skip
    """Lay out each donor's layer: a partial restore assembled layer by layer (--fallback layers).

    A layer whose place already holds that very donor (`in_place`: an earlier start laid it, and this
    one found it unyanked) is kept as it is, with what the pod compiled on top of it: fetched and swapped
    in again, it cost a kept ROOT the fetch and those compiles on every start. Only while every file of the
    donor's layer is still there: a cache cleared by hand, or a marker a container wrote wrong, is laid again."""
    pch = next((d.manifest.layer_info for d in donors if d.layer == "inductor-pch"), {})
    user = layers.run_as_user(run_as, pch)
    entries, names, kept, fetched = [], [], [], []
    for donor in donors:
        prefix = layers.for_manifest([donor.layer])[0].subdir + "/"
        mine = [e for e in donor.manifest.entries if e.path.startswith(prefix)]
        if _in_place(root, donor.manifest, [donor.layer], user, in_place):
            kept += mine
        else:
            entries += mine
            fetched.append(donor.layer)
        names.append(donor.layer)
    if entries:
        chunks = _agreed_chunks(d.manifest for d in donors if d.layer in fetched)
        _lay_out(store, root, tuple(entries), layers.for_manifest(fetched, user), jobs, budget, report, chunks)
    if kept:
        _record_laid(root, kept + entries)
    origin = ", ".join(f"{d.layer} from {d.manifest.id[:12]}{'' if d.layer in fetched else ' (in place)'}"
                       for d in donors)  # fmt: skip
    return RestoreResult("partial", fp.bundle_key, None, root, root / envfile.NAME, tuple(names), len(entries),
                         sum(e.size for e in entries), time.perf_counter() - started,
                         one_line(f"layers whose own keys match, from other bundles: {origin}"),
                         donors=tuple((d.layer, d.manifest.id) for d in donors), user=user,
                         donor_keys=tuple({d.manifest.id: d.manifest.bundle_key for d in donors}.items()))  # fmt: skip


def _in_place(root: Path, manifest: manifests.Manifest, names: Iterable[str], user: str,
              in_place: Mapping[str, str]) -> set[str]:  # fmt: skip
    """The layers among `names` whose place in ROOT holds `manifest`'s layer from an earlier start
    (`in_place`, by place: found unyanked by this start) with each of its files still there, a file
    (not its content: relocation rewrote some, and the pod's own containers, who write ROOT, may have).
    Junk the bundle holds is not asked for: restore never lays it down (`_taken`)."""
    there = set()
    for source in layers.for_manifest(names, user):
        place = source.restore_dir(root)
        if in_place.get(place.relative_to(root).as_posix()) != manifest.id or place.is_symlink():
            continue
        prefix = source.subdir + "/"
        rels = (e.path[len(prefix):] for e in manifest.entries if e.path.startswith(prefix))
        if all(_is_file(place / rel) for rel in rels if source.takes(rel)):
            there.add(source.name)
    return there


def _is_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _agreed_chunks(donated: Iterable[manifests.Manifest]) -> dict[str, tuple[str, ...]]:
    """The chunk digests of every donor's blobs; a blob whose donors disagree on them gets none, and
    is verified whole against its id (one of them is wrong, and the content decides which)."""
    agreed: dict[str, tuple[str, ...]] = {}
    disputed: set[str] = set()
    for manifest in donated:
        for blob, digests in manifest.chunks.items():
            if agreed.setdefault(blob, digests) != digests:
                disputed.add(blob)
    return {blob: digests for blob, digests in agreed.items() if blob not in disputed}


def _check_layers(manifest: manifests.Manifest) -> None:
    """Every file must lie in one of the bundle's layers: nothing may land beside them in ROOT."""
    prefixes = tuple(source.subdir + "/" for source in layers.for_manifest(manifest.layers))
    for entry in manifest.entries:
        if not entry.path.startswith(prefixes):
            raise UnsafePath(entry.path, "belongs to no layer of the bundle that this kcache knows")


def _record_laid(root: Path, entries) -> None:
    """ROOT/.kcache-restored: which paths this restore laid down (kcache.watch reads it). Not worth
    a cold start: without it watch goes by the files' times alone, and may publish restored files again."""
    try:
        atomic.write_text(root / RESTORED_PATHS, "".join(f"{path_digest(e.path)}\n" for e in entries))
    except OSError as exc:
        log.warning("cannot record the restored paths in %s: %s", root, exc.strerror or exc)


def _lay_out(store: Store, root: Path, entries, sources: list[layers.Source], jobs: int, budget: _Budget,
             report: progress.Report | None = None,
             chunks: Mapping[str, tuple[str, ...]] | None = None) -> None:  # fmt: skip
    """Fetch and verify everything into staging, then swap the layers in (unless time ran out) and
    record what was laid down; `chunks` are the manifest's chunk digests (large blobs are then
    verified part by part)."""
    entries = _taken(entries, sources)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{os.getpid()}-", dir=root))
    with budget.lock:
        budget.staging = staging
    try:
        with progress.Meter("restoring", files=len(entries), bytes=sum(e.size for e in entries),
                            report=report) as meter:  # fmt: skip
            _fetch_all(store, entries, staging, jobs, budget, meter, chunks or {})
        relocate_staged(staging / "files", root, (e.path for e in entries), sources)
        with budget.lock:
            if budget.expired:
                raise fetch.Cancelled()
            budget.swapping = True
        _swap(root, staging, sources)
        _record_laid(root, entries)
    finally:  # the previous layers are in staging now: as much of them as the budget allows
        rootdir.delete_until(staging, budget.deadline)


def _taken(entries, sources: list[layers.Source]) -> tuple:
    """The entries a publish would take from their layer: no junk. A lock file is left out above all:
    torch's FileBaton waits without limit for <build dir>/lock to go, so one laid down (a bundle of an
    older or careless publisher) kept every pod of the bundle from loading the extension. Only what
    this restore lays is judged; a lock in a layer kept in ROOT may be a live build's (see design.md)."""
    prefixes = [(source.subdir + "/", source) for source in sources]
    kept, left = [], []
    for entry in entries:
        source = next((s for prefix, s in prefixes if entry.path.startswith(prefix)), None)
        if source is None or source.takes(entry.path[len(source.subdir) + 1 :]):
            kept.append(entry)
        else:
            left.append(entry.path)
    if left:
        log.warning("not laying down %d file(s) no publish takes (lock files, temporaries), e.g. %s", len(left),
                    one_line(left[0], 200))  # fmt: skip
    return tuple(kept)


_FUTURE_SKEW_NS = 24 * 3600 * 10**9  # a publisher's clock further ahead than this is no clock


def _fetch_all(store: Store, entries: tuple[manifests.Entry, ...], staging: Path, jobs: int, budget: _Budget,
               meter: progress.Meter, chunks: Mapping[str, tuple[str, ...]]) -> None:  # fmt: skip
    """Every blob into its staged path (verified), then the paths that share a blob as copies.
    When a node cache's copy of a pack fails, what is not yet staged is read from its store (see
    `_past_node_cache`)."""
    files = staging / "files"
    shared = rootdir.group_shared(staging.parent)
    # Directories once up front: per-file mkdir calls cost more than the writes on small caches.
    rootdir.make_tree(staging, ("/".join(("files", *e.path.split("/")[:-1])) for e in entries), shared)
    umask = _umask()
    # A publisher whose clock ran ahead stamped times in the future: torch's shortcuts trust only
    # files not newer than the restore marker, written after these. The bundle's times move back
    # together, so that each file keeps its order (ninja: an output newer than its inputs).
    # A time past any clock's skew (a day ahead) says nothing: that file gets the restore's time,
    # and no other moves for it.
    now = time.time_ns()
    believable = (e.mtime_ns for e in entries if e.mtime_ns and e.mtime_ns <= now + _FUTURE_SKEW_NS)
    shift = max(0, max(believable, default=0) - now)
    done: set[str] = set()  # blobs verified and staged: a retry leaves them be
    failed: set[str] = set()  # packs whose read or content failed (fetch_blobs says)

    def create(entry: manifests.Entry):
        path = files / entry.path  # manifest.parse already refused absolute paths and '..'
        mode = rootdir.file_mode(entry.mode, shared)
        return open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb")

    def finish(entry: manifests.Entry, fd: int | None = None) -> None:
        """After the last write of a verified file: through `fd` while it is open, else by path once closed."""
        where = files / entry.path if fd is None else fd
        mode = rootdir.file_mode(entry.mode, shared)
        if mode & umask:  # the umask took bits the manifest asks for
            os.chmod(where, mode)
        if entry.mtime_ns:  # builders (ninja) judge "up to date" by mtime; set after the last write
            when = max(1, entry.mtime_ns - shift) if entry.mtime_ns <= now + _FUTURE_SKEW_NS else now
            os.utime(where, ns=(when, when))

    def lay(entry: manifests.Entry, write) -> None:
        with create(entry) as out:
            write(out)
        finish(entry)

    def place(entry: manifests.Entry, frame) -> None:
        if not (isinstance(frame, bytes) and entry.size <= CHUNK_BYTES):
            lay(entry, lambda out: unpack_frame(frame, entry.blob, entry.size, out))
            done.add(entry.blob)
            return
        # A small blob (most of them): verified in memory, then written without a file object.
        data = memoryview(unpack_bytes(frame, entry.blob, entry.size))
        fd = os.open(files / entry.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, rootdir.file_mode(entry.mode, shared))
        try:
            while data:
                data = data[os.write(fd, data) :]
            finish(entry, fd)  # through the descriptor: no second walk down the file's path
        finally:
            os.close(fd)
        done.add(entry.blob)

    def closed(entry: manifests.Entry) -> None:  # a split blob, verified and closed
        finish(entry)
        done.add(entry.blob)

    options = dict(jobs=jobs, cancelled=lambda: budget.expired, open_blob=create, closed=closed, meter=meter,
                   digests=chunks)  # fmt: skip
    try:
        fetch.fetch_blobs(store, entries, place, failed=failed.add, **options)
    except (IntegrityError, StoreError) as exc:
        direct = _past_node_cache(store, exc, failed)
        if direct is None:
            raise
        left = [e for e in entries if e.blob not in done]
        for entry in left:  # a blob cut off part-way: created, never verified
            (files / entry.path).unlink(missing_ok=True)
        fetch.fetch_blobs(direct, left, place, **options)
    first_path: dict[str, str] = {}
    for entry in entries:
        origin = first_path.setdefault(entry.blob, entry.path)
        if origin != entry.path:  # already verified when its first path was written
            with open(files / origin, "rb") as src:
                lay(entry, lambda out, src=src: shutil.copyfileobj(src, out))
            meter.add(files=1, bytes=entry.size)


def _past_node_cache(store: Store, exc: KcacheError, failed: set[str]) -> Store | None:
    """The store behind a node cache whose copy of a pack failed: what is left is read from it. None
    when the failure is the store's own (its StoreError, or bad bytes in a pack it served itself).

    The node cache hashes a copy when it opens it; a peer on the node can rewrite the file after
    that, and only the blobs' own SHA-256 sees it. (Truncation and read errors it notices itself,
    and the reader resumes from the store.) The retry reads the store directly, not through the
    node cache: one that goes bad again must not fail the restore a second time."""
    # Loaded only for a restore through a node cache (there, the store already loaded it): ~4 ms of
    # every other restore's start, which a pod pays before its model loads.
    nodecache = sys.modules.get("kcache.store.nodecache")
    if nodecache is None or not isinstance(store, nodecache.NodeCacheStore):
        return None
    if isinstance(exc, StoreError) and exc.url != str(store.directory):
        return None
    dropped = store.drop(failed)
    if not dropped:
        return None
    log.warning("node cache %s: its copy of pack %s failed (%s); reading what is left from the store alone",
                store.directory, ", ".join(p[:12] for p in dropped), one_line(exc))  # fmt: skip
    return store.inner


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
    # A rename that fails part-way (EXDEV from a mount on a layer, EACCES on another user's
    # directory) puts every layer back: ROOT never holds some new layers beside the old rest.
    retired = staging / "retired"
    retired.mkdir()
    swapped: list[tuple[Path, Path, Path | None]] = []  # (target, staged, retired) in swap order
    try:
        for i, source in enumerate(sources):
            staged = staging / "files" / source.subdir
            if not staged.is_dir():
                continue
            target = _inside(root, source.restore_dir(root))
            rootdir.make_dirs(root, target.parent, rootdir.group_shared(root))
            old = None
            if target.exists() or target.is_symlink():
                old = retired / str(i)
                os.rename(target, old)
            swapped.append((target, staged, old))
            os.rename(staged, target)
    except Exception:  # an OSError, or a layer whose place a link carries out of ROOT (UnsafePath)
        _unswap(swapped)
        raise


def _unswap(swapped: list[tuple[Path, Path, Path | None]]) -> None:
    """Each layer back as it was before `_swap`, newest first; what cannot be moved back is logged."""
    for target, staged, old in reversed(swapped):
        try:
            if not staged.exists() and (target.exists() or target.is_symlink()):
                os.rename(target, staged)
            if old is not None:
                os.rename(old, target)
        except OSError as exc:
            log.warning("cannot put %s back as it was: %s", target, exc.strerror or exc)


def _inside(root: Path, path: Path) -> Path:
    """`path`, if no link already in ROOT (say ROOT/tmp -> /) carries it outside the root."""
    if not path.parent.resolve().is_relative_to(root.resolve()):
        raise UnsafePath(str(path.relative_to(root)), f"resolves outside {root} through a symbolic link")
    return path


def _finish(root: Path, result: RestoreResult, fp: Fingerprint, kept: _KeptLayers) -> None:
    """kcache.env, then the marker: once the marker is there, the env file matches it."""
    donors = dict(result.donors)
    laid = {source.restore_dir(root).relative_to(root).as_posix(): donors.get(source.name, result.bundle_id)
            for source in layers.for_manifest(result.layers, result.user)}  # fmt: skip
    kept_back = {place: key for place, key in kept.kept_back.items() if place not in laid}  # the swap replaced those
    came_from = {**kept.came_from, **{place: bundle for place, bundle in laid.items() if bundle}}
    _write_env(root, result.layers, _env_comment(result), result.user, kept_back=kept_back)
    _write_state(result, fp, kept.key, kept_back, came_from, {**kept.owners, **dict(result.donor_keys)})


def _env_comment(result: RestoreResult) -> str:
    """Fixed text, the bundle id, the reason; envfile makes the whole of it one inert line."""
    what = f"{result.status}, bundle {result.bundle_id}" if result.bundle_id else result.status
    return f"kcache restore: {what}{', ' + result.reason if result.reason else ''}"


def _write_env(root: Path, layer_names, comment: str, run_as: str | None = None, deadline: float | None = None, *,
               leave_out_unsafe: bool = False, kept_back: Mapping[str, str] = {}) -> Path:  # fmt: skip
    """Create every layer directory and write kcache.env, without the variables of a layer `kept_back`
    holds (another key's files that could not be set aside: torch must not load them).

    A layer whose place a link in ROOT carries outside (ROOT/tmp -> /dev/shm) is UnsafePath, one whose
    directory cannot be made (a file or a FIFO at ROOT/tmp) an OSError; with `leave_out_unsafe` (the
    error path) such a layer is skipped and its variables left out instead, so that a pod whose
    command sources kcache.env still starts, cold.

    No TORCH_COMPILE_CACHE_KEY_TAG: torch puts the tag into its FX graph keys, so a bundle
    published from a run without kcache.env (the plain live directories) would miss every graph
    when restored with one. The bundle key already holds every fact the tag carried (toolchain
    key), restore only lays out a bundle whose key matches, and a tag the user sets is a keyed
    fact (env.*), so the same tag is in effect on both sides.
    """
    exports = layers.all_exports(root, layer_names)
    shared = rootdir.group_shared(root)
    for source in layers.builtin(run_as):
        if source.restore_dir(root).relative_to(root).as_posix() in kept_back:
            for name in source.exports(root):
                exports.pop(name, None)
            continue
        try:
            place = _inside(root, source.restore_dir(root))
            if place.is_symlink() and not place.exists():
                place.unlink()  # a dangling link would make every run fail: replace it with a directory
            rootdir.make_dirs(root, place, shared)
        except (UnsafePath, OSError) as exc:
            if not leave_out_unsafe:
                raise
            why = one_line(exc) if isinstance(exc, UnsafePath) else f"{exc.filename}: {exc.strerror or exc}"
            log.warning("kcache.env leaves out %s: %s", ", ".join(source.exports(root)), why)
            for name in source.exports(root):
                exports.pop(name, None)
    rootdir.clear(root / envfile.NAME, stat.S_ISDIR, deadline)  # a file there the rename replaces
    return envfile.write(root, exports, comment)


def _write_state(result: RestoreResult, fp: Fingerprint | None, layers_key: str | None,
                 kept_back: Mapping[str, str], came_from: Mapping[str, str], owners: Mapping[str, str],
                 deadline: float | None = None) -> None:  # fmt: skip
    """The restore marker: restore has finished, with what outcome (readiness and /metrics read it),
    the workload it computed ("inputs": what `publish --from ROOT` publishes under), the bundle
    key ROOT's layers were made under (`_compare_layers`), but for those kept back under another,
    the bundle each layer holds ("layers_from": the next start checks them for yanks), and the key
    of each of those bundles that another key built ("bundle_keys": whose ref the check reads).
    Local state only: nothing in it is hashed or signed."""
    rootdir.clear(result.root / RESTORE_MARKER, stat.S_ISDIR, deadline)
    write_marker(result.root, RESTORE_MARKER, {
        "layers_key": layers_key, "kept_back": dict(kept_back), "layers_from": dict(came_from),
        "bundle_keys": {bundle: key for bundle, key in owners.items() if bundle in came_from.values()},
        "toolchain_key": fp.toolchain_key if fp else None,  # what `publish --from ROOT` compares with its own
        "status": result.status, "bundle_key": result.bundle_key, "bundle_id": result.bundle_id,
        "files": result.files, "bytes": result.bytes, "seconds": round(result.seconds, 4),
        "reason": result.reason, "layers": list(result.layers), "donors": dict(result.donors),
        "inputs": {k: v for k, v in fp.facts.items() if is_workload_fact(k)} if fp else {},
        "run_as": result.user,  # whose header directory it laid out: `publish --from ROOT` reads it there
    })  # fmt: skip


# What a marker's key that is no bundle key is read as: a key, never this pod's, that a marker can hold.
# Every container of the pod may write the marker, and a failed start writes that key back.
_NOT_A_KEY = "not-a-bundle-key"
# No more entries than restore itself writes: each start writes them back into the room set aside.
_MAX_PLACES = manifests.MAX_LAYERS + len(layers.BUILTIN)


def _key_read(key: object) -> str | None:
    if not isinstance(key, str):
        return None
    return key if is_bundle_key(key) else _NOT_A_KEY


def _layers_key(state: dict) -> str | None:
    """The bundle key a marker says ROOT's layers were made under (a marker from before layers_key: its bundle_key)."""
    return _key_read(state.get("layers_key", state.get("bundle_key")))


def _kept_back(state: dict) -> dict[str, str]:
    """The layers a marker says were left in place under another key, by place under ROOT (places restore
    lays layers at, and "extra", which it sets aside whole)."""
    kept = state.get("kept_back")
    if not isinstance(kept, dict):
        return {}
    valid = ((place, _key_read(key)) for place, key in kept.items()
             if isinstance(place, str) and layers.is_kept_back_place(place) and isinstance(key, str))
    return dict(itertools.islice(valid, _MAX_PLACES))


def _came_from(state: dict) -> dict[str, str]:
    """The bundle a marker says each layer holds, by place under ROOT (places restore lays layers at and ids
    of 64 hex digits only: every container of the pod may write the marker, and each start writes it back
    into the room set aside for it)."""
    found = state.get("layers_from")
    if not isinstance(found, dict):
        return {}
    valid = ((place, bundle) for place, bundle in found.items()
             if isinstance(place, str) and layers.is_place(place) and manifests.is_sha256(bundle))
    # No more than a bundle lays down: each start writes it back, and the marker has a reserve to fit in.
    return dict(itertools.islice(valid, _MAX_PLACES))


def _owners(state: dict) -> dict[str, str]:
    """The bundle key a marker says built each bundle it names under `layers_from`, for those another key
    built (bundle keys of their shape only: every container of the pod may write the marker). No more
    than there are built-in layers for donors to lay; a bundle past them is looked up under this key."""
    found = state.get("bundle_keys")
    if not isinstance(found, dict):
        return {}
    named = set(_came_from(state).values())
    valid = ((bundle, key) for bundle, key in found.items()
             if bundle in named and isinstance(key, str) and is_bundle_key(key))
    return dict(itertools.islice(valid, len(layers.BUILTIN)))


def laid_bundles(root: Path) -> dict[str, str | None]:
    """Each bundle whose files the restore marker says ROOT's layers hold, with the bundle key that built
    it where another key did (a donor; None: the marker's own key), as restore itself reads the marker."""
    state = read_state(root) or {}
    owners = _owners(state)
    return {bundle: owners.get(bundle) for bundle in _came_from(state).values()}


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
