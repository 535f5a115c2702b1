"""kcache proxy against real Redis and a real OpenAI-compatible server (tests/engine_server.py)."""

import asyncio
import gc
import hashlib
import hmac
import http.client
import json
import logging
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import redis
from click.testing import CliRunner
from engine_server import SSE_TYPE, EngineServer
from proxied import PrivateRedis, RunningProxy, free_port, metric, metrics_port_of, request
from served import kcache_server

from kcache import fingerprint
from kcache.cli import main
from kcache.errors import CacheUnavailable
from kcache.proxy import entry, key, sse
from kcache.proxy.cache import FAILURES_TO_SKIP, ResultCache
from kcache.proxy.server import ProxyConfig
from kcache.proxy.stats import Stats
from kcache.readiness import RESTORE_MARKER, write_marker

REDIS_URL = "redis://127.0.0.1:6379/0"
FP = "0123456789abcdef0123456789abcdef"
CHAT = "/v1/chat/completions"
ASK = {"model": "tiny-test-model", "temperature": 0, "max_tokens": 3,
       "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
SENT_AS_JSON = {"Content-Type": "application/json"}


@pytest.fixture
def prefix():
    """A key prefix of this test's own in the shared Redis, deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.fail("Redis is not answering on 127.0.0.1:6379 (scripts/test starts it)")
    name = f"kcache-test:{uuid.uuid4().hex}:"
    yield name
    keys = list(client.scan_iter(name + "*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def engine():
    with EngineServer() as server:
        yield server


SECRET = b"the proxy tests' entry secret, 32+ bytes"


def config(upstream: str, prefix: str, **kw) -> ProxyConfig:
    return ProxyConfig(upstream=upstream, redis_url=kw.pop("redis_url", REDIS_URL), fingerprint=kw.pop("fp", FP),
                       key_prefix=prefix, redis_timeout=kw.pop("redis_timeout", 2.0),
                       entry_secret=kw.pop("entry_secret", SECRET), **kw)  # fmt: skip


def sealed(answer: entry.Entry, name: str, credentials=()) -> bytes:
    """`answer` as a proxy holding SECRET stores it under the Redis key `name` for that tenant, for a minute."""
    return entry.encode(answer, name=name, mac_key=entry.tenant_key(SECRET, credentials),
                        expires_ms=int(time.time() * 1000) + 60_000)  # fmt: skip


def opened(raw: bytes, name: str, credentials=()) -> entry.Entry:
    return entry.decode(raw, max_bytes=1 << 20, name=name, mac_key=entry.tenant_key(SECRET, credentials),
                        now_ms=int(time.time() * 1000))  # fmt: skip


@pytest.fixture
def proxy(engine, prefix):
    with RunningProxy(config(engine.url, prefix)) as running:
        yield running


def test_a_deterministic_request_is_answered_from_the_cache(proxy, engine):
    first, second = proxy.post(CHAT, ASK), proxy.post(CHAT, ASK)
    assert (first.status, first.headers["x-kcache-cache"]) == (200, "miss")
    assert (second.status, second.headers["x-kcache-cache"]) == (200, "hit")
    assert second.body == first.body == engine.sent[0] and len(engine.completions) == 1
    assert second.headers["content-type"] == first.headers["content-type"] == "application/json"
    assert second.headers["content-length"] == str(len(first.body))
    assert proxy.metric("kcache_proxy_requests_total", outcome="hit") == 1
    assert proxy.metric("kcache_proxy_requests_total", outcome="miss") == 1
    assert proxy.metric("kcache_proxy_hit_bytes_total") == len(first.body)
    assert proxy.metric("kcache_proxy_stored_bytes_total") > len(first.body)
    assert proxy.metric("kcache_proxy_added_seconds_count", outcome="hit") == 1


def test_non_semantic_fields_and_key_order_do_not_miss(proxy, engine):
    proxy.post(CHAT, ASK)
    reordered = dict(reversed(list({**ASK, "temperature": 0.0, "user": "someone-else"}.items())))
    assert proxy.post(CHAT, reordered).headers["x-kcache-cache"] == "hit"
    assert len(engine.completions) == 1


def test_one_tenant_never_gets_another_tenants_answer(proxy, engine):
    alice = proxy.post(CHAT, ASK, {"Authorization": "Bearer alice"})
    bob = proxy.post(CHAT, ASK, {"Authorization": "Bearer bob"})
    anonymous = proxy.post(CHAT, ASK)
    assert [r.headers["x-kcache-cache"] for r in (alice, bob, anonymous)] == ["miss"] * 3
    assert len({alice.body, bob.body, anonymous.body}) == 3  # each answer carries its own engine id
    again = proxy.post(CHAT, ASK, {"Authorization": "Bearer alice"})
    assert again.headers["x-kcache-cache"] == "hit" and again.body == alice.body
    assert engine.headers[0]["Authorization"] == "Bearer alice"  # the credential still reaches the engine


def test_a_new_fingerprint_misses_and_the_old_one_still_hits(engine, prefix):
    with RunningProxy(config(engine.url, prefix, fp=FP)) as old:
        old.post(CHAT, ASK)
    with RunningProxy(config(engine.url, prefix, fp="f" * 32)) as new:
        assert new.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"
    with RunningProxy(config(engine.url, prefix, fp=FP)) as old_again:
        assert old_again.post(CHAT, ASK).headers["x-kcache-cache"] == "hit"
    assert len(engine.completions) == 2


@pytest.mark.parametrize("change, reason", [
    ({"temperature": 0.8}, "sampling"),
    ({"temperature": None}, "sampling"),
    ({"n": 2}, "n"),
])  # fmt: skip
def test_non_deterministic_requests_bypass_the_cache(proxy, engine, change, reason):
    body = {k: v for k, v in {**ASK, **change}.items() if v is not None}
    replies = [proxy.post(CHAT, body) for _ in range(2)]
    assert [r.headers["x-kcache-cache"] for r in replies] == ["bypass", "bypass"]
    assert len(engine.completions) == 2 and replies[0].body != replies[1].body
    assert proxy.metric("kcache_proxy_bypasses_total", reason=reason) == 2


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_never_gets_the_json_requests_answer(proxy, engine, content_type):
    """vLLM answers 400 to a body that is not sent as application/json (FastAPI alone: 422 to text/plain); the
    key did not hold the Content-Type, so the same bytes sent as text/plain got the cached 200."""
    assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        conn.putrequest("POST", CHAT)
        body = json.dumps(ASK).encode()
        if content_type is not None:
            conn.putheader("Content-Type", content_type)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        reply = conn.getresponse()
        reply.read()
    finally:
        conn.close()
    assert reply.getheader("x-kcache-cache") == "bypass" and len(engine.completions) == 2
    assert proxy.metric("kcache_proxy_bypasses_total", reason="content_type") == 1


def test_a_priority_the_engine_refuses_never_gets_the_answer_without_it(proxy, engine):
    """vLLM answers 400 to `priority: 5` unless started with --scheduling-policy priority; the key left priority
    out, so such a request got the 200 answered to the same request without it."""
    assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"
    refused = proxy.post(CHAT, {**ASK, "priority": 5})
    assert (refused.status, refused.headers["x-kcache-cache"]) == (400, "miss") and len(engine.completions) == 2
    assert proxy.post(CHAT, {**ASK, "priority": 0}).headers["x-kcache-cache"] == "hit"


def test_an_image_the_engine_fetches_is_fetched_for_every_request(proxy, engine):
    """The image behind a URL may change, and the cached answer described the old one."""
    part = {"type": "image_url", "image_url": {"url": "https://example.com/cam/latest.jpg"}}
    ask = {**ASK, "messages": [{"role": "user", "content": [{"type": "text", "text": "what now?"}, part]}]}
    replies = [proxy.post(CHAT, ask) for _ in range(2)]
    assert [r.headers["x-kcache-cache"] for r in replies] == ["bypass", "bypass"] and len(engine.completions) == 2
    assert proxy.metric("kcache_proxy_bypasses_total", reason="remote_input") == 2


@pytest.mark.parametrize("path", [CHAT, "/v1/other"])
def test_a_body_without_a_content_type_reaches_the_engine_without_one(proxy, engine, path):
    """The proxy's HTTP client labelled such a body application/octet-stream, which FastAPI (SGLang) refuses
    (422) where it reads a body without a Content-Type as JSON: the engine judged another request."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
    try:
        body = json.dumps(ASK).encode()
        conn.putrequest("POST", path)
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        conn.getresponse().read()
    finally:
        conn.close()
    assert "Content-Type" not in engine.headers[-1]


def test_a_fixed_seed_makes_sampling_cacheable(proxy, engine):
    body = {**ASK, "temperature": 0.8, "seed": 42}
    assert [proxy.post(CHAT, body).headers["x-kcache-cache"] for _ in range(2)] == ["miss", "hit"]


def test_a_seed_of_minus_one_is_no_seed(proxy, engine):
    """vLLM reads `seed: -1` as no seed (SamplingParams sets it to None): such a request samples afresh each
    time, yet it was cached, and every client got the first sample."""
    body = {**ASK, "temperature": 0.8, "seed": -1}
    replies = [proxy.post(CHAT, body) for _ in range(2)]
    assert [r.headers["x-kcache-cache"] for r in replies] == ["bypass", "bypass"]
    assert [r.body for r in replies] == engine.sent and len(engine.completions) == 2
    assert proxy.metric("kcache_proxy_bypasses_total", reason="sampling") == 2


def test_the_bypass_header_skips_the_cache_and_stays_with_the_proxy(proxy, engine):
    proxy.post(CHAT, ASK)
    reply = proxy.post(CHAT, ASK, {"X-Kcache-Bypass": "1"})
    assert reply.headers["x-kcache-cache"] == "bypass" and reply.body != engine.sent[0]
    assert "X-Kcache-Bypass" not in engine.headers[-1]
    assert proxy.metric("kcache_proxy_bypasses_total", reason="bypass_header") == 1


def test_no_cache_forwards_everything(engine, prefix):
    with RunningProxy(config(engine.url, prefix, enabled=False)) as off:
        assert [off.post(CHAT, ASK).headers["x-kcache-cache"] for _ in range(2)] == ["bypass", "bypass"]
        assert off.metric("kcache_proxy_bypasses_total", reason="disabled") == 2


def test_a_stream_is_replayed_byte_for_byte(proxy, engine):
    streamed = {**ASK, "stream": True}
    first, second = proxy.post(CHAT, streamed), proxy.post(CHAT, streamed)
    assert [first.headers["x-kcache-cache"], second.headers["x-kcache-cache"]] == ["miss", "hit"]
    assert first.body == engine.sent[0] and second.body == engine.sent[0] and len(engine.completions) == 1
    assert first.headers["content-type"] == second.headers["content-type"] == SSE_TYPE
    assert second.headers.get("transfer-encoding") == first.headers.get("transfer-encoding") == "chunked"
    events = [e for e in second.body.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and len(events) == ASK["max_tokens"] + 1
    assert json.loads(events[0][len(b"data: ") :])["choices"][0]["delta"] == {"content": " t0"}
    # The same request without `stream` is another answer, in another format.
    assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"


def chunks(port: int, path: str, doc: dict) -> list[bytes]:
    """The chunks of a chunked answer, as framed on the wire (http.client would join them)."""
    body = json.dumps(doc).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
        raw = b"".join(iter(lambda: conn.recv(1 << 16), b""))
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    found = []
    while True:
        size, _, rest = rest.partition(b"\r\n")
        if int(size, 16) == 0:
            return found
        found.append(rest[: int(size, 16)])
        rest = rest[int(size, 16) + 2 :]


def test_a_replayed_stream_is_written_in_pieces_of_whole_events(proxy, engine):
    """A hit was written one event at a time without yielding: a cached stream of 2-byte events held every
    other client of the proxy for seconds."""
    streamed = {**ASK, "stream": True, "max_tokens": 400}
    proxy.post(CHAT, streamed)
    pieces = chunks(proxy.port, CHAT, streamed)
    assert b"".join(pieces) == engine.sent[0] and len(engine.completions) == 1
    assert all(len(p) >= sse.MIN_WRITE_BYTES for p in pieces[:-1]) and len(pieces) > 1
    assert all(p.endswith(b"\n\n") for p in pieces)  # each a run of whole events, as the engine sent them


def test_a_stream_that_reports_an_error_is_not_cached(prefix):
    with EngineServer(error_mid_stream=True) as broken, RunningProxy(config(broken.url, prefix)) as proxy:
        replies = [proxy.post(CHAT, {**ASK, "stream": True}) for _ in range(2)]
        assert [r.status for r in replies] == [200, 200] and replies[0].body == broken.sent[0]
        assert len(broken.completions) == 2
        assert proxy.metric("kcache_proxy_not_stored_total", reason="upstream_error") == 2


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_the_engine_aborted_is_passed_on_and_never_cached(prefix, stream):
    """SGLang ends an answer aborted gracefully (/abort_request, a session closed) as a 200 with the tokens it
    had so far and finish_reason "abort", a stream with `data: [DONE]` after it: cached, every client got the
    cut-off answer until --ttl ran out."""
    with EngineServer(abort=True) as aborting, RunningProxy(config(aborting.url, prefix)) as proxy:
        replies = [proxy.post(CHAT, {**ASK, "stream": stream}) for _ in range(2)]
        assert [(r.status, r.headers["x-kcache-cache"]) for r in replies] == [(200, "miss")] * 2
        assert [r.body for r in replies] == aborting.sent and len(aborting.completions) == 2
        assert proxy.metric("kcache_proxy_not_stored_total", reason="upstream_error") == 2


def test_an_upstream_500_is_passed_on_and_never_cached(prefix):
    with EngineServer(fail_status=500) as failing, RunningProxy(config(failing.url, prefix)) as proxy:
        replies = [proxy.post(CHAT, ASK) for _ in range(2)]
        assert [r.status for r in replies] == [500, 500]
        assert replies[0].json()["error"]["message"] == "engine exploded"
        assert len(failing.completions) == 2
        assert proxy.metric("kcache_proxy_not_stored_total", reason="upstream_error") == 2
        failing.fail_status = None  # the engine recovers: its first good answer is the one cached
        assert [proxy.post(CHAT, ASK).headers["x-kcache-cache"] for _ in range(2)] == ["miss", "hit"]


def test_an_answer_over_the_size_limit_is_forwarded_not_stored(engine, prefix):
    with RunningProxy(config(engine.url, prefix, max_entry_bytes=300)) as proxy:
        body = {**ASK, "max_tokens": 200}
        replies = [proxy.post(CHAT, body) for _ in range(2)]
        assert [r.headers["x-kcache-cache"] for r in replies] == ["miss", "miss"]
        assert replies[0].body == engine.sent[0] and len(replies[0].body) > 300
        assert proxy.metric("kcache_proxy_not_stored_total", reason="too_large") == 2


def test_a_tampered_entry_is_a_miss_and_is_replaced(proxy, engine, prefix):
    proxy.post(CHAT, ASK)
    client = redis.Redis.from_url(REDIS_URL)
    (name,) = client.scan_iter(prefix + "*")
    good = client.get(name)
    client.set(name, good[:-34] + b"!" + good[-33:], keepttl=True)  # the body no longer matches its tag
    reply = proxy.post(CHAT, ASK)
    assert reply.headers["x-kcache-cache"] == "miss" and reply.body == engine.sent[1]
    assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1
    assert opened(client.get(name), name.decode()).body == engine.sent[1]
    assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "hit"


def _tagged(signed: bytes, name: str) -> bytes:
    """`signed` with the tag a proxy holding SECRET gives it: a value only a holder of the key can make."""
    mac = hmac.new(entry.tenant_key(SECRET, []), b"%d:%s" % (len(name), name.encode()), hashlib.sha256)
    mac.update(signed)
    return signed + mac.digest()


ANSWER = json.dumps({"choices": [{"message": {"content": "cached"}}]}).encode()
ASK_KEY = key.decide(CHAT, [], SENT_AS_JSON, json.dumps(ASK).encode(), FP).key


@pytest.mark.parametrize("value", [
    lambda name: _tagged(entry.MAGIC + b"[" * 200_000 + b"\n" + ANSWER, name),  # nested past the parser's limit
    lambda name: _tagged(entry.MAGIC + b'{"expires": %d, "headers": [["X-A", "\\ud800"]], "status": 200, '
                         b'"stream": false}\n' % (time.time() * 1000 + 60_000) + ANSWER, name),  # fmt: skip
    lambda name: sealed(entry.Entry(200, (("Content-Type", "application/json"),), ANSWER + b" " * 5000, False),
                        name),  # too big
], ids=["nested", "surrogate", "too-big"])  # fmt: skip
def test_a_hostile_entry_is_a_miss_and_is_replaced(engine, prefix, value):
    client = redis.Redis.from_url(REDIS_URL)
    client.set(prefix + ASK_KEY, value(prefix + ASK_KEY), px=60_000)
    with RunningProxy(config(engine.url, prefix, max_entry_bytes=4096)) as proxy:
        reply = proxy.post(CHAT, ASK)
        assert (reply.status, reply.headers["x-kcache-cache"], reply.body) == (200, "miss", engine.sent[0])
        assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1
        assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "hit"


def test_an_entry_over_the_size_limit_is_not_read_whole(engine, prefix, tmp_path):
    private = PrivateRedis(tmp_path)
    try:
        client = redis.Redis.from_url(private.url)
        huge = sealed(entry.Entry(200, (("Content-Type", "application/json"),), b" " * (4 << 20), False),
                      prefix + ASK_KEY)  # fmt: skip
        client.set(prefix + ASK_KEY, huge, px=60_000)
        with RunningProxy(config(engine.url, prefix, redis_url=private.url, max_entry_bytes=4096)) as proxy:
            before = client.info("stats")["total_net_output_bytes"]
            assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"
            sent = client.info("stats")["total_net_output_bytes"] - before
            assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1
        assert sent < 64 << 10  # the first INFO's reply and a bounded prefix of the value, not 4 MiB
    finally:
        private.close()


NO_CANONICAL_FORM = [
    b'{"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate
    b'{"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}], "top_p": 1e400}',  # inf
]


@pytest.mark.parametrize("raw", NO_CANONICAL_FORM)
@pytest.mark.parametrize("temperature, headers, enabled, reason", [
    (b"0", {}, True, "not_json"),
    (b"0.7", {}, True, "not_json"),
    (b"0", {"X-Kcache-Bypass": "1"}, True, "bypass_header"),
    (b"0.7", {"X-Kcache-Bypass": "1"}, True, "bypass_header"),
    (b"0", {}, False, "disabled"),
])  # fmt: skip
def test_a_body_without_a_canonical_form_is_forwarded_unchanged(engine, prefix, raw, temperature, headers, enabled,
                                                               reason):  # fmt: skip
    raw = raw.replace(b'"temperature": 0', b'"temperature": ' + temperature)
    with RunningProxy(config(engine.url, prefix, enabled=enabled)) as proxy:
        replies = [request(proxy.port, "POST", CHAT, raw, headers) for _ in range(2)]
        assert [(r.status, r.headers["x-kcache-cache"]) for r in replies] == [(200, "bypass")] * 2
        assert [r.body for r in replies] == engine.sent and len(engine.completions) == 2
        assert engine.completions[0] == json.loads(raw)
        assert proxy.metric("kcache_proxy_bypasses_total", reason=reason) == 2


def test_metrics_are_served_on_their_own_port_not_to_clients(proxy, engine):
    """On the client port, /metrics told any client whether another tenant had sent a prompt: the seen-prefix
    counter moves when a prompt someone sent before comes again. Nor is the engine's own /metrics passed on
    (vLLM's prefix-cache hit counters would tell the same)."""
    proxy.post(CHAT, ASK)
    on_client_port = proxy.get("/metrics")
    assert on_client_port.status == 404 and b"kcache_proxy" not in on_client_port.body
    assert "the proxy's metrics port" in on_client_port.json()["error"]["message"]  # the proxy's, not the engine's
    text = request(proxy.metrics_port, "GET", "/metrics").body.decode()
    assert metric(text, "kcache_proxy_requests_total", outcome="miss") == 1
    assert request(proxy.metrics_port, "POST", CHAT, json.dumps(ASK).encode()).status == 404  # metrics only


def test_other_paths_pass_through(proxy, engine):
    models = proxy.get("/v1/models")
    assert models.status == 200 and models.json()["data"][0]["id"] == EngineServer.MODEL
    assert proxy.get("/health").status == 200 and engine.health_checks == 1
    assert proxy.get("/nope").status == 404
    assert proxy.metric("kcache_proxy_requests_total", outcome="pass") == 3


def test_an_unreachable_upstream_is_a_502_in_openai_shape(prefix):
    with RunningProxy(config(f"http://127.0.0.1:{free_port()}", prefix)) as proxy:
        reply = proxy.post(CHAT, ASK)
        assert reply.status == 502 and reply.json()["error"]["type"] == "upstream_unreachable"


@pytest.mark.parametrize(("method", "path", "headers", "outcome"), [
    ("GET", "/v1/models", {}, "pass"),
    ("GET", "/health", {}, "pass"),
    ("POST", CHAT, {}, "miss"),
    ("POST", CHAT, {key.BYPASS_HEADER: "1"}, "bypass"),
])  # fmt: skip
def test_an_unreachable_upstreams_502_names_what_the_cache_did(prefix, method, path, headers, outcome):
    """Every 502 said `X-Kcache-Cache: bypass`, for /v1/models and /health as well, which the cache never
    answers (counted as pass), and for a cacheable request that missed (counted as miss)."""
    with RunningProxy(config(f"http://127.0.0.1:{free_port()}", prefix)) as proxy:
        body = json.dumps(ASK).encode() if method == "POST" else None
        reply = request(proxy.port, method, path, body, headers)
        assert reply.status == 502 and reply.json()["error"]["type"] == "upstream_unreachable"
        assert reply.headers["x-kcache-cache"] == outcome
        assert proxy.metric("kcache_proxy_requests_total", outcome=outcome) == 1


def test_an_unreachable_upstream_is_warned_about_once_until_it_answers_again(prefix, caplog):
    """Every request to an engine that did not answer logged the same warning: an engine restarting
    under load filled the proxy's log with one line per request."""
    port = free_port()
    upstream = f"http://127.0.0.1:{port}"
    with caplog.at_level(logging.DEBUG, logger="kcache"), RunningProxy(config(upstream, prefix)) as proxy:
        assert [proxy.get("/health").status for _ in range(3)] == [502] * 3
        with EngineServer(port=port) as engine:
            assert proxy.get("/health").status == 200 and engine.health_checks == 1
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kcache.proxy.server"]
    assert [level for level, _ in said] == [logging.WARNING, logging.DEBUG, logging.DEBUG, logging.INFO], said
    assert all(upstream in message for _, message in said), said
    assert "answers again" in said[-1][1]


def test_an_unreachable_upstreams_password_reaches_no_client(prefix):
    with RunningProxy(config(f"http://admin:Zq9Secret@127.0.0.1:{free_port()}", prefix)) as proxy:
        reply = proxy.post(CHAT, ASK)
        assert reply.status == 502 and "Zq9Secret" not in reply.body.decode() and "***" in reply.body.decode()


@pytest.mark.parametrize("upstream", ["notaurl", "ftp://127.0.0.1:9", "http://", "http://127.0.0.1:99999"])
def test_cli_refuses_an_upstream_that_is_no_http_url(upstream):
    result = CliRunner().invoke(main, ["proxy", "--upstream", upstream, "--redis", "redis://127.0.0.1:9",
                                       "--port", "0", "--model", "m", "--json"])  # fmt: skip
    assert result.exit_code == 2 and "--upstream" in result.output, result.output


def test_prefix_reuse_is_measured_on_what_reaches_the_engine(proxy):
    system = {"role": "system", "content": "You answer in one word. " * 20}
    turn1 = {**ASK, "temperature": 0.7, "messages": [system, {"role": "user", "content": "a"}]}
    turn2 = {**turn1, "messages": turn1["messages"] + [{"role": "assistant", "content": "b"},
                                                       {"role": "user", "content": "c"}]}  # fmt: skip
    proxy.post(CHAT, turn1)
    proxy.post(CHAT, turn2)
    size = [len(json.dumps(m, separators=(",", ":")).encode()) for m in turn2["messages"]]
    assert proxy.metric("kcache_proxy_prompt_bytes_total") == sum(size[:2]) + sum(size)
    assert proxy.metric("kcache_proxy_prompt_seen_bytes_total") == sum(size[:2])
    ratio = proxy.metric("kcache_proxy_prefix_seen_ratio")
    assert ratio == pytest.approx(sum(size[:2]) / (sum(size[:2]) + sum(size)))


def test_redis_stopped_or_killed_mid_run_means_pass_through(engine, prefix, tmp_path):
    private = PrivateRedis(tmp_path)
    try:
        cfg = config(engine.url, prefix, redis_url=private.url, redis_timeout=0.2, retry_after=0)
        with RunningProxy(cfg) as proxy:
            assert [proxy.post(CHAT, ASK).headers["x-kcache-cache"] for _ in range(2)] == ["miss", "hit"]
            private.pause()  # alive, accepting, silent: the bounded timeout is what answers
            slow = proxy.post(CHAT, ASK)
            private.resume()
            private.kill()
            dead = [proxy.post(CHAT, ASK), proxy.post(CHAT, {**ASK, "max_tokens": 2})]
            assert [r.status for r in [slow, *dead]] == [200, 200, 200]
            assert [r.headers["x-kcache-cache"] for r in [slow, *dead]] == ["bypass"] * 3
            assert slow.body == engine.sent[1] and dead[0].body == engine.sent[2]
            assert proxy.metric("kcache_proxy_redis_errors_total", kind="timeout") == 1
            assert proxy.metric("kcache_proxy_redis_errors_total", kind="error") == 2
            assert proxy.metric("kcache_proxy_bypasses_total", reason="redis") == 3
    finally:
        private.close()


def accept_queue(port: int) -> int:
    """Connections made to the listener on 127.0.0.1:`port` that its process has not accepted yet: while
    that process is stopped (SIGSTOP), every connection opened to it since, closed ones too."""
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state, queues = line.split()[1], line.split()[3], line.split()[4]
            if local == f"0100007F:{port:04X}" and state == "0A":  # 0A: LISTEN; rx_queue is the accept queue
                return int(queues.split(":")[1], 16)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def wait_for(condition, timeout: float = 60) -> None:
    """Return once `condition()` holds; fail the test after `timeout` seconds (a hang, not slowness)."""
    done, deadline = threading.Event(), time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        done.wait(0.01)


def test_a_slow_redis_gets_no_more_connections_than_the_cap(engine, prefix, tmp_path):
    """The connection pool was unbounded: with Redis slow, every lookup in flight opened a connection of its
    own, as many as there were clients. At most --redis-connections are open now; a lookup waits for one
    (within --redis-timeout), and those that waited reuse the connections once Redis answers."""
    private = PrivateRedis(tmp_path)
    try:
        observer = redis.Redis(port=private.port)
        before = observer.info("stats")["total_connections_received"]
        cfg = config(engine.url, prefix, redis_url=private.url, redis_timeout=60, redis_connections=2)
        asks = [{**ASK, "max_tokens": tokens} for tokens in range(1, 9)]  # eight different requests, at once
        with RunningProxy(cfg) as proxy, ThreadPoolExecutor(len(asks)) as clients:
            private.pause()
            try:
                replies = [clients.submit(proxy.post, CHAT, ask) for ask in asks]
                wait_for(lambda: accept_queue(private.port) + proxy.metric("kcache_proxy_redis_waiting") >= len(asks))
                opened = accept_queue(private.port)
            finally:
                private.resume()
            assert opened == 2, "one connection a lookup in flight, past the cap"
            assert [r.result(timeout=60).headers["x-kcache-cache"] for r in replies] == ["miss"] * len(asks)
            assert proxy.metric("kcache_proxy_bypasses_total", reason="redis") == 0
            wait_for(lambda: proxy.metric("kcache_proxy_redis_waiting") == 0)  # the last writes, after the answers
        assert observer.info("stats")["total_connections_received"] - before == 2  # the waiters reused them
    finally:
        private.close()


def test_lookups_that_wait_for_a_connection_to_a_stopped_redis_are_served_by_the_engine(engine, prefix, tmp_path):
    """One connection, Redis stopped, six clients at once: each is answered by the engine within its
    --redis-timeout, none fails or hangs, and once Redis is skipped the lookups still waiting open no
    connection of their own (each did: one per client). Whether a lookup runs out of time waiting
    (busy) or on its connection (a timeout) depends on the order they arrive in."""
    private = PrivateRedis(tmp_path)
    try:
        cfg = config(engine.url, prefix, redis_url=private.url, redis_timeout=1, retry_after=3600,
                     redis_connections=1)  # fmt: skip
        asks = [{**ASK, "max_tokens": tokens} for tokens in range(1, 7)]
        with RunningProxy(cfg) as proxy, ThreadPoolExecutor(len(asks)) as clients:
            private.pause()
            try:
                replies = [r.result(timeout=60) for r in [clients.submit(proxy.post, CHAT, ask) for ask in asks]]
                opened = accept_queue(private.port)
            finally:
                private.resume()
            assert [(r.status, r.headers["x-kcache-cache"]) for r in replies] == [(200, "bypass")] * len(asks)
            assert sorted(r.body for r in replies) == sorted(engine.sent)
            assert proxy.metric("kcache_proxy_bypasses_total", reason="redis") == len(asks)
            assert 1 <= opened <= FAILURES_TO_SKIP  # each a timeout; then Redis is skipped, even by those waiting
    finally:
        private.close()


def test_after_a_failure_redis_is_skipped_for_a_while(engine, prefix, tmp_path):
    private = PrivateRedis(tmp_path)
    try:
        with RunningProxy(config(engine.url, prefix, redis_url=private.url, retry_after=3600)) as proxy:
            assert proxy.metric("kcache_proxy_redis_up") == 1
            private.kill()
            replies = [proxy.post(CHAT, ASK) for _ in range(FAILURES_TO_SKIP + 2)]
            assert [r.status for r in replies] == [200] * (FAILURES_TO_SKIP + 2)
            assert proxy.metric("kcache_proxy_redis_errors_total", kind="error") == FAILURES_TO_SKIP  # then skipped
            assert proxy.metric("kcache_proxy_redis_up") == 0
            assert proxy.metric("kcache_proxy_bypasses_total", reason="redis") == FAILURES_TO_SKIP + 2
    finally:
        private.close()


def test_a_full_redis_still_answers_what_it_holds(engine, prefix, tmp_path):
    """Redis at maxmemory under noeviction (its default policy; or volatile-* with a writer's keys that never
    expire) refuses writes, and refused the lookup too: Redis queues no command inside MULTI when it is over
    maxmemory. Every lookup counted as Redis failing, and after three the cache was skipped: not one of the
    answers it held was served. The refused writes alone tripped the same back-off."""
    private = PrivateRedis(tmp_path)
    try:
        with RunningProxy(config(engine.url, prefix, redis_url=private.url, retry_after=3600)) as proxy:
            assert [proxy.post(CHAT, ASK).headers["x-kcache-cache"] for _ in range(2)] == ["miss", "hit"]
            client = redis.Redis(port=private.port)
            client.config_set("maxmemory-policy", "noeviction")
            client.config_set("maxmemory", 1)  # full
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.set(prefix + "probe", b"x")
            answers = []
            for i in range(FAILURES_TO_SKIP + 1):
                answers.append(proxy.post(CHAT, {**ASK, "max_tokens": 10 + i}).headers["x-kcache-cache"])
                answers.append(proxy.post(CHAT, ASK).headers["x-kcache-cache"])
            assert answers == ["miss", "hit"] * (FAILURES_TO_SKIP + 1)
            assert proxy.metric("kcache_proxy_not_stored_total", reason="redis") == FAILURES_TO_SKIP + 1
            assert proxy.metric("kcache_proxy_redis_up") == 1
    finally:
        private.close()


@pytest.mark.parametrize("asked, answered_as", [
    ("HELLO", "PING"),  # the handshake answered with a string, where a map was due
    ("PTTL", "GET"),  # an entry's expiry answered with its value, where an integer was due
], ids=["handshake", "expiry"])  # fmt: skip
def test_a_redis_that_answers_garbage_means_pass_through(engine, prefix, tmp_path, asked, answered_as):
    """A server on --redis that answers a command with a reply of the wrong kind (here a real redis-server
    told to answer one command as another) made redis-py raise AttributeError, or the lookup compare bytes
    with an int: neither was a Redis failure, and the client got a 500 with the engine never asked."""
    private = PrivateRedis(tmp_path, "--rename-command", asked, f"kcache-test-{asked}",
                           "--rename-command", answered_as, asked)  # fmt: skip
    try:
        with RunningProxy(config(engine.url, prefix, redis_url=private.url, retry_after=3600)) as proxy:
            replies = [proxy.post(CHAT, ASK) for _ in range(FAILURES_TO_SKIP + 2)]
            assert [r.status for r in replies] == [200] * len(replies)
            assert [r.body for r in replies] == engine.sent and len(engine.completions) == len(replies)
            assert replies[-1].headers["x-kcache-cache"] == "bypass"
            assert proxy.metric("kcache_proxy_redis_errors_total", kind="error") >= 1
            assert proxy.metric("kcache_proxy_bypasses_total", reason="redis") >= 1
    finally:
        private.close()


def test_the_cli_serves_with_the_fingerprint_of_the_restore_root(engine, prefix, tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": FP})
    args = ["proxy", "--root", str(tmp_path), "--upstream", engine.url, "--redis", REDIS_URL, "--port", "0",
            "--metrics-port", "0",
            "--key-prefix", prefix, "--ttl", "10m"]  # fmt: skip
    with kcache_server(*args) as (proc, port):
        assert [request(port, "POST", CHAT, json.dumps(ASK).encode()).headers["x-kcache-cache"]
                for _ in range(2)] == ["miss", "hit"]  # fmt: skip
        text = request(metrics_port_of(proc), "GET", "/metrics").body.decode()
        assert metric(text, "kcache_proxy_requests_total", outcome="hit") == 1
        proc.terminate()
        assert proc.wait(timeout=30) == 0
    ttl_ms = redis.Redis.from_url(REDIS_URL).pttl(next(redis.Redis.from_url(REDIS_URL).scan_iter(prefix + "*")))
    assert 0 < ttl_ms <= 600_000


@pytest.mark.parametrize("marker", [
    {"status": "error", "bundle_key": None, "reason": "bad --timeout"},  # restore failed before the fingerprint
    {"status": "miss", "bundle_key": "../../etc"},
    None,  # no marker at all
])  # fmt: skip
def test_a_root_without_a_fingerprint_serves_every_request_uncached(engine, prefix, tmp_path, marker):
    """The proxy had refused to start (exit 2): the sidecar crash-looped and the pod never became ready,
    after a restore that had failed open so that it would."""
    if marker is not None:
        write_marker(tmp_path, RESTORE_MARKER, marker)
    args = ["proxy", "--root", str(tmp_path), "--upstream", engine.url, "--redis", REDIS_URL, "--port", "0",
            "--metrics-port", "0",
            "--key-prefix", prefix]  # fmt: skip
    with kcache_server(*args) as (proc, port):
        replies = [request(port, "POST", CHAT, json.dumps(ASK).encode()) for _ in range(2)]
        assert [(r.status, r.headers["x-kcache-cache"]) for r in replies] == [(200, "bypass")] * 2
        assert [r.body for r in replies] == engine.sent
        text = request(metrics_port_of(proc), "GET", "/metrics").body.decode()
        assert metric(text, "kcache_proxy_bypasses_total", reason="no_fingerprint") == 2
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        assert "caching is off" in proc.stderr.read()
    assert not list(redis.Redis.from_url(REDIS_URL).scan_iter(prefix + "*"))


def test_the_cli_names_more_tenant_headers_by_flag_or_environment(engine, prefix, tmp_path, monkeypatch):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": FP})
    args = ["proxy", "--root", str(tmp_path), "--upstream", engine.url, "--redis", REDIS_URL, "--port", "0",
            "--metrics-port", "0",
            "--key-prefix", prefix]  # fmt: skip
    for name, how in [("X-Goog-Api-Key", ["--tenant-header", "X-Goog-Api-Key", "--tenant-header", "X-Team"]),
                      ("X-Org", [])]:  # fmt: skip
        monkeypatch.setenv("KCACHE_PROXY_TENANT_HEADERS", "X-Team X-Org")
        with kcache_server(*args, *how) as (_proc, port):
            replies = [request(port, "POST", CHAT, json.dumps(ASK).encode(), {name: who}) for who in ("a", "b", "a")]
            assert [r.headers["x-kcache-cache"] for r in replies] == ["miss", "miss", "hit"], name
            assert replies[2].body == replies[0].body != replies[1].body


def test_a_streamed_miss_reaches_the_client_while_the_engine_is_still_generating(prefix):
    gate = threading.Event()
    with EngineServer(gate=gate) as slow, RunningProxy(config(slow.url, prefix)) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
        try:
            conn.request("POST", CHAT, body=json.dumps({**ASK, "stream": True}), headers=SENT_AS_JSON)
            resp = conn.getresponse()
            first = resp.readline()  # arrives although the engine has not finished: nothing is buffered
            assert first.startswith(b"data: {") and b'"content": " t0"' in first
            gate.set()
            rest = resp.read()
        finally:
            conn.close()
        assert first + rest == slow.sent[0]
        assert proxy.post(CHAT, {**ASK, "stream": True}).body == slow.sent[0]


@pytest.mark.parametrize("extra, message", [
    (["--redis", "http://not-redis:80"], "--redis"),
    (["--redis", REDIS_URL, "--model", "m"], "either --root or the fingerprint flags"),
    (["--redis", REDIS_URL, "--tenant-header", "X Api Key"], "not an HTTP header name"),
    (["--redis", REDIS_URL, "--tenant-header", "X-Api-Key:"], "not an HTTP header name"),
])  # fmt: skip
def test_the_cli_refuses_what_it_cannot_use(tmp_path, extra, message):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": FP})
    args = ["proxy", "--root", str(tmp_path), "--upstream", "http://127.0.0.1:1", "--port", "0", *extra]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.parametrize("content, why", [(None, "cannot be read"), ("short\n", "holds 5 bytes")])
def test_the_cli_refuses_an_entry_key_file_it_cannot_use(tmp_path, monkeypatch, content, why):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": FP})
    secret = tmp_path / "entry-key"
    if content is not None:
        secret.write_text(content)
    args = ["proxy", "--root", str(tmp_path), "--upstream", "http://127.0.0.1:1", "--port", "0", "--redis", REDIS_URL]
    for how in (["--entry-key-file", str(secret)], []):
        monkeypatch.setenv("KCACHE_PROXY_ENTRY_KEY_FILE", str(secret))
        result = CliRunner().invoke(main, args + how, catch_exceptions=False)
        assert result.exit_code == 2 and "--entry-key-file" in result.output and why in result.output


def test_replicas_given_one_entry_key_file_share_answers(engine, prefix, tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": FP})
    (tmp_path / "entry-key").write_text("0123456789abcdef" * 4 + "\n")  # as a mounted Secret holds it
    args = ["proxy", "--root", str(tmp_path), "--upstream", engine.url, "--redis", REDIS_URL, "--port", "0",
            "--metrics-port", "0",
            "--key-prefix", prefix]  # fmt: skip
    outcomes = []
    for how in (["--entry-key-file", str(tmp_path / "entry-key")], ["--entry-key-file", str(tmp_path / "entry-key")],
                []):  # fmt: skip
        with kcache_server(*args, *how) as (proc, port):
            outcomes.append(request(port, "POST", CHAT, json.dumps(ASK).encode()).headers["x-kcache-cache"])
            proc.terminate()
            assert proc.wait(timeout=30) == 0
            assert ("no --entry-key-file" in proc.stderr.read()) == (not how)
    assert outcomes == ["miss", "hit", "miss"]  # without the file, a key of its own: the others' answers are not its


SECRET_IN_QUERY = "redis://127.0.0.1:6379/0?password=Zq9-redis-pw"


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_redis_password_in_the_query_is_never_printed(engine, prefix, tmp_path, json_flag):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": FP})
    args = ["proxy", "--root", str(tmp_path), "--upstream", engine.url, "--redis", SECRET_IN_QUERY, "--port", "0",
            "--metrics-port", "0", "--key-prefix", prefix, *json_flag]  # fmt: skip
    with kcache_server(*args) as (proc, port):
        port = json.loads(proc.start_line)["port"] if json_flag else port  # the line names the upstream first
        assert request(port, "POST", CHAT, json.dumps(ASK).encode()).status == 200  # Redis refuses the AUTH
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    printed = proc.start_line + out + err
    assert "Zq9-redis-pw" not in printed and "password=***" in proc.start_line


def test_a_redis_url_the_proxy_cannot_use_is_refused_without_its_password(tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "hit", "bundle_key": FP})
    for url in (SECRET_IN_QUERY + "&db=notanumber", "unix:///x?password=Zq9-redis-pw&db=zz"):
        args = ["proxy", "--root", str(tmp_path), "--upstream", "http://127.0.0.1:1", "--port", "0", "--redis", url]
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 2 and "--redis" in result.output and "Zq9-redis-pw" not in result.output


def test_the_json_start_line_gives_urls_that_parse_for_an_ipv6_host(engine, prefix, tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": FP})
    args = [sys.executable, "-m", "kcache", "proxy", "--root", str(tmp_path), "--upstream", engine.url, "--redis",
            REDIS_URL, "--host", "::1", "--port", "0", "--metrics-port", "0", "--key-prefix", prefix,
            "--json"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = json.loads(proc.stdout.readline())
        url, metrics_url = urllib.parse.urlsplit(line["url"]), urllib.parse.urlsplit(line["metrics_url"])
        assert (url.hostname, url.port) == ("::1", line["port"]) and metrics_url.hostname == "::1"
        with socket.create_connection(("::1", metrics_url.port), timeout=30) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert b"kcache_proxy_info" in b"".join(iter(lambda: conn.recv(1 << 16), b""))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="needs a dual-stack IPv6 socket")
def test_host_double_colon_takes_ipv4_and_ipv6_clients(engine, prefix, tmp_path):
    # --help promises ":: for IPv4 and IPv6" (as `kcache serve` does): asyncio's own "::" socket is
    # IPv6 only, and the kubelet and the pod's clients reach it over IPv4 in a dual-stack cluster.
    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": FP})
    args = [sys.executable, "-m", "kcache", "proxy", "--root", str(tmp_path), "--upstream", engine.url, "--redis",
            REDIS_URL, "--host", "::", "--port", "0", "--metrics-port", "0", "--key-prefix", prefix,
            "--json"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = json.loads(proc.stdout.readline())
        assert urllib.parse.urlsplit(line["url"]).hostname == "::"
        metrics_port = urllib.parse.urlsplit(line["metrics_url"]).port
        for address in ("127.0.0.1", "::1"):
            for port in (line["port"], metrics_port):
                with socket.create_connection((address, port), timeout=30) as conn:
                    conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    assert b"".join(iter(lambda c=conn: c.recv(1 << 16), b"")).startswith(b"HTTP/1.1 ")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_redis_killed_while_a_miss_streams_still_delivers_the_whole_stream(prefix, tmp_path):
    private, gate = PrivateRedis(tmp_path), threading.Event()
    try:
        cfg = config("", prefix, redis_url=private.url, redis_timeout=0.5)
        with EngineServer(gate=gate) as slow, RunningProxy(replace(cfg, upstream=slow.url)) as proxy:
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
            try:
                conn.request("POST", CHAT, body=json.dumps({**ASK, "stream": True}), headers=SENT_AS_JSON)
                resp = conn.getresponse()
                first = resp.readline()  # the lookup is done and the miss is streaming
                private.kill()
                gate.set()
                body = first + resp.read()
            finally:
                conn.close()
            assert resp.status == 200 and body == slow.sent[0]
            assert proxy.metric("kcache_proxy_not_stored_total", reason="redis") == 1
    finally:
        private.close()


def test_root_and_fingerprint_flags_give_the_key_restore_used(tmp_path, engine, prefix):
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps({"facts": dict(fingerprint.collect().facts)}))  # this machine's, as checked
    flags = ["--model", "org/model@rev", "--extra", "tp=2", "--facts-file", str(facts)]
    restored = CliRunner().invoke(main, ["restore", "--into", str(tmp_path / "root"), *flags, "--json"],
                                  catch_exceptions=False)  # fmt: skip
    bundle_key = json.loads(restored.output)["bundle_key"]
    common = ["proxy", "--upstream", engine.url, "--redis", REDIS_URL, "--port", "0", "--metrics-port", "0",
              "--key-prefix", prefix]
    for how in (["--root", str(tmp_path / "root")], flags):
        with kcache_server(*common, *how) as (proc, port):
            text = request(metrics_port_of(proc), "GET", "/metrics").body.decode()
            assert metric(text, "kcache_proxy_info", fingerprint=bundle_key) == 1, how[0]


def test_a_stream_the_engine_cuts_short_is_cut_short_for_the_client_and_not_cached(prefix):
    with EngineServer(cut_mid_stream=True) as dying, RunningProxy(config(dying.url, prefix)) as proxy:
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
            try:
                conn.request("POST", CHAT, body=json.dumps({**ASK, "stream": True}), headers=SENT_AS_JSON)
                resp = conn.getresponse()
                with pytest.raises(http.client.IncompleteRead):  # not a clean end the client could trust
                    resp.read()
                resp.close()
            finally:
                conn.close()
        assert len(dying.completions) == 2
        assert proxy.metric("kcache_proxy_not_stored_total", reason="upstream_error") == 2


def test_a_lookup_cancelled_while_it_waits_for_a_connection_leaves_no_coroutine_unawaited():
    """A request cancelled while its Redis call waits for a turn (the proxy stopping under load) closes the
    call it will never make: Python otherwise warns, at shutdown, of a coroutine never awaited."""
    async def cancel_a_waiter() -> None:
        stats = Stats()
        cache = ResultCache(REDIS_URL, stats, prefix=f"kcache:test:{uuid.uuid4().hex}:", ttl=60, timeout=60,
                            retry_after=1, max_bytes=1 << 20, connections=1)  # fmt: skip
        held, release = asyncio.Event(), asyncio.Event()

        async def hold_the_turn():
            await cache._turn(time.monotonic() + 60)
            held.set()
            await release.wait()
            cache._turns.release()

        holder = asyncio.create_task(hold_the_turn())
        await held.wait()
        waiter = asyncio.create_task(cache.put("k", b"v"))
        while stats.redis_waiting == 0:
            await asyncio.sleep(0)  # a turn of the loop, not a wait for time
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        release.set()
        await holder
        await cache.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(cancel_a_waiter())
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [str(w.message) for w in caught]


def test_a_turn_granted_too_late_to_ask_redis_is_not_counted_as_redis_failing():
    """A call that got its connection at the end of its --redis-timeout (the connections busy, then the proxy's
    loop busy too: a starved CPU) had no time left to ask Redis, and counted the timeout as Redis failing: three
    such calls turned the cache off for --redis-retry-after while Redis answered every command it was sent."""
    async def late_turns() -> tuple[Stats, bool]:
        stats, timeout = Stats(), 0.3
        cache = ResultCache(REDIS_URL, stats, prefix=f"kcache:test:{uuid.uuid4().hex}:", ttl=60, timeout=timeout,
                            retry_after=3600, max_bytes=1 << 20, connections=1)  # fmt: skip
        try:
            for _ in range(FAILURES_TO_SKIP):
                await cache._turn(time.monotonic() + 60)  # the one connection, taken by another call
                waiter = asyncio.create_task(cache.get("k", b"m" * 32))
                while stats.redis_waiting == 0:
                    await asyncio.sleep(0)  # a turn of the loop, not a wait for time
                cache._turns.release()  # the connection comes free, and the loop is busy past the waiter's deadline
                busy_until = time.monotonic() + timeout
                while time.monotonic() < busy_until:
                    pass
                with pytest.raises(CacheUnavailable):
                    await waiter
            return stats, cache.up
        finally:
            await cache.close()

    stats, up = asyncio.run(late_turns())
    assert (stats.redis_errors["timeout"], stats.redis_errors["busy"], up) == (0, FAILURES_TO_SKIP, True)
