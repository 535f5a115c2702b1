"""Warmup: send every profile's shape once so that compiles happen before users arrive.

Order: single requests (batch size 1) first, in the profiles' order, then batches by batch size.
A single request is what a readiness probe or the first user sends, and it compiles the smallest
graphs; batches then grow the shapes one step at a time. With `parallel` > 1 the profiles of
each phase run on a thread pool, but every single-request profile still finishes before the
first batch starts.

Two targets:

* `CallableTarget`: `module:function`, called in this process as fn(batch_size, input_tokens,
  output_tokens). torch.compile is not thread-safe while compiling: use parallel > 1 only if
  the function is.
* `HttpTarget` (kcache.warmup_http): an OpenAI-compatible server (vLLM, SGLang, TGI), sent a
  batch of B as B concurrent POSTs to /v1/completions after its health check answered.

Each profile's first run (the compile) and the median of its later runs (the steady state) are
reported; a profile whose run raises is failed with the error and the others still run.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from kcache import readiness
from kcache.config import redact_doc
from kcache.errors import ConfigError, KcacheError, RootError
from kcache.profiles import Profile
from kcache.warmup_http import HttpTarget as HttpTarget  # re-exported: callers name warmup.HttpTarget
from kcache.warmup_http import ServerUnavailable as ServerUnavailable
from kcache.warmup_http import WarmupRequestError as WarmupRequestError
from kcache.warmup_http import unwaited_on_interrupt

log = logging.getLogger(__name__)

Counters = Mapping[str, int]


class Target(Protocol):
    name: str
    weights_on_prepare: bool  # True: a target that passed prepare() has its weights loaded

    def prepare(self) -> None:
        """Block until the target can take requests; raise KcacheError if it never can."""

    def __call__(self, profile: Profile) -> None:
        """Run one request (or one batch) of the profile's shape; raise on failure."""


@dataclass(frozen=True)
class ProfileResult:
    profile: Profile
    ok: bool
    latencies: tuple[float, ...]  # seconds per completed run, in order
    error: str = ""
    counters: Counters | None = None  # torch cache counters during this profile (sequential runs only)

    @property
    def first(self) -> float | None:
        return self.latencies[0] if self.latencies else None

    @property
    def steady(self) -> float | None:
        """Median of the runs after the first (the first one compiles); the first if it ran alone."""
        later = self.latencies[1:]
        return statistics.median(later) if later else self.first


@dataclass(frozen=True)
class WarmupReport:
    status: str  # ok | failed
    target: str
    seconds: float
    results: tuple[ProfileResult, ...]
    error: str = ""  # the target never became usable
    counters: Counters | None = None  # torch cache counters of the whole process, if torch ran here
    megacache: str | None = None  # the Mega-Cache blob written after warmup
    weights: bool = False  # readiness signal: the target answered (a server's health) or served a run
    graphs: bool = False  # readiness signal: every profile's first (compiling) run returned

    @property
    def failed(self) -> tuple[ProfileResult, ...]:
        return tuple(r for r in self.results if not r.ok)


def schedule(profiles: Iterable[Profile]) -> tuple[tuple[Profile, ...], tuple[Profile, ...]]:
    """(single-request profiles in the given order, batch profiles by batch size then length)."""
    profiles = list(profiles)
    singles = tuple(p for p in profiles if p.batch_size == 1)
    batches = sorted((p for p in profiles if p.batch_size > 1), key=lambda p: (p.batch_size, p.input_tokens))
    return singles, tuple(batches)


