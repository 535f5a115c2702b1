"""The warmup target that is an OpenAI-compatible HTTP server (vLLM, SGLang, TGI).

It waits for GET /health to answer 2xx (a 404 there falls back to GET /v1/models), then sends a
batch of B as B concurrent POSTs to /v1/completions, each with one prompt of about `input_tokens` tokens and
max_tokens = `output_tokens`. Concurrent single-prompt requests rather than one request with a
list of prompts: every server accepts them, and they reach the server's batcher the way real
traffic does. Each prompt starts with a unique number so that prefix caching cannot shorten it.

The server is not trusted (kcache.http_client): every request has one deadline, a capped answer and
no redirects. A transient failure (connection error, timeout, 408/429/502/503/504) is retried with
exponential backoff and jitter, `retries` times, and only while the warmup `budget` lasts; any
other failure fails the profile at once.
"""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from kcache import http_client
from kcache.errors import KcacheError
from kcache.profiles import Profile

log = logging.getLogger(__name__)


class ServerUnavailable(KcacheError):
    """The warmup server did not become healthy in time; `flag` is the limit that ended the wait."""

    def __init__(self, url: str, seconds: float, why: str, flag: str = "--wait-timeout"):
        self.url, self.seconds, self.why, self.flag = url, seconds, why, flag
        super().__init__(f"{url} was not healthy within {seconds:g} s ({flag}): {why}")


# Common English words that most BPE vocabularies hold as one token each (with a leading space).
_WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school")


