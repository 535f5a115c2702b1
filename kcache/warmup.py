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
* `HttpTarget`: an OpenAI-compatible server (vLLM, SGLang, TGI). It waits for GET /health (a
  404 there falls back to GET /v1/models), then sends a batch of B as B concurrent POSTs to
  /v1/completions, each with one prompt of about `input_tokens` tokens and max_tokens =
  `output_tokens`. Concurrent single-prompt requests rather than one request with a list of
  prompts: every server accepts them, and they reach the server's batcher the way real traffic
  does. Each prompt starts with a unique number so that prefix caching cannot shorten it.

Each profile's first run (the compile) and the median of its later runs (the steady state) are
reported; a profile whose run raises is failed with the error and the others still run.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from kcache import http_client, readiness
from kcache.errors import ConfigError, KcacheError
from kcache.profiles import Profile

log = logging.getLogger(__name__)

Counters = Mapping[str, int]


class Target(Protocol):
    name: str
    weights_on_prepare: bool  # True: a target that passed prepare() has its weights loaded

    def prepare(self) -> None:
        """Block until the target can take requests; raise KcacheError if it never can."""

    def __call__(self, profile: Profile) -> None:
        """Run one request (or one batch) of the profile's shape; raise on failure."""


class ServerUnavailable(KcacheError):
    """The warmup server did not become healthy in time; `flag` is the limit that ended the wait."""

    def __init__(self, url: str, seconds: float, why: str, flag: str = "--wait-timeout"):
        self.url, self.seconds, self.why, self.flag = url, seconds, why, flag
        super().__init__(f"{url} was not healthy within {seconds:g} s ({flag}): {why}")


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
            with ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="kcache-warmup") as pool:
                results += list(pool.map(lambda p: _run_profile(target, p, note, None), phase))
        mark(report("running"))
    return report("ok" if all(r.ok for r in results) else "failed", probe() if probe else None)


def _run_profile(target: Target, profile: Profile, note, probe) -> ProfileResult:
    before = probe() if probe else None
    latencies: list[float] = []
    error = ""
    for i in range(profile.repeats):
        note(f"{profile.name}: run {i + 1}/{profile.repeats}")
        t0 = time.perf_counter()
        try:
            target(profile)
        except Exception as exc:  # the target is user code or a server: any failure fails the profile
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
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("--entrypoint", spec, f"cannot import {module_name}: {exc}") from None
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


# ---- HTTP target ---------------------------------------------------------------------------------

# Common English words that most BPE vocabularies hold as one token each (with a leading space).
_WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school")


def prompt(tokens: int, nonce: int) -> str:
    """About `tokens` tokens; the leading number makes each prompt's prefix unique."""
    words = [str(nonce)] + [_WORDS[i % len(_WORDS)] for i in range(max(0, tokens - 2))]
    return " ".join(words)


MAX_HEALTH_ANSWER = 64 * 1024
MAX_MODELS_ANSWER = 1024 * 1024
MAX_COMPLETION_ANSWER = 8 * 1024 * 1024  # ~100 times a 128k-token answer's text; the sidecar has 1 GiB
MAX_BACKOFF = 10.0


