"""Prebake: the build-pipeline step. Restore into ROOT, warm up against ROOT, publish from ROOT.

    ROOT/                       (--root; a build workspace or an emptyDir)
      kcache.env                written by restore; the warmup runs with these exports
      inductor/ tmp/ triton/ cuda/ vllm/ megacache/ extra/<name>/
      .kcache-state.json        restore's marker
      .kcache-warmup.json       warmup's marker

With an entrypoint, the compile must land in ROOT, and torch fixes some of its directories early:
TORCHINDUCTOR_CACHE_DIR is read when first needed, but the precompiled-header directory comes from
$TMPDIR when torch._inductor.codecache is imported, and Python's tempfile remembers the temp dir
from its first use (TORCH_FACTS.md). Setting os.environ in this process would be right only if
nothing had touched torch or tempfile yet, which a CLI process cannot promise. So the warmup runs
in a child process, `python -m kcache warmup --entrypoint ... --root ROOT --json`, started with
ROOT/kcache.env applied to its environment:
every import in it sees ROOT's variables from the first line, this process never imports torch,
and a crash or a leaked thread in the user's code cannot take publish down with it. The child also
saves torch's Mega-Cache into ROOT/megacache (kcache.env exports KCACHE_MEGACACHE).

With a server URL, the server is the one compiling, so it must already run with ROOT's
environment: prebake then needs an existing ROOT/kcache.env (`kcache restore --into ROOT`, then
start the server after `. ROOT/kcache.env`) and does not restore again, which would swap
directories under the running server.

The fingerprint comes from this process, with --fact overrides describing the production machine,
so a CPU-only builder can publish under the key that production will compute for itself; an
override of a node fact the builder can see (its CPU features, arch) must agree with it
(kcache.fingerprint.collect), or publish refuses.
Publish runs only when every profile succeeded.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from kcache import envfile, readiness, signing, sources, warmup
from kcache.errors import ConfigError, KcacheError, SignatureError
from kcache.fingerprint import Fingerprint
from kcache.profiles import Profile
from kcache.publish import PublishConfig, PublishResult, check_signed_by, publish
from kcache.restore import RestoreResult, restore, sigterm_interrupts
from kcache.store import Store

if TYPE_CHECKING:
    from kcache.index import Index

log = logging.getLogger(__name__)


class WarmupChildFailed(KcacheError):
    """The warmup child process ended without a report (it printed its error on stderr)."""

    def __init__(self, returncode: int):
        self.returncode = returncode
        super().__init__(f"the warmup process exited with code {returncode} and no report; see its error above")


_PIECE = 64 * 1024
_MAX_LINE = 16 * 1024 * 1024  # a report is a few KiB per profile; a longer line is none
_DRAIN_SECONDS = 5.0  # for the rest of the child's stdout once its session is killed
# How long the child may take to exit once its report came (atexit hooks): a thread the user's code
# left running, not a daemon, holds Python's exit for ever, and the warmup is over by then.
EXIT_GRACE = 10.0


class WarmupChildTimedOut(KcacheError):
    """The warmup child process was still running when the budget was spent; it was killed."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        super().__init__(f"the warmup process did not finish within {seconds:g} s (--budget) and was killed")


class Warmer(Protocol):
    needs_restore: bool  # prebake lays ROOT out first (False: ROOT must already be laid out)

    def warm(self, root: Path, progress: Callable[[str], None]) -> warmup.WarmupReport: ...