def answer_limit(profile: Profile) -> int:
    """The most bytes one completion answer of `profile`'s shape may have (see ANSWER_PER_TOKEN)."""
    own = min(MAX_COMPLETION_ANSWER, ANSWER_BASE + ANSWER_PER_TOKEN * profile.output_tokens)
    return max(ANSWER_BASE, min(own, MAX_BATCH_ANSWERS // profile.batch_size))


def filler(tokens: int) -> bytes:
    """A prompt of about `tokens` tokens after its leading number (which makes each prompt's prefix
    unique): the same for every request of a shape, so a batch shares it."""
    rounds, rest = divmod(max(0, tokens - 2), len(_WORDS))  # the words in turn, each after a space
    return (" " + " ".join(_WORDS)).encode("ascii") * rounds + "".join(f" {w}" for w in _WORDS[:rest]).encode("ascii")


def payload(nonce: int, shared: bytes, fields: dict[str, Any]) -> tuple[bytes, ...]:
    """The JSON body {"prompt": str(nonce) + shared, **fields} as pieces that share `shared`: a batch of
    B long prompts holds one copy of it rather than three per request (a 1M-token prompt is 5.6 MB).
    `shared` is ASCII words and spaces, which JSON needs no escapes for."""
    rest = json.dumps(fields)  # "{...}": its fields follow the prompt's
    return b'{"prompt": "' + str(nonce).encode("ascii"), shared, ('", ' + rest[1:]).encode("ascii")


MAX_HEALTH_ANSWER = 64 * 1024
MAX_MODELS_ANSWER = 1024 * 1024
MAX_MODEL_ID = 4096  # characters: a model's path or name; each request of a batch carries it
MAX_COMPLETION_ANSWER = 8 * 1024 * 1024  # one answer, however many tokens it has
# A batch of B holds B answers at once, and the sidecar has 1 GiB: each answer may hold the JSON
# around its text and ANSWER_PER_TOKEN bytes per token asked for (a token is a few bytes of text,
# JSON escapes a character to at most six), and a batch's answers together MAX_BATCH_ANSWERS, which
# is also what the batches and singles that --parallel runs at once may hold in all (_room_for).
ANSWER_BASE = 64 * 1024
ANSWER_PER_TOKEN = 256
MAX_BATCH_ANSWERS = 256 * 1024 * 1024
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
        parts = http_client.parse(url)
        self.name = self.url = url.rstrip("/")
        # What the request paths are appended to: a query or fragment in --url is no part of it.
        self._base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/')}"
        self.request_timeout, self.wait_timeout, self.poll_interval = request_timeout, wait_timeout, poll_interval
        self.retries, self.budget, self.backoff = retries, budget, backoff
        self.model = served_model
        self._deadline: float | None = None
        self._nonce = 0
        self._lock = threading.Lock()
        self._room = threading.Condition()
        self._held = 0  # bytes of answers the runs under way may hold: MAX_BATCH_ANSWERS in all

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
        return http_client.request("GET", self._base + path, timeout=timeout, max_body=max_body)

    def _healthy(self, timeout: float) -> tuple[bool, str]:
        """(healthy, why not): /health, or /v1/models on a server without /health (under a model
        list's cap: a server with many adapters lists more than a health answer holds)."""
        path = "/health"
        answer = self._get(path, timeout)
        if answer.status in (404, 405):
            path = "/v1/models"
            answer = self._get(path, timeout, MAX_MODELS_ANSWER)
        return 200 <= answer.status < 300, f"GET {path}: {_status_text(answer)}"  # as readiness.EngineHealth

    def _first_model(self) -> str | None:
        """The first served model's id; None lets the server use its default.

        Sent back as it came (JSON escapes it in the request): the server serves only that name, and
        a long path is a common one. Every request carries it, so one over MAX_MODEL_ID is not used."""
        try:
            answer = self._get("/v1/models", self._time_left(self.request_timeout)[0], MAX_MODELS_ANSWER)
            data = (json.loads(answer.body).get("data") or []) if answer.status == 200 else []
            model = data[0]["id"] if data else None
            if model is not None and (not isinstance(model, str) or not model or len(model) > MAX_MODEL_ID):
                raise ValueError(f"the first model's id is no string of 1 to {MAX_MODEL_ID} characters")
            return model
        except (KcacheError, ValueError, RecursionError, KeyError, TypeError, AttributeError, IndexError) as exc:
            log.info("no model list at %s/v1/models (%s); requests name no model", self.url,
                     http_client.printable(str(exc)))  # fmt: skip
            return None

    def __call__(self, profile: Profile) -> None:
        with self._lock:
            first, self._nonce = self._nonce, self._nonce + profile.batch_size
        with self._room_for(min(MAX_BATCH_ANSWERS, answer_limit(profile) * profile.batch_size)):
            self._run(profile, first)

    def _run(self, profile: Profile, first: int) -> None:
        shared = filler(profile.input_tokens)
        if profile.batch_size == 1:
            self._complete(profile, first, shared)
            return
        pool = ThreadPoolExecutor(max_workers=profile.batch_size, thread_name_prefix="kcache-http")
        with unwaited_on_interrupt(pool):
            # No name for the list: the failure raised here would hold it, each future's exception and
            # so every answer's socket and bytes, in a reference cycle until the next garbage collection.
            for future in [pool.submit(self._complete, profile, first + i, shared)
                           for i in range(profile.batch_size)]:  # fmt: skip
                future.result()  # the first failure fails the batch

    def _complete(self, profile: Profile, nonce: int, shared: bytes) -> None:
        fields: dict[str, Any] = {"max_tokens": profile.output_tokens, "temperature": 0}
        if self.model:
            fields["model"] = self.model
        body = payload(nonce, shared, fields)
        for attempt in range(self.retries + 1):
            timeout, flag = self._time_left(self.request_timeout)
            try:
                return self._complete_once(body, timeout, answer_limit(profile))
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

    @contextmanager
    def _room_for(self, size: int) -> Iterator[None]:
        """Wait until the answers of the runs under way leave `size` bytes of MAX_BATCH_ANSWERS: with
        --parallel, several batches run at once, and each may hold that much."""
        with self._room:
            while self._held + size > MAX_BATCH_ANSWERS:
                left = None if self._deadline is None else self._deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise WarmupRequestError(f"the warmup budget of {self.budget:g} s is spent (--budget)")
                self._room.wait(left)  # until a run under way ends (each ends within its deadlines)
            self._held += size
        try:
            yield
        finally:
            with self._room:
                self._held -= size
                self._room.notify_all()

    def _time_left(self, limit: float) -> tuple[float, str]:
        """(this request's deadline in seconds, the flag that set it); raises when the budget is spent."""
        if self._deadline is None:
            return limit, "--request-timeout"
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise WarmupRequestError(f"the warmup budget of {self.budget:g} s is spent (--budget)")
        return (limit, "--request-timeout") if limit <= left else (left, "--budget")

    def _complete_once(self, body: tuple[bytes, ...], timeout: float, max_body: int) -> None:
        url = self._base + "/v1/completions"
        answer = http_client.request("POST", url, timeout=timeout, max_body=max_body, body=body,
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


@contextmanager
def unwaited_on_interrupt(pool: ThreadPoolExecutor) -> Iterator[None]:
    """`with pool:`, except that a signal (KeyboardInterrupt, kcache.errors.Terminated) leaves at once:
    the runs under way are not waited for (a request may have minutes left of its deadline, past the
    kubelet's grace period) and those queued never start."""
    wait = True
    try:
        yield
    except KeyboardInterrupt:
        wait = False
        raise
    finally:
        pool.shutdown(wait=wait, cancel_futures=not wait)


class WarmupRequestError(KcacheError):
    """One warmup request failed; the message is what the report shows (the profile fails, not the run)."""


def _status_text(answer: http_client.Response) -> str:
    if 300 <= answer.status < 400:
        return f"HTTP {answer.status} redirect to {answer.location or '(no Location)'}"
    detail = http_client.printable(answer.body[:300].decode("utf-8", "replace").strip())
    return f"HTTP {answer.status} {answer.reason}" + (f": {detail}" if detail else "")
