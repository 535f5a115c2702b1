"""The reverse proxy itself: aiohttp server in front of an OpenAI-compatible engine, aiohttp client to it.

    the client port:
    POST /v1/completions, /v1/chat/completions   cache lookup (kcache.proxy.key), else forwarded
    /metrics, /metrics/...                       404, neither the proxy's nor the engine's (see below)
    anything else                                forwarded untouched, streamed both ways
    the metrics port:
    GET  /metrics                                the proxy's own counters (kcache.proxy.stats)

The counters are not for clients: how much of a prompt was seen before moves when a prompt another
tenant sent comes again, so any client reading them could tell what others asked (the engine's own
prefix-cache counters would tell the same, hence no /metrics is forwarded either). They are served
on a listener of their own, for Prometheus and the readiness probe, which a Service need not route.

A miss is forwarded chunk by chunk while it is recorded; the entry is written to Redis before the
response's last chunk goes out, so a client that has read an answer whole can count on the next
identical request being a hit. A hit is replayed with the headers the engine sent and, for a stream,
the engine's exact bytes in runs of whole events (sse.batches). Every answer carries
`X-Kcache-Cache` (hit | miss | bypass | pass). Redis failing is a pass-through (kcache.proxy.cache); the
upstream failing is a 502 in OpenAI's error shape, since there is nothing else to answer with.

Request bodies are read raw (never inflated: the engine gets the bytes the client sent, and the key
is computed from them), and at most max_request_bytes of one is held: a larger body is forwarded as
it arrives, uncached and never parsed. Parsing a body costs up to ~30 times its size in memory and
holds the GIL throughout (json's C code), so the bound is what keeps the proxy inside its memory
limit and every other client served; bodies past _INLINE_BYTES are judged one at a time, on a worker
thread (running two at once would gain nothing under the GIL, and double the memory).

Request headers are forwarded with their repeats, except this hop's (those the Connection header
names too, both ways); a client that hangs up cancels its handler, which closes the engine's
connection.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import socket
import time
import urllib.parse
from dataclasses import dataclass, field, replace
from functools import partial

import aiohttp
import yarl
from aiohttp import web
from multidict import CIMultiDict

from kcache import metrics
from kcache.config import redact_text, redact_url
from kcache.errors import ConfigError
from kcache.proxy import entry as entries
from kcache.proxy import key, prefix, sse
from kcache.proxy.cache import CacheUnavailable, ResultCache
from kcache.proxy.prefix import PrefixMemory
from kcache.proxy.stats import Stats
from kcache.serve import bind_error

log = logging.getLogger(__name__)

_INLINE_BYTES = 256 * 1024  # a body judged on the loop itself: ~ms of parsing at most

CACHE_HEADER = "X-Kcache-Cache"
# Request headers that belong to this hop, or that the proxy sets itself, besides those the request's
# Connection header names. `Expect: 100-continue` was answered to the client already; forwarded, aiohttp
# would wait for the engine's 100, which it need not send.
NOT_FORWARDED = frozenset(
    {"connection", "keep-alive", "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "host",
     "content-length", "expect", key.BYPASS_HEADER.lower()}
)  # fmt: skip


@dataclass(frozen=True)
class ProxyConfig:
    upstream: str  # http://127.0.0.1:8000, no trailing slash needed
    redis_url: str
    fingerprint: str | None  # the bundle key of what the pod runs; None: unknown, so nothing is cached
    ttl: float = 3600.0  # seconds an answer lives in Redis
    max_entry_bytes: int = 1 << 20
    redis_timeout: float = 0.25  # seconds: the most a request waits on Redis (see docs/proxy.md)
    redis_connections: int = 64  # the most connections to Redis at once (kcache.proxy.cache)
    retry_after: float = 2.0  # seconds Redis is skipped after a failure
    key_prefix: str = "kcache:proxy:"
    enabled: bool = True  # False: forward everything, count it, cache nothing
    cache_sampled: bool = False
    prefix_entries: int = 100_000
    max_request_bytes: int = 4 << 20  # the most of one completion request's body held, parsed and keyed
    tenant_headers: tuple[str, ...] = ()  # headers that name the tenant besides key.TENANT_HEADERS (never instead)
    # On close, how long requests in flight may run on (then they are cut off): under the pod's grace period.
    shutdown_timeout: float = 20.0
    # The secret that tags entries (kcache.proxy.entry); None: a random one of this process's own, so that
    # entries serve only the process that wrote them. Never in a repr.
    entry_secret: bytes | None = field(default=None, repr=False)


class Proxy:
    """One proxy: `await start(host, port)` returns the bound port; `await close()` stops it."""

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.stats = Stats(fingerprint=config.fingerprint or "")
        # Why the cache answers nothing ("" while it is on): a pod whose fingerprint is unknown still serves.
        self.off = "disabled" if not config.enabled else "no_fingerprint" if config.fingerprint is None else ""
        self.prefixes = PrefixMemory(config.prefix_entries)
        self.upstream = config.upstream.rstrip("/")
        self.tenant_headers = key.tenant_headers(config.tenant_headers)
        self._secret = config.entry_secret or secrets.token_bytes(entries.MIN_SECRET_BYTES)
        self._runner: web.AppRunner | None = None
        self._metrics_runner: web.AppRunner | None = None
        self.metrics_port = 0  # bound by start()
        self._storing: set[asyncio.Task] = set()  # shielded writes whose client left: the loop holds tasks weakly
        self._judging = asyncio.Semaphore(1)  # large bodies parsed at once (see the module docstring)
        self._upstream_down = False  # the last request found the upstream not answering (warned about once)

    async def start(self, host: str = "127.0.0.1", port: int = 0, metrics_port: int = 0) -> int:
        """Listen for clients on `port` and for metrics on `metrics_port` (0: a free one, then
        self.metrics_port); returns the client port."""
        cfg = self.config
        self.cache = ResultCache(cfg.redis_url, self.stats, prefix=cfg.key_prefix, ttl=cfg.ttl,
                                 timeout=cfg.redis_timeout, retry_after=cfg.retry_after,
                                 max_bytes=cfg.max_entry_bytes, connections=cfg.redis_connections)  # fmt: skip
        # No total timeout: a long generation is not a failure. Raw bytes both ways (no decompression).
        self.session = aiohttp.ClientSession(
            auto_decompress=False, connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )  # fmt: skip
        app = web.Application(client_max_size=cfg.max_request_bytes)
        app.router.add_route("*", "/{tail:.*}", self._any)
        # auto_decompress off: a Content-Encoding body is forwarded as sent, never inflated (a bomb stays small).
        # handler_cancellation: a client that hangs up cancels its handler, which closes the engine's connection:
        # that is how the engine learns to stop generating (otherwise only the next write would notice).
        # shutdown_timeout: aiohttp waits up to it twice on close (for a handler to finish, then for the cancelled
        # one to end), so half each; its default of 60 s had the proxy take two minutes to exit on SIGTERM.
        grace = cfg.shutdown_timeout / 2
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False,
                                     handler_cancellation=True, shutdown_timeout=grace)  # fmt: skip
        metrics_app = web.Application()
        metrics_app.router.add_get("/metrics", self._metrics)
        self._metrics_runner = web.AppRunner(metrics_app, access_log=None, handle_signals=False,
                                             shutdown_timeout=grace)  # fmt: skip
        bound = await self._listen(self._runner, host, port, "--port")
        self.metrics_port = await self._listen(self._metrics_runner, host, metrics_port, "--metrics-port")
        return bound

    async def _listen(self, runner: web.AppRunner, host: str, port: int, flag: str) -> int:
        """Serve `runner` on host:port; the bound port. ConfigError (after closing everything) when it cannot."""
        await runner.setup()
        try:
            await _site(runner, host, port).start()
        except (UnicodeError, TypeError):  # a name IDNA cannot encode
            await self.close()
            raise ConfigError("--host", host, "is not a host name or address") from None
        except OSError as exc:
            await self.close()
            error = bind_error(exc, host, port, flag)
            if error is exc:
                raise
            raise error from None
        return runner.addresses[0][1]

    async def close(self) -> None:
        """Stop serving within config.shutdown_timeout: requests in flight get half of it to finish."""

        async def stop() -> None:
            for runner in (self._runner, self._metrics_runner):
                if runner is not None:
                    await runner.cleanup()
            await asyncio.gather(*self._storing, return_exceptions=True)  # each bounded by the Redis timeout

        try:
            # A hard bound as well: aiohttp rounds each of its waits up to a whole second. (wait_for, not
            # asyncio.timeout: that is Python 3.11's, and kcache runs on 3.10.)
            await asyncio.wait_for(stop(), self.config.shutdown_timeout)
        except (asyncio.TimeoutError, TimeoutError):  # two classes before Python 3.11
            log.warning("requests still in flight after the shutdown timeout (%g s) are cut off",
                        self.config.shutdown_timeout)  # fmt: skip
        await self.session.close()
        await self.cache.close()

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.cache.up  # noqa: B018 (refreshes the redis_up gauge: the back-off may have ended since)
        return web.Response(body=self.stats.render().encode(), headers={"Content-Type": metrics.CONTENT_TYPE})

    async def _any(self, request: web.Request) -> web.StreamResponse:
        if _engine_metrics(request):
            return await _metrics_elsewhere(request)
        started = time.perf_counter()
        if request.method == "POST" and request.path in key.CACHED_PATHS:
            return await self._completion(request, started)
        self.stats.requests["pass"] += 1
        body = request.content if request.body_exists else None
        return await self._forward(request, body, started, "pass")

    async def _completion(self, request: web.Request, started: float) -> web.StreamResponse:
        cfg = self.config
        raw, whole = await _read_at_most(request, cfg.max_request_bytes)
        if not whole:
            return await self._too_large(request, raw, started)
        query = key.query_pairs(request.rel_url.raw_query_string)
        # Parsing and keying up to max_request_bytes is a fraction of a second of CPU: a large body goes
        # to a worker thread, so the loop can go on with the Python parts of other requests in between.
        # A small one, nearly every request, is judged here: a thread hop costs more.
        judge = partial(self._judge, request.path, query, request.headers, raw)
        if len(raw) > _INLINE_BYTES:
            decision, links = await self._judged(judge)
        else:
            decision, links = judge()
        cache_key, reason = decision.key, decision.reason
        mac_key = entries.tenant_key(self._secret, decision.credentials) if cache_key is not None else b""
        if cache_key is not None:
            try:
                hit = await self.cache.get(cache_key, mac_key)
            except CacheUnavailable:
                cache_key, reason = None, "redis"
            else:
                if hit is not None:
                    return await self._replay(request, hit, started)
        if reason:
            self.stats.bypasses[reason] += 1
        outcome = "bypass" if cache_key is None else "miss"
        self.stats.requests[outcome] += 1
        if links is not None:
            see = partial(self.prefixes.see, links)
            seen = await asyncio.to_thread(see) if len(raw) > _INLINE_BYTES else see()
            self.stats.prompt_bytes += seen.total
            self.stats.prompt_seen_bytes += seen.seen
        slot = _Slot(cache_key, mac_key) if cache_key is not None else None
        return await self._forward(request, raw, started, outcome, slot)

    async def _judged(self, judge):
        """judge() on a worker thread, one at a time. The turn ends when the thread is done, not when the
        client leaves: a client that hung up mid-parse had let the next body be parsed beside its own."""
        await self._judging.acquire()
        job = asyncio.ensure_future(asyncio.to_thread(judge))
        job.add_done_callback(self._judged_done)
        return await asyncio.shield(job)  # cancelled (the client left): the thread and its turn run on

    def _judged_done(self, job: asyncio.Future) -> None:
        self._judging.release()
        if not job.cancelled():
            job.exception()  # retrieved: the handler that awaits it raises it, and one that was cancelled is gone

    def _judge(self, path: str, query, headers, raw: bytes) -> tuple[key.Decision, tuple | None]:
        """The request's Decision, without its parsed body, and the chain of its prompt (prefix.chain; None when
        it has none). The parsed body, up to ~30 times the raw one, ends here: within the turn of the one large
        body parsed at a time, not after the Redis lookup, the measurement or the engine's answer."""
        cfg = self.config
        decision = key.decide(path, query, headers, raw, cfg.fingerprint or "", off=self.off,
                              cache_sampled=cfg.cache_sampled, tenant_headers=self.tenant_headers)  # fmt: skip
        if decision.body is None:
            return decision, None
        return replace(decision, body=None), prefix.chain(cfg.fingerprint or "", path, decision.body)

    async def _too_large(self, request: web.Request, head: bytes, started: float) -> web.StreamResponse:
        """A body over max_request_bytes: forwarded as it arrives (what was read, then the rest), never parsed."""
        reason = "too_large"
        if self.off:
            reason = self.off  # decided before the body, as for a body that fits
        elif key.wants_bypass(request.headers):
            reason = "bypass_header"
        self.stats.bypasses[reason] += 1
        self.stats.requests["bypass"] += 1
        return await self._forward(request, _then(head, request.content), started, "bypass")

    async def _replay(self, request: web.Request, hit: entries.Entry, started: float) -> web.StreamResponse:
        self.stats.requests["hit"] += 1
        response = web.StreamResponse(status=hit.status, headers=_answer(hit.headers, "hit"))
        if not hit.stream:
            response.content_length = len(hit.body)
        try:
            await response.prepare(request)
            for piece in sse.batches(hit.body) if hit.stream else [hit.body]:
                await response.write(piece)  # runs of whole events: a write per event held the loop for seconds
            await response.write_eof()
            self.stats.hit_bytes += len(hit.body)
        except ConnectionResetError:
            pass  # the client left; nothing to clean up
        self.stats.added["hit"].observe(time.perf_counter() - started)
        return response

    async def _forward(self, request, body, started, outcome, slot=None) -> web.StreamResponse:
        # A multidict: a repeated header (two Authorization values) reaches the engine as the client sent it.
        dropped = NOT_FORWARDED | entries.connection_names(request.headers)
        headers = CIMultiDict((k, v) for k, v in request.headers.items() if k.lower() not in dropped)
        if body is not None and not isinstance(body, bytes) and request.content_length is not None:
            headers["Content-Length"] = str(request.content_length)  # streamed, but framed as the client framed it
        if slot is not None:
            headers.popall("Accept-Encoding", None)
            headers["Accept-Encoding"] = "identity"  # what is recorded must be replayable to any client
        clock = _Clock()
        # aiohttp labels a body without a Content-Type application/octet-stream, which FastAPI refuses where it
        # reads an unlabelled body as JSON: the engine must judge the request the client sent.
        unlabelled = () if "Content-Type" in headers else ("Content-Type",)

        def send():
            return clock.wait(self.session.request(request.method, self.upstream + request.rel_url.raw_path_qs,
                                                   headers=headers, data=body, allow_redirects=False,
                                                   skip_auto_headers=unlabelled))  # fmt: skip

        try:
            try:
                upstream = await send()
            except aiohttp.ServerDisconnectedError:
                if not isinstance(body, (bytes, type(None))):
                    raise  # a body streamed from the client cannot be sent twice
                # The engine closed a kept-alive connection, unanswered, as the request went out on it
                # (uvicorn's keep-alive, vLLM's and SGLang's, is 5 s; the pool keeps connections 15 s):
                # it served nothing, and a new connection gets the answer instead of a 502.
                upstream = await send()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as exc:
            self.stats.added[outcome].observe(time.perf_counter() - started - clock.waited)
            return self._unreachable(exc, outcome)
        if self._upstream_down:
            self._upstream_down = False
            log.info("upstream %s answers again", redact_url(self.upstream))
        async with upstream:
            response = await self._relay(request, upstream, outcome, slot, clock)
        self.stats.added[outcome].observe(time.perf_counter() - started - clock.waited)
        return response

    def _unreachable(self, exc: BaseException, outcome: str) -> web.Response:
        """The 502 for an engine that did not answer. X-Kcache-Cache says what the cache did, as on any
        other answer and as the request was counted: pass on a path it never answers, miss, or bypass.
        Warned about once until the engine answers again: one that restarts under load is one event,
        not a line per request."""
        upstream = redact_url(self.upstream)  # the answer goes to any client, the log to anyone who reads it
        level = logging.DEBUG if self._upstream_down else logging.WARNING
        self._upstream_down = True
        log.log(level, "upstream %s: %s", upstream, redact_text(str(exc)))
        doc = {"error": {"message": f"kcache proxy: upstream {upstream} did not answer ({type(exc).__name__})",
                         "type": "upstream_unreachable", "code": 502}}  # fmt: skip
        return web.json_response(doc, status=502, headers={CACHE_HEADER: outcome})

    async def _relay(self, request, upstream, outcome, slot, clock) -> web.StreamResponse:
        """Copy the upstream answer chunk by chunk, recording it when it may be cached."""
        answer = (entries.answer_headers if slot is not None else entries.passed_headers)(upstream.headers)
        response = web.StreamResponse(status=upstream.status, headers=_answer(answer, outcome))
        if upstream.content_length is not None:
            response.content_length = upstream.content_length  # raw bytes: auto_decompress is off
        if "Content-Encoding" in upstream.headers:
            response.headers["Content-Encoding"] = upstream.headers["Content-Encoding"]
        encoded = upstream.headers.get("Content-Encoding", "identity").lower() != "identity"
        recording = bytearray() if slot is not None and not encoded else None  # ignored our identity ask
        try:
            await response.prepare(request)
            while chunk := await clock.wait(upstream.content.readany()):
                await response.write(chunk)
                if recording is not None:
                    recording += chunk
                    if len(recording) > self.config.max_entry_bytes:
                        recording = None
                        self.stats.not_stored["too_large"] += 1
        except ConnectionResetError:
            if recording is not None:
                self.stats.not_stored["client_gone"] += 1
            return response
        except asyncio.CancelledError:  # the client hung up (handler_cancellation)
            if recording is not None:
                self.stats.not_stored["client_gone"] += 1
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # the engine broke off mid-answer
            log.warning("upstream broke off an answer: %s", exc)
            if recording is not None:
                self.stats.not_stored["upstream_error"] += 1
            if request.transport is not None:  # a clean end would tell the client the answer is whole
                request.transport.abort()
            return response
        if recording is not None:  # shielded: a client gone after the last byte must not cost the entry
            store = asyncio.ensure_future(self._store(slot, upstream.status, answer, bytes(recording)))
            self._storing.add(store)
            store.add_done_callback(self._storing.discard)
            try:
                await asyncio.shield(store)
            except Exception:  # whatever storing hit, the client's answer is whole and must end as such
                log.exception("could not store an answer")
                self.stats.not_stored["error"] += 1
        await response.write_eof()
        return response

    async def _store(self, slot: _Slot, status: int, headers, body: bytes) -> None:
        reason = entries.storable(status, headers, body)
        answer = entries.Entry(200, headers, body, entries.is_event_stream(headers))
        raw = b""
        if not reason:
            raw = entries.encode(answer, name=self.cache.name(slot.key), mac_key=slot.mac_key,
                                 expires_ms=self.cache.expiry_ms())  # fmt: skip
        if not reason and len(raw) > self.config.max_entry_bytes:
            reason = "too_large"
        if reason:
            self.stats.not_stored[reason] += 1
            return
        try:
            await self.cache.put(slot.key, raw)
        except CacheUnavailable:
            self.stats.not_stored["redis"] += 1
            return
        self.stats.stored_bytes += len(raw)