class HttpTarget:
    """An OpenAI-compatible completions server; see the module docstring for the request shape.

    `budget` (seconds from `prepare`, wait included) bounds everything: each request's deadline is
    cut to what is left, and a transient failure is retried (`retries` times, with backoff) only
    while the budget lasts. None: no overall limit.
    """

    weights_on_prepare = True  # a healthy server has loaded its weights

    def __init__(self, url: str, *, request_timeout: float = 120.0, wait_timeout: float = 600.0,
                 served_model: str | None = None, poll_interval: float = 0.5, retries: int = 3,
                 budget: float | None = None, backoff: float = 0.5):  # fmt: skip
        http_client.split_url(url)
        self.name = self.url = url.rstrip("/")
        self.request_timeout, self.wait_timeout, self.poll_interval = request_timeout, wait_timeout, poll_interval
        self.retries, self.budget, self.backoff = retries, budget, backoff
        self.model = served_model
        self._deadline: float | None = None
        self._nonce = 0
        self._lock = threading.Lock()

    def prepare(self) -> None:
        now = time.monotonic()
        self._deadline = now + self.budget if self.budget else None
        wait_end = min(now + self.wait_timeout, self._deadline or math.inf)
        why = "no answer"
        while True:
            remaining = wait_end - time.monotonic()
            try:
                healthy, why = self._healthy(max(0.1, min(remaining, self.request_timeout, 10.0)))
                if healthy:
                    break
            except http_client.RequestFailed as exc:
                why = exc.why
            remaining = wait_end - time.monotonic()
            if remaining <= 0:
                flag = "--wait-timeout" if wait_end < (self._deadline or math.inf) else "--budget"
                raise ServerUnavailable(self.url, wait_end - now, why, flag)
            time.sleep(min(self.poll_interval, remaining))  # a retry interval, not synchronisation
        if self.model is None:
            self.model = self._first_model()

    def _get(self, path: str, timeout: float, max_body: int = MAX_HEALTH_ANSWER) -> http_client.Response:
        return http_client.request("GET", self.url + path, timeout=timeout, max_body=max_body)

    def _healthy(self, timeout: float) -> tuple[bool, str]:
        """(healthy, why not): /health, or /v1/models on a server without /health."""
        path = "/health"
        answer = self._get(path, timeout)
        if answer.status in (404, 405):
            path = "/v1/models"
            answer = self._get(path, timeout)
        return answer.status == 200, f"GET {path}: {_status_text(answer)}"

    def _first_model(self) -> str | None:
        """The first served model's id; None lets the server use its default."""
        try:
            answer = self._get("/v1/models", self._time_left(self.request_timeout)[0], MAX_MODELS_ANSWER)
            data = (json.loads(answer.body).get("data") or []) if answer.status == 200 else []
            return http_client.printable(str(data[0]["id"])) if data else None
        except (KcacheError, ValueError, RecursionError, KeyError, TypeError, AttributeError, IndexError) as exc:
            log.info("no model list at %s/v1/models (%s); requests name no model", self.url, describe(exc))
            return None

    def __call__(self, profile: Profile) -> None:
        with self._lock:
            first, self._nonce = self._nonce, self._nonce + profile.batch_size
        if profile.batch_size == 1:
            self._complete(profile, first)
            return
        with ThreadPoolExecutor(max_workers=profile.batch_size, thread_name_prefix="kcache-http") as pool:
            for future in [pool.submit(self._complete, profile, first + i) for i in range(profile.batch_size)]:
                future.result()  # the first failure fails the batch

    def _complete(self, profile: Profile, nonce: int) -> None:
        body: dict[str, Any] = {"prompt": prompt(profile.input_tokens, nonce),
                                "max_tokens": profile.output_tokens, "temperature": 0}  # fmt: skip
        if self.model:
            body["model"] = self.model
        payload = json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            timeout, flag = self._time_left(self.request_timeout)
            try:
                return self._complete_once(payload, timeout)
            except http_client.RequestFailed as exc:
                why = f"no complete answer within {timeout:g} s ({flag})" if exc.timed_out else exc.why
                tries = f" (attempt {attempt + 1} of {self.retries + 1})" if attempt else ""
                if not exc.transient or attempt == self.retries:
                    raise WarmupRequestError(why + tries) from None
                pause = min(MAX_BACKOFF, self.backoff * 2**attempt) * random.uniform(0.5, 1.0)
                if self._deadline is not None and time.monotonic() + pause >= self._deadline:
                    raise WarmupRequestError(f"{why}{tries}; no warmup budget left to retry (--budget)") from None
                log.info("warmup request to %s failed (%s); retrying in %.1f s", self.url, why, pause)
                time.sleep(pause)  # backoff between retries, not synchronisation

    def _time_left(self, limit: float) -> tuple[float, str]:
        """(this request's deadline in seconds, the flag that set it); raises when the budget is spent."""
        if self._deadline is None:
            return limit, "--request-timeout"
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise WarmupRequestError(f"the warmup budget of {self.budget:g} s is spent (--budget)")
        return (limit, "--request-timeout") if limit <= left else (left, "--budget")

    def _complete_once(self, payload: bytes, timeout: float) -> None:
        url = self.url + "/v1/completions"
        answer = http_client.request("POST", url, timeout=timeout, max_body=MAX_COMPLETION_ANSWER, body=payload,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        if 300 <= answer.status < 400:
            why = f"POST /v1/completions: {_status_text(answer)}; kcache follows no redirects: give --url the server"
            raise http_client.RequestFailed(url, why, transient=False)
        if answer.status != 200:
            raise http_client.RequestFailed(url, _status_text(answer),
                                            transient=answer.status in http_client.TRANSIENT_STATUS)  # fmt: skip
        try:
            doc = json.loads(answer.body)
        except (ValueError, RecursionError):
            raise http_client.RequestFailed(url, "answer is not JSON", transient=False) from None
        if not isinstance(doc, dict) or not doc.get("choices"):
            text = http_client.printable(answer.body.decode("utf-8", "replace"))
            raise http_client.RequestFailed(url, f"answer has no choices: {text}", transient=False)


class WarmupRequestError(KcacheError):
    """One warmup request failed; the message is what the report shows (the profile fails, not the run)."""


def _status_text(answer: http_client.Response) -> str:
    if 300 <= answer.status < 400:
        return f"HTTP {answer.status} redirect to {answer.location or '(no Location)'}"
    detail = http_client.printable(answer.body[:300].decode("utf-8", "replace").strip())
    return f"HTTP {answer.status} {answer.reason}" + (f": {detail}" if detail else "")


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


def write_marker(root: Path, report: WarmupReport, on_failure: str = "unready") -> Path:
    """ROOT/.kcache-warmup.json: readiness turns green on status "ok", or on "failed" with
    `on_failure` "ready-cold" once the weights loaded (kcache.readiness.check)."""
    if on_failure not in readiness.ON_FAILURE:
        raise ConfigError("--on-failure", on_failure, f"expected one of {', '.join(readiness.ON_FAILURE)}")
    Path(root).mkdir(parents=True, exist_ok=True)
    return readiness.write_marker(Path(root), readiness.WARMUP_MARKER, {**to_dict(report), "on_failure": on_failure})