@dataclass(frozen=True)
class ChildWarmup:
    """An entrypoint, warmed up in a child process that runs with ROOT/kcache.env."""

    entrypoint: str
    profiles_file: Path | None = None  # None: the default profiles
    parallel: int = 1
    env: Mapping[str, str] | None = None  # the child's base environment (default: this process's)
    needs_restore: bool = True
    timeout: float | None = None  # seconds the child may run (--budget); None: no limit
    exit_grace: float = EXIT_GRACE  # seconds the child may take to exit after its report

    def command(self, root: Path) -> list[str]:
        cmd = [sys.executable, "-m", "kcache", "warmup", "--entrypoint", self.entrypoint, "--root", str(root),
               "--parallel", str(self.parallel), "--json"]  # fmt: skip
        return cmd + (["--profiles", str(Path(self.profiles_file).absolute())] if self.profiles_file else [])

    def warm(self, root: Path, progress: Callable[[str], None]) -> warmup.WarmupReport:
        env = {**(os.environ if self.env is None else self.env), **envfile.read(root / envfile.NAME)}
        progress(f"warming up {self.entrypoint} in a child process with {root / envfile.NAME}")
        after = readiness.restore_stamp(root)  # what the child reads at its start: no restore comes between
        try:
            return self._warm(root, env)
        except (KeyboardInterrupt, WarmupChildTimedOut, WarmupChildFailed) as exc:
            # The child was killed (SIGKILL), or died of its own (a segfault, the OOM killer): its last
            # marker says "running", with no expiry, for ever.
            _mark_killed(root, self.entrypoint, exc, after)
            raise

    def _warm(self, root: Path, env: Mapping[str, str]) -> warmup.WarmupReport:
        # stderr is inherited: the child's progress and errors reach the user directly. Its own
        # session: a hung entrypoint's helpers (compile workers) are killed with it.
        # The child's exit is what is waited for, not its stdout's end: a helper the user's code
        # forked (a worker pool, a daemon) inherits the pipe and would hold it open; what is left
        # of the child's session once it exits is killed, which ends the pipe.
        # SIGTERM (`timeout`, a cancelled CI job) raises Terminated here: the signal never reaches
        # the child's session, and dying on the spot left the warmup running for good.
        # Once the report came, the child has `exit_grace` to exit: a thread the user's code left
        # running would otherwise hold it past --budget (the report lost) or for ever.
        with sigterm_interrupts(), subprocess.Popen(self.command(root), env=env, stdout=subprocess.PIPE,
                                                    start_new_session=True) as child:  # fmt: skip
            found: list[warmup.WarmupReport] = []  # the last report line of the child's stdout
            settled = threading.Event()  # the child exited, or printed its report
            # On a descriptor of its own: closing child.stdout (leaving this block) takes the
            # buffered reader's lock, which a read blocked on a helper that left the session holds.
            reader = threading.Thread(target=_drain, args=(os.dup(child.stdout.fileno()), found, settled),
                                      name="kcache-child-out", daemon=True)  # fmt: skip
            reader.start()
            threading.Thread(target=lambda: (child.wait(), settled.set()), name="kcache-child-exit",
                             daemon=True).start()  # fmt: skip
            try:
                self._wait(child, settled)
            finally:
                _kill_group(child)
            reader.join(_DRAIN_SECONDS)  # a helper that left the session may hold the pipe still
        if not found:
            raise WarmupChildFailed(child.returncode)
        return found[-1]

    def _wait(self, child: subprocess.Popen, settled: threading.Event) -> None:
        """Until the child exits, or at most `exit_grace` after its report; WarmupChildTimedOut when
        the budget is spent before either."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        if not settled.wait(self.timeout):
            raise WarmupChildTimedOut(self.timeout or 0)
        left = self.exit_grace if deadline is None else min(self.exit_grace, deadline - time.monotonic())
        try:
            child.wait(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:  # the report is in: the warmup is over, whatever holds the exit
            log.warning("the warmup process did not exit within %g s of its report (a thread the entrypoint "
                        "left running?); killed", max(0.0, left))  # fmt: skip


def _mark_killed(root: Path, target: str, exc: BaseException, after: str | None) -> None:
    """A failed marker in place of the killed child's "running" one, keeping the signals it held."""
    doc = readiness.read_marker(root, readiness.WARMUP_MARKER) or {}
    last = None
    if doc.get("status") == "running" and doc.get(readiness.AFTER_RESTORE) == after:
        try:
            last = warmup.from_dict(doc)
        except (ValueError, KeyError, TypeError, AttributeError):  # ROOT is the build's, but checked all the same
            last = None
    if isinstance(exc, KeyboardInterrupt):
        failed = warmup.interrupted(target, last, exc)
    else:
        failed = replace(last or warmup.WarmupReport("failed", target, 0.0, ()), status="failed", error=str(exc))
    try:
        warmup.write_marker(root, failed, after_restore=after)
    except KcacheError as write_error:  # what stopped the warmup is what to report
        log.warning("cannot write the warmup marker: %s", write_error)


def _report_in(line: bytes) -> warmup.WarmupReport | None:
    """The report one line of the child's stdout is, or None. The user's code may still print after the
    report (an atexit hook, a thread), past the redirect `kcache warmup` keeps around the entrypoint:
    the last line that is a report is the child's."""
    if not line.lstrip().startswith(b"{"):  # most lines, and cheap: a thread may print millions
        return None
    try:
        return warmup.from_dict(json.loads(line.decode(errors="replace")))
    except (ValueError, RecursionError, KeyError, TypeError, AttributeError):
        return None


def _kill_group(child: subprocess.Popen) -> None:
    """The child's process group is killed (the child itself when it still runs, past its timeout
    or with this process interrupted; else what its session left running), then the child reaped."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nothing of it left, or nothing of it ours to signal
        pass
    child.wait()


def _drain(fd: int, found: list[warmup.WarmupReport], reported: threading.Event) -> None:
    """Read `fd` to its end, a piece at a time, then close it. Each line is read as a report as it
    completes (the last, unterminated one at the end): `found` holds the last report, and `reported`
    is set at the first. Nothing else is kept: the user's code may print without end after the report
    (an atexit hook, a thread, for the whole grace), and prebake kept all of it, 2.3 GiB for 768 MiB
    printed. A line longer than _MAX_LINE is no report of kcache warmup's and is skipped."""
    line = bytearray()
    skipping = False  # inside a line past _MAX_LINE, until its end

    def ended() -> None:
        report = None if skipping else _report_in(bytes(line))
        if report is not None:
            found[:] = [report]
            reported.set()

    try:
        while piece := os.read(fd, _PIECE):
            start = 0
            while (end := piece.find(b"\n", start)) >= 0:
                if not skipping:
                    line += piece[start:end]
                ended()
                line.clear()
                skipping, start = False, end + 1
            if not skipping:
                line += piece[start:]
                if len(line) > _MAX_LINE:
                    line.clear()
                    skipping = True
    except OSError:  # the pipe's end is all this reader needs to know
        pass
    finally:
        ended()
        os.close(fd)