async def _read_at_most(request: web.Request, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the body, and whether that is all of it."""
    if request.content_length is not None and request.content_length > limit:
        return b"", False  # said so up front: nothing read, nothing held
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await request.content.read(limit + 1 - len(buf))
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf), False


async def _then(head: bytes, rest: aiohttp.StreamReader):
    """`head`, then what is left of `rest`, chunk by chunk as it arrives."""
    if head:
        yield head
    while chunk := await rest.readany():
        yield chunk


@dataclass(frozen=True)
class _Slot:
    """Where an answer is filed: its request key, and the key that tags its tenant's entries."""

    key: str
    mac_key: bytes = field(repr=False)


class _Clock:
    """Adds up the time spent waiting on the upstream, to subtract it from what the proxy added."""

    def __init__(self):
        self.waited = 0.0

    async def wait(self, awaitable):
        t = time.perf_counter()
        try:
            return await awaitable
        finally:
            self.waited += time.perf_counter() - t


def _answer(headers: tuple[tuple[str, str], ...], outcome: str) -> CIMultiDict:
    out = CIMultiDict(headers)
    out[CACHE_HEADER] = outcome
    return out


def _engine_metrics(request: web.Request) -> bool:
    """Whether the engine may read this path as its /metrics. vLLM and SGLang mount their Prometheus app at
    ^/metrics(.*)$, so /metrics/, /metricsX and /metrics/x are its counters too, and the path is matched
    as the engine reads it: percent-decoded (uvicorn), after the proxy's client has resolved its dot
    segments (/v1/../metrics/); leading slashes are ignored (some servers collapse them)."""
    forwarded = yarl.URL("http://engine" + request.rel_url.raw_path).raw_path  # what self.session sends
    forms = (request.path, urllib.parse.unquote(request.rel_url.raw_path), urllib.parse.unquote(forwarded))
    return any(form.lstrip("/").startswith("metrics") for form in forms)


async def _metrics_elsewhere(_request: web.Request) -> web.Response:
    doc = {"error": {"message": "kcache proxy: /metrics is on the proxy's metrics port (--metrics-port), "
                                "not on this one", "type": "not_found", "code": 404}}  # fmt: skip
    return web.json_response(doc, status=404, headers={CACHE_HEADER: "pass"})


def _site(runner: web.AppRunner, host: str, port: int) -> web.BaseSite:
    """Where `runner` listens. "::" takes IPv4 too, as `kcache serve`'s does: asyncio's own socket for it is
    IPv6 only, and in a dual-stack cluster the kubelet and the pod's clients come over IPv4."""
    if _unspecified_ipv6(host) and socket.has_dualstack_ipv6():
        listener = socket.create_server((host, port), family=socket.AF_INET6, backlog=128, dualstack_ipv6=True)
        return web.SockSite(runner, listener)
    return web.TCPSite(runner, host, port)


def _unspecified_ipv6(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.version == 6 and address.is_unspecified


async def serve(config: ProxyConfig, host: str, port: int, metrics_port: int, on_ready, stop: asyncio.Event) -> None:
    """Run until `stop` is set; `on_ready(port, metrics_port)` is called once both ports are bound."""
    proxy = Proxy(config)
    bound = await proxy.start(host, port, metrics_port)
    try:
        on_ready(bound, proxy.metrics_port)
        await stop.wait()
    finally:
        await proxy.close()