def run(
    target: Target,
    profiles: Iterable[Profile],
    *,
    parallel: int = 1,
    progress: Callable[[str], None] | None = None,
    probe: Callable[[], Counters | None] | None = None,
    checkpoint: Callable[[WarmupReport], None] | None = None,
) -> WarmupReport:
    """Run every profile against `target` in schedule order. Never raises for a failing profile.

    `probe` returns cache counters (e.g. torch's) so each sequential profile reports what it hit.
    `checkpoint` gets a "running" report whenever a readiness signal may have turned (after the
    wait, after each phase), so the marker shows what holds the pod back while warmup runs.
    """
    started = time.perf_counter()
    note = progress or (lambda _msg: None)
    mark = checkpoint or (lambda _report: None)
    profiles = tuple(profiles)
    try:
        target.prepare()
    except KcacheError as exc:
        return WarmupReport("failed", target.name, time.perf_counter() - started, (), error=str(exc))
    results: list[ProfileResult] = []

    def report(status: str, counters: Counters | None = None) -> WarmupReport:
        weights = getattr(target, "weights_on_prepare", False) or any(r.latencies for r in results)
        graphs = len(results) == len(profiles) and all(r.latencies for r in results)
        return WarmupReport(status, target.name, time.perf_counter() - started, tuple(results), counters=counters,
                            weights=weights, graphs=graphs)  # fmt: skip

    mark(report("running"))
    for phase in schedule(profiles):
        if parallel <= 1:
            results += [_run_profile(target, p, note, probe) for p in phase]
        else:
            pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="kcache-warmup")
            with unwaited_on_interrupt(pool):
                results += list(pool.map(lambda p: _run_profile(target, p, note, None), phase))
        mark(report("running"))
    return report("ok" if all(r.ok for r in results) else "failed", probe() if probe else None)


def interrupted(target: str, last: WarmupReport | None, exc: KeyboardInterrupt) -> WarmupReport:
    """The failed report of a warmup a signal stopped: what `last` (its last "running" report, None
    before the target answered) said held then, and which signal it was."""
    signum = getattr(exc, "signum", signal.SIGINT)  # Python's own SIGINT handler raises a plain one
    error = f"warmup stopped by signal {signum} ({signal.Signals(signum).name}) before it finished"
    if last is None:
        return WarmupReport("failed", target, 0.0, (), error=error)
    return replace(last, status="failed", error=error)


def _run_profile(target: Target, profile: Profile, note, probe) -> ProfileResult:
    before = probe() if probe else None
    latencies: list[float] = []
    error = ""
    for i in range(profile.repeats):
        note(f"{profile.name}: run {i + 1}/{profile.repeats}")
        t0 = time.perf_counter()
        try:
            target(profile)
        # The target is user code or a server: any failure fails the profile. sys.exit() too (argparse in
        # the user's code reading kcache's arguments): it left warmup without a report and the marker "running".
        except (Exception, SystemExit) as exc:
            error = describe(exc)
            break
        latencies.append(time.perf_counter() - t0)
    after = probe() if probe else None
    delta = {k: v - (before or {}).get(k, 0) for k, v in after.items()} if after is not None else None
    return ProfileResult(profile, not error, tuple(latencies), error, delta)


def describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, KcacheError) else f"{type(exc).__name__}: {exc}"


# ---- in-process target ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CallableTarget:
    name: str
    fn: Callable[[int, int, int], Any]
    weights_on_prepare = False  # the function loads its model on the first call

    def prepare(self) -> None:
        pass

    def __call__(self, profile: Profile) -> None:
        self.fn(profile.batch_size, profile.input_tokens, profile.output_tokens)


def load_entrypoint(spec: str) -> CallableTarget:
    """`module:function`, looked up like uvicorn does: the current directory first on sys.path."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError("--entrypoint", spec, "expected module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if module_name.startswith("."):  # import_module raised TypeError: a relative name needs a package
        raise ConfigError("--entrypoint", spec, "the module must be named in full, not relative to a package")
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as exc:  # ValueError: an empty part ("a..b")
        raise ConfigError("--entrypoint", spec, f"cannot import {module_name}: {exc}") from None
    except (Exception, SystemExit) as exc:  # the user's module failed while importing (no GPU, a syntax error,
        # sys.exit()): not a kcache bug
        raise ConfigError("--entrypoint", spec, f"cannot import {module_name}: {describe(exc)}") from None
    fn: Any = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError("--entrypoint", spec, f"{module_name} has no callable {attr}")
    return CallableTarget(spec, fn)


def torch_counters() -> Counters | None:
    """Torch's cache counters when the entrypoint has imported torch; None otherwise (never imports it)."""
    if "torch" not in sys.modules:
        return None
    from kcache.torch import counters

    return counters()