@dataclass(frozen=True)
class ServerWarmup:
    """A running OpenAI-compatible server that was started with ROOT/kcache.env."""

    target: warmup.HttpTarget
    profiles: tuple[Profile, ...]
    parallel: int = 1
    needs_restore: bool = False

    def warm(self, root: Path, progress: Callable[[str], None]) -> warmup.WarmupReport:
        after = readiness.restore_stamp(root)
        last: list[warmup.WarmupReport] = []  # the last "running" report: what held when a signal came
        try:
            report = warmup.run(self.target, self.profiles, parallel=self.parallel, progress=progress,
                                checkpoint=last.append)  # fmt: skip
        except KeyboardInterrupt as exc:  # SIGTERM (prebake's handler) or SIGINT: the marker says so
            try:
                warmup.write_marker(root, warmup.interrupted(self.target.name, last[-1] if last else None, exc),
                                    after_restore=after)  # fmt: skip
            except KcacheError as write_error:  # the signal is what to report
                log.warning("cannot write the warmup marker: %s", write_error)
            raise
        warmup.write_marker(root, report, after_restore=after)
        return report


@dataclass(frozen=True)
class PrebakeResult:
    restore: RestoreResult | None  # None when ROOT was laid out beforehand (server mode)
    warmup: warmup.WarmupReport
    publish: PublishResult | None  # None when warmup failed: nothing is published


def prebake(
    store: Store,
    index: Index,
    fingerprint: Fingerprint,
    root: Path,
    warmer: Warmer,
    *,
    config: PublishConfig = PublishConfig(),
    progress: Callable[[str], None] | None = None,
) -> PrebakeResult:
    """Restore (or check ROOT is laid out), warm up, then publish if every profile succeeded. SIGTERM
    raises kcache.errors.Terminated in any of them: as a container's PID 1 without a handler, prebake
    got no SIGTERM at all, and a warmup stopped by it must not be published."""
    with sigterm_interrupts():
        return _prebake(store, index, fingerprint, Path(root).absolute(), warmer, config, progress)


def _prebake(store: Store, index: Index, fingerprint: Fingerprint, root: Path, warmer: Warmer, config: PublishConfig,
             progress: Callable[[str], None] | None) -> PrebakeResult:  # fmt: skip
    note = progress or (lambda _msg: None)
    restored = None
    if warmer.needs_restore:
        # Publish signs all of ROOT: with a signing key, only a bundle that key signed may be laid into it
        # (as publish carries no other). A bundle a store writer planted was restored, warmed over and
        # published signed, and every pod requiring signatures then took the planted files.
        trusted = (signing.public_of(config.signing_key),) if config.signing_key is not None else ()
        # One it did not sign is what it is to a pod requiring signatures: the warmup starts cold (restore
        # left kcache.env and an error marker), and this publish becomes the key's newest, signed.
        try:
            restored = restore(store, index, fingerprint, root, jobs=config.jobs, trusted=trusted,
                               require_signature=bool(trusted))  # fmt: skip
        except SignatureError as exc:
            log.warning("not restoring into %s: %s; warming up cold", root, exc)
            restored = RestoreResult("error", fingerprint.bundle_key, None, root, root / envfile.NAME, reason=str(exc))
        note(f"restore: {restored.status} ({restored.files} files)")
    elif not (root / envfile.NAME).is_file():
        raise ConfigError("--root", str(root), "has no kcache.env: run `kcache restore --into ROOT` and start "
                                               "the server after `. ROOT/kcache.env` first")  # fmt: skip
    if config.signing_key is not None:  # a refused restore keeps the layers of its key that ROOT held
        check_signed_by(store, root, fingerprint, config.signing_key)  # before the warmup runs over ROOT
    report = warmer.warm(root, note)
    if report.status != "ok":
        return PrebakeResult(restored, report, None)
    # After a cold start, the warmup's time is what a hit on this bundle saves (`kcache stats`).
    cold = (readiness.read_marker(root, readiness.RESTORE_MARKER) or {}).get("status") == "miss"
    published = publish(store, index, fingerprint, sources.in_root(root), root=root, config=config, progress=note,
                        compile_seconds=report.seconds if cold else None)  # fmt: skip
    return PrebakeResult(restored, report, published)