def save_megacache(report: WarmupReport, env: Mapping[str, str] | None = None) -> WarmupReport:
    """After an in-process warmup: write torch's Mega-Cache to $KCACHE_MEGACACHE if both are there."""
    env = os.environ if env is None else env
    if "torch" not in sys.modules or not env.get("KCACHE_MEGACACHE"):
        return report
    from kcache import torch as ktorch

    saved = ktorch.save_megacache(ktorch.megacache_path(env=env))
    return replace(report, megacache=str(saved.path)) if saved else report


# ---- reports ---------------------------------------------------------------------------------------


def to_dict(report: WarmupReport) -> dict[str, Any]:
    """The report as JSON-ready data (raw seconds), also the readiness marker's content."""
    doc = asdict(report)
    doc["signals"] = {"weights": doc.pop("weights"), "graphs": doc.pop("graphs")}
    doc["profiles"] = [
        {**asdict(r.profile), "ok": r.ok, "first_s": r.first, "steady_s": r.steady,
         "latencies_s": list(r.latencies), "error": r.error, "counters": r.counters}
        for r in report.results
    ]  # fmt: skip
    del doc["results"]
    return doc


def from_dict(doc: Mapping[str, Any]) -> WarmupReport:
    """Inverse of `to_dict` (a child process's report)."""
    fields = ("name", "batch_size", "input_tokens", "output_tokens", "repeats")
    results = tuple(
        ProfileResult(
            Profile(**{k: p[k] for k in fields}), p["ok"], tuple(p["latencies_s"]), p["error"], p.get("counters")
        )  # fmt: skip
        for p in doc["profiles"]
    )
    signals = doc.get("signals") or {}
    return WarmupReport(doc["status"], doc["target"], doc["seconds"], results, doc.get("error", ""),
                        doc.get("counters"), doc.get("megacache"), signals.get("weights") is True,
                        signals.get("graphs") is True)  # fmt: skip


_NOW = object()


def write_marker(root: Path, report: WarmupReport, on_failure: str = "unready", *,
                 expires_at: datetime | None = None, after_restore: str | None | object = _NOW) -> Path:  # fmt: skip
    """ROOT/.kcache-warmup.json: readiness turns green on status "ok", or on "failed" with
    `on_failure` "ready-cold" once the weights loaded (kcache.readiness.check). A "running" marker
    with `expires_at` counts as failed after it: the warmup that wrote it was killed.

    `after_restore` is readiness.restore_stamp(root) as it was when the warmup started (default: now):
    readiness ignores the marker once another restore is in place, so the warmup of the last pod on a
    kept volume, still running when the new pod's restore finished, cannot make the new pod ready."""
    if on_failure not in readiness.ON_FAILURE:
        raise ConfigError("--on-failure", on_failure, f"expected one of {', '.join(readiness.ON_FAILURE)}")
    # Every container of the pod reads ROOT, and `kcache ready --json` shows the marker: --url and
    # the errors quoting it may carry a password (http://user:pass@host).
    doc = redact_doc(json.loads(json.dumps({**to_dict(report), "on_failure": on_failure})))
    doc[readiness.AFTER_RESTORE] = readiness.restore_stamp(Path(root)) if after_restore is _NOW else after_restore
    if report.status == "running" and expires_at is not None:
        doc["expires_at"] = expires_at.isoformat()
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
        return readiness.write_marker(Path(root), readiness.WARMUP_MARKER, doc)
    except OSError as exc:  # a file above ROOT, a directory where the marker goes, a read-only or full ROOT
        raise RootError(str(root), f"cannot write {readiness.WARMUP_MARKER}: {exc.strerror or exc}") from None
