"""kcache proxy against hostile clients, a hostile Redis and engines that misbehave.

Real Redis on 127.0.0.1:6379, real HTTP: tests/engine_server.py as the engine, or raw-socket routes
(tests/hostile_http.py) where the engine must do what no server library would.
"""

import asyncio
import gc
import gzip
import hashlib
import http.client
import json
import socket
import threading
import time
import uuid

import pytest
import redis
from engine_server import EngineServer
from hostile_http import COMPLETION, HostileServer, answer, read_request
from proxied import RunningProxy, request
from served import kcache_server
from test_proxy import ASK, CHAT, FP, REDIS_URL, SECRET, config, opened, sealed

from kcache.proxy import cache, entry, key
from kcache.readiness import RESTORE_MARKER, write_marker


@pytest.fixture
def prefix():
    """A key prefix of this test's own in the shared Redis, deleted afterwards."""
    client = redis.Redis.from_url(REDIS_URL)
    name = f"kcache-test:{uuid.uuid4().hex}:"
    yield name
    keys = list(client.scan_iter(name + "*"))
    if keys:
        client.delete(*keys)


@pytest.fixture
def engine():
    with EngineServer() as server:
        yield server


@pytest.fixture
def proxy(engine, prefix):
    with RunningProxy(config(engine.url, prefix)) as running:
        yield running


def send(port: int, method: str, path: str, body: bytes, headers: list[tuple[str, str]]):
    """One request whose headers may repeat a name (a dict cannot); returns (status, headers, body)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(body))), *headers]:
            conn.putheader(name, value)
        conn.endheaders(body)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def stored_value(client, name: str, timeout: float = 30) -> bytes:
    """The value under `name` once the proxy wrote it: a reply framed by its length is whole at the client
    when its last byte is sent, which may be before the proxy's write to Redis has finished."""
    done, deadline = threading.Event(), time.monotonic() + timeout
    while (value := client.get(name)) is None:
        assert time.monotonic() < deadline, f"{name} was never stored"
        done.wait(0.01)
    return value


def stored_key(body: dict, headers: dict | None = None) -> str:
    return key.decide(CHAT, [], {"Content-Type": "application/json", **(headers or {})}, json.dumps(body).encode(),
                      FP).key  # fmt: skip


# --- clients ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["", "Bearer victim"])
def test_two_authorization_headers_are_filed_under_neither(proxy, engine, first):
    # The key read the first value while the engine was sent only the last: an empty first value filed an
    # answer the engine gave `attacker` under the anonymous tenant, readable by anyone without a credential.
    auth = [("Authorization", first), ("Authorization", "Bearer attacker")]
    status, headers, _ = send(proxy.port, "POST", CHAT, json.dumps(ASK).encode(), auth)
    assert (status, headers["x-kcache-cache"]) == (200, "bypass")
    assert [v for k, v in engine.header_lists[-1] if k.lower() == "authorization"] == [first, "Bearer attacker"]
    assert proxy.metric("kcache_proxy_bypasses_total", reason="ambiguous_auth") == 1
    impostor = {"Authorization": first} if first else {}
    assert proxy.post(CHAT, ASK, impostor).headers["x-kcache-cache"] == "miss"
    assert len(engine.completions) == 2


@pytest.mark.parametrize("name", ["X-Api-Key", "Api-Key", "Cookie"])
def test_a_gateways_credential_header_names_the_tenant(proxy, engine, name):
    # Only Authorization named the tenant: behind a gateway that authenticates with X-Api-Key, bob was
    # answered from alice's entry.
    alice, bob = proxy.post(CHAT, ASK, {name: "alice"}), proxy.post(CHAT, ASK, {name: "bob"})
    assert [r.headers["x-kcache-cache"] for r in (alice, bob)] == ["miss", "miss"]
    assert [alice.body, bob.body] == engine.sent
    again = proxy.post(CHAT, ASK, {name: "alice"})
    assert (again.headers["x-kcache-cache"], again.body) == ("hit", alice.body)
    assert [v for k, v in engine.header_lists[0] if k.lower() == name.lower()] == ["alice"]  # still forwarded


def test_a_repeated_gateway_credential_is_filed_under_neither(proxy, engine):
    pairs = [("X-Api-Key", ""), ("X-Api-Key", "attacker")]
    status, headers, _ = send(proxy.port, "POST", CHAT, json.dumps(ASK).encode(), pairs)
    assert (status, headers["x-kcache-cache"]) == (200, "bypass")
    assert [v for k, v in engine.header_lists[-1] if k.lower() == "x-api-key"] == ["", "attacker"]
    assert proxy.metric("kcache_proxy_bypasses_total", reason="ambiguous_auth") == 1
    for impostor in ({"X-Api-Key": ""}, {}):
        assert proxy.post(CHAT, ASK, impostor).headers["x-kcache-cache"] == "miss"
    assert len(engine.completions) == 3


def test_a_body_with_a_repeated_name_is_forwarded_unchanged_and_never_answered_from_the_cache(prefix):
    # Python reads the last `temperature` (0), an engine that keeps the first reads 1: the greedy answer
    # cached for ASK was served for a request the engine would have sampled.
    bodies: list[bytes] = []
    with HostileServer({f"POST {CHAT}": _recording(bodies)}) as eng, RunningProxy(config(eng.url, prefix)) as proxy:
        assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"
        raw = json.dumps(ASK).encode().replace(b'"temperature": 0', b'"temperature": 1, "temperature": 0')
        assert json.loads(raw) == ASK
        for _ in range(2):
            status, headers, body = send(proxy.port, "POST", CHAT, raw, [])
            assert (status, headers["x-kcache-cache"], json.loads(body)) == (200, "bypass", COMPLETION)
        assert bodies == [json.dumps(ASK).encode(), raw, raw]
        assert proxy.metric("kcache_proxy_bypasses_total", reason="not_json") == 2


@pytest.mark.parametrize("path", [CHAT, "/v1/other"])
def test_headers_the_client_names_in_connection_are_not_forwarded(proxy, engine, path):
    # RFC 9110 7.6.1: a header named in Connection is for this hop only; X-Hop reached the engine.
    pairs = [("Connection", "keep-alive, X-Hop"), ("Connection", "x-other-hop"), ("X-Hop", "1"),
             ("X-Other-Hop", "1"), ("X-Kept", "1")]  # fmt: skip
    status, _, _ = send(proxy.port, "POST", path, json.dumps(ASK).encode(), pairs)
    assert status == 200
    names = {k.lower() for k, _ in engine.header_lists[-1]}
    assert "x-kept" in names and not names & {"x-hop", "x-other-hop"}


def _naming_hop_headers(server, conn, request):
    body = json.dumps(COMPLETION).encode()
    server.send(conn, (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                       "X-Hop: secret\r\nx-other-hop: 1\r\nX-Kept: 1\r\n"
                       "Connection: close, X-Hop\r\nConnection: X-OTHER-HOP\r\n\r\n").encode() + body)  # fmt: skip


def test_headers_the_engine_names_in_connection_are_neither_passed_on_nor_stored(prefix):
    routes = {f"POST {CHAT}": _naming_hop_headers, "POST /v1/other": _naming_hop_headers}
    with HostileServer(routes) as eng, RunningProxy(config(eng.url, prefix)) as proxy:
        replies = [proxy.post(CHAT, ASK), proxy.post(CHAT, ASK), proxy.post("/v1/other", ASK)]
        assert [r.headers["x-kcache-cache"] for r in replies] == ["miss", "hit", "pass"]
        for reply in replies:
            assert reply.headers["x-kcache-cache"] and reply.headers["x-kept"] == "1"
            assert not {"x-hop", "x-other-hop"} & set(reply.headers)
        raw = stored_value(redis.Redis.from_url(REDIS_URL), prefix + stored_key(ASK))
        stored = opened(raw, prefix + stored_key(ASK))
        assert {name.lower() for name, _ in stored.headers} == {"content-type", "x-kept"}


# vLLM and SGLang mount their Prometheus app at ^/metrics(.*)$: each of these paths reaches it once the engine
# has decoded it (uvicorn percent-decodes) or the proxy's client has normalised it (dot segments).
ENGINE_METRICS = ["/metrics/", "/metricsx", "/metrics/anything?name[]=vllm:prefix_cache_hits", "/metrics%2F",
                  "/%6detrics/", "/v1/../metrics/", "/v1/%2e%2e/metrics", "//metrics"]  # fmt: skip


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_no_path_the_engine_reads_as_its_metrics_is_forwarded(prefix, method):
    # Only the exact path /metrics was kept from the engine: GET /metrics/ on the clients' port answered with
    # vLLM's prefix-cache hit counters, which tell any client whether another tenant had sent a prompt.
    with HostileServer({}) as eng, RunningProxy(config(eng.url, prefix)) as proxy:
        for path in ENGINE_METRICS:
            status, headers, body = send(proxy.port, method, path, b"", [])
            assert (status, headers["x-kcache-cache"]) == (404, "pass"), path
            assert "the proxy's metrics port" in json.loads(body)["error"]["message"], path
        assert eng.requests == []
        assert send(proxy.port, method, "/v1/models", b"", [])[0] in (200, 404) and len(eng.requests) == 1


def test_queries_that_decode_alike_are_not_one_answer(proxy, engine):
    replies = [proxy.post(f"{CHAT}?x={q}", ASK) for q in ("%ff", "%fe", "%EF%BF%BD")]
    assert [r.headers["x-kcache-cache"] for r in replies] == ["miss"] * 3
    assert [r.body for r in replies] == engine.sent


def test_a_no_cache_directive_in_a_second_cache_control_header_is_honoured(proxy, engine):
    proxy.post(CHAT, ASK)
    directives = [("Cache-Control", "max-age=0"), ("Cache-Control", "no-cache")]
    status, headers, body = send(proxy.port, "POST", CHAT, json.dumps(ASK).encode(), directives)
    assert (status, headers["x-kcache-cache"], body) == (200, "bypass", engine.sent[1])


def _recording(bodies: list[bytes]):
    def route(server, conn, request):
        bodies.append(request.body)
        server.send(conn, answer("200 OK", COMPLETION))

    return route


def test_a_compressed_request_body_reaches_the_engine_as_the_client_sent_it(prefix):
    # aiohttp inflated request bodies: the engine got plain JSON under `Content-Encoding: gzip`, an answer
    # it would never have given the client directly, and the key was computed from bytes it never saw.
    bodies: list[bytes] = []
    with HostileServer({f"POST {CHAT}": _recording(bodies)}) as eng, RunningProxy(config(eng.url, prefix)) as proxy:
        packed = gzip.compress(json.dumps(ASK).encode())
        status, headers, _ = send(proxy.port, "POST", CHAT, packed, [("Content-Encoding", "gzip")])
        assert (status, headers["x-kcache-cache"]) == (200, "bypass")
        status, headers, _ = send(proxy.port, "POST", "/v1/other", packed, [("Content-Encoding", "gzip")])
        assert (status, headers["x-kcache-cache"]) == (404, "pass")
        assert bodies == [packed]
        assert proxy.metric("kcache_proxy_bypasses_total", reason="not_json") == 1
        assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"  # nothing was filed under the JSON


def test_a_body_over_the_request_limit_is_forwarded_not_refused(engine, prefix):
    # It was answered 413 in plain text, by the proxy, for a request the engine would have served.
    with RunningProxy(config(engine.url, prefix, max_request_bytes=1000)) as proxy:
        big = {**ASK, "messages": [{"role": "user", "content": "x" * 5000}]}
        replies = [proxy.post(CHAT, big) for _ in range(2)]
        assert [(r.status, r.headers["x-kcache-cache"]) for r in replies] == [(200, "bypass")] * 2
        assert engine.completions == [big, big] and [r.body for r in replies] == engine.sent
        assert proxy.metric("kcache_proxy_bypasses_total", reason="too_large") == 2
        assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"  # below the limit: cached as before


def test_a_body_over_4_mib_is_streamed_to_the_engine_and_never_parsed(engine, prefix, monkeypatch):
    """A 60 MiB body under the old 64 MiB limit was parsed and serialised again to key it: 1.7 GiB of memory
    (the example sidecar's limit is 512Mi) and seconds in which the parser held the GIL, and with it every
    other client. Past 4 MiB a body is forwarded as it arrives, uncached."""
    parsed = []
    parse = key.parse_body
    monkeypatch.setattr(key, "parse_body", lambda raw: parsed.append(len(raw)) or parse(raw))
    big = {**ASK, "messages": [{"role": "user", "content": "x" * (4 << 20)}]}
    with RunningProxy(config(engine.url, prefix)) as proxy:
        reply = proxy.post(CHAT, big)
        assert (reply.status, reply.headers["x-kcache-cache"]) == (200, "bypass") and reply.body == engine.sent[0]
        assert engine.completions == [big] and parsed == []
        assert proxy.metric("kcache_proxy_bypasses_total", reason="too_large") == 1
        assert proxy.post(CHAT, ASK).headers["x-kcache-cache"] == "miss" and parsed == [len(json.dumps(ASK))]


def test_expect_100_continue_is_not_forwarded(prefix):
    # The proxy has the body already (it answered the client's Expect itself); forwarded, the header made
    # aiohttp wait for a 100 the engine need not send, for ever.
    bodies: list[bytes] = []
    with HostileServer({f"POST {CHAT}": _recording(bodies)}) as eng, RunningProxy(config(eng.url, prefix)) as proxy:
        status, headers, body = send(proxy.port, "POST", CHAT, json.dumps(ASK).encode(), [("Expect", "100-continue")])
        assert (status, headers["x-kcache-cache"], json.loads(body)) == (200, "miss", COMPLETION)
        assert bodies == [json.dumps(ASK).encode()]


def test_a_client_that_leaves_closes_the_engines_connection(prefix):
    # The proxy learnt of a departed client only when it next wrote: a slow answer held the engine's
    # connection open, so the engine (vLLM aborts on disconnect) generated it whole for nobody.
    arrived, closed = threading.Event(), threading.Event()

    def silent(server, conn, request):
        arrived.set()
        conn.settimeout(30)
        try:
            if conn.recv(1) == b"":  # the proxy closed its side
                closed.set()
        except OSError:
            pass

    with HostileServer({f"POST {CHAT}": silent}) as eng, RunningProxy(config(eng.url, prefix)) as proxy:
        body = json.dumps(ASK).encode()
        with socket.create_connection(("127.0.0.1", proxy.port)) as client:
            client.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
            assert arrived.wait(30)
        assert closed.wait(30)
        assert request(proxy.metrics_port, "GET", "/metrics").status == 200  # and the proxy serves on


def test_sigterm_with_a_request_held_by_a_wedged_engine_exits_within_the_shutdown_timeout(prefix, tmp_path):
    """aiohttp waited its default 60 s twice for the handler (to finish, then once cancelled): the proxy took
    124 s to exit, and the example pod gives it 60 s before SIGKILL."""
    arrived, release = threading.Event(), threading.Event()

    def wedged(server, conn, request):
        arrived.set()
        release.wait(120)  # never answers while the test runs

    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": FP})
    with HostileServer({f"POST {CHAT}": wedged}) as eng:
        args = ["proxy", "--root", str(tmp_path), "--upstream", eng.url, "--redis", REDIS_URL, "--port", "0",
                "--metrics-port", "0", "--key-prefix", prefix, "--shutdown-timeout", "1s"]  # fmt: skip
        try:
            with kcache_server(*args) as (proc, port):
                body = json.dumps(ASK).encode()
                with socket.create_connection(("127.0.0.1", port)) as client:
                    client.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                   f"Content-Length: {len(body)}\r\n\r\n".encode() + body)  # fmt: skip
                    assert arrived.wait(30)
                    proc.terminate()
                    assert proc.wait(timeout=30) == 0  # with aiohttp's defaults: 120 s
        finally:
            release.set()


# --- Redis -----------------------------------------------------------------------------------------------------


def test_a_value_of_another_redis_type_is_a_bad_entry_and_is_replaced(proxy, engine, prefix):
    # WRONGTYPE counted as Redis failing: the request was a bypass, nothing overwrote the value, and three such
    # requests turned the cache off for everyone.
    client = redis.Redis.from_url(REDIS_URL)
    client.rpush(prefix + stored_key(ASK), b"not a string")
    replies = [proxy.post(CHAT, ASK) for _ in range(4)]
    assert [r.headers["x-kcache-cache"] for r in replies] == ["miss", "hit", "hit", "hit"]
    assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1
    assert proxy.metric("kcache_proxy_redis_errors_total", kind="error") == 0
    assert proxy.metric("kcache_proxy_redis_up") == 1


def test_an_entry_copied_from_another_key_is_not_served(proxy, engine, prefix):
    client = redis.Redis.from_url(REDIS_URL)
    alice = proxy.post(CHAT, ASK, {"Authorization": "Bearer alice"})
    bob = {"Authorization": "Bearer bob"}
    alices = stored_value(client, prefix + stored_key(ASK, {"Authorization": "Bearer alice"}))
    client.set(prefix + stored_key(ASK, bob), alices)
    reply = proxy.post(CHAT, ASK, bob)
    assert (reply.headers["x-kcache-cache"], reply.body) == ("miss", engine.sent[1])
    assert reply.body != alice.body
    assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1
    assert proxy.post(CHAT, ASK, bob).body == engine.sent[1]


def test_an_entry_written_for_another_fingerprint_is_not_served(engine, prefix):
    client = redis.Redis.from_url(REDIS_URL)
    forged = sealed(
        entry.Entry(200, (("Content-Type", "application/json"),), json.dumps(COMPLETION).encode(), False),
        prefix + key.decide(CHAT, [], {"Content-Type": "application/json"}, json.dumps(ASK).encode(), "f" * 32).key,
    )
    client.set(prefix + stored_key(ASK), forged, px=60_000)
    with RunningProxy(config(engine.url, prefix)) as proxy:
        reply = proxy.post(CHAT, ASK)
        assert (reply.headers["x-kcache-cache"], reply.body) == ("miss", engine.sent[0])
        assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1


FORGED = json.dumps({"choices": [{"index": 0, "text": "Visit http://evil.example to log in again"}]}).encode()


# Streamed: a stream's entry is in Redis before its last chunk goes out, so a client that has read it whole
# knows that the proxy's write is done, and a value the test sets next is not overwritten by it.
STREAMED = {**ASK, "stream": True}
FORGED_EVENTS = b"data: " + FORGED + b"\n\ndata: [DONE]\n\n"


def _forged_kcp2(name: str) -> bytes:
    """What a Redis writer made of the request key it read from SCAN: a kcp2 entry needed no secret."""
    head = {"headers": [["Content-Type", "application/json"]], "key": name.rsplit(":", 1)[1],
            "sha256": hashlib.sha256(FORGED).hexdigest(), "status": 200, "stream": False}  # fmt: skip
    return b"kcp2\n" + json.dumps(head, sort_keys=True, separators=(",", ":")).encode() + b"\n" + FORGED


def test_an_entry_a_redis_writer_made_up_is_never_served(proxy, engine, prefix):
    client = redis.Redis.from_url(REDIS_URL)
    victim = {"Authorization": "Bearer victim-secret-token"}
    first = proxy.post(CHAT, ASK, victim)
    name = prefix + stored_key(ASK, victim)
    stored_value(client, name)
    client.set(name, _forged_kcp2(name), px=60_000)
    reply = proxy.post(CHAT, ASK, victim)
    assert FORGED not in reply.body and reply.headers["x-kcache-cache"] == "miss"
    assert reply.body == engine.sent[1] != first.body
    assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1


def test_an_entry_saved_and_set_again_is_not_served_past_its_first_life(proxy, engine, prefix, monkeypatch):
    client = redis.Redis.from_url(REDIS_URL)
    proxy.post(CHAT, STREAMED)
    name = prefix + stored_key(STREAMED)
    saved = stored_value(client, name)
    later = cache._now_ms() + 3_600_000 + 1  # past the default --ttl of an hour
    monkeypatch.setattr(cache, "_now_ms", lambda: later)
    client.set(name, saved, px=60_000)  # a fresh expiry in Redis: only the tagged one tells
    reply = proxy.post(CHAT, STREAMED)
    assert reply.headers["x-kcache-cache"] == "miss" and reply.body == engine.sent[1]
    assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1
    assert proxy.post(CHAT, STREAMED).headers["x-kcache-cache"] == "hit"  # written at the new time


def test_a_holder_of_the_secret_cannot_forge_another_tenants_answer(proxy, engine, prefix):
    """The shared secret is in every replica's pod; a tenant's answers need its credential as well."""
    client = redis.Redis.from_url(REDIS_URL)
    victim = {"Authorization": "Bearer victim-secret-token"}
    proxy.post(CHAT, STREAMED, victim)
    name = prefix + stored_key(STREAMED, victim)
    forged = entry.Entry(200, (("Content-Type", "text/event-stream"),), FORGED_EVENTS, True)
    for credentials in ([], [("Authorization", "Bearer attacker")], [("Authorization", "Bearer victim")]):
        client.set(name, sealed(forged, name, credentials), px=60_000)
        reply = proxy.post(CHAT, STREAMED, victim)
        assert FORGED not in reply.body and reply.headers["x-kcache-cache"] == "miss"
    assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 3
    client.set(name, sealed(forged, name, [("Authorization", "Bearer victim-secret-token")]), px=60_000)
    assert proxy.post(CHAT, STREAMED, victim).body == FORGED_EVENTS  # the secret and the credential: a good tag


def test_without_an_entry_secret_answers_serve_only_the_process_that_wrote_them(engine, prefix):
    with RunningProxy(config(engine.url, prefix, entry_secret=None)) as one:
        assert [one.post(CHAT, ASK).headers["x-kcache-cache"] for _ in range(2)] == ["miss", "hit"]
    with RunningProxy(config(engine.url, prefix, entry_secret=None)) as other:
        assert other.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"
        assert other.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1
    with RunningProxy(config(engine.url, prefix, entry_secret=SECRET)) as keyed:
        assert keyed.post(CHAT, ASK).headers["x-kcache-cache"] == "miss"
    with RunningProxy(config(engine.url, prefix, entry_secret=SECRET)) as replica:
        assert replica.post(CHAT, ASK).headers["x-kcache-cache"] == "hit"


@pytest.mark.parametrize("outlive", [
    lambda client, name: client.persist(name),  # no expiry: served for ever
    lambda client, name: client.pexpire(name, 7_200_000),  # longer than the proxy's --ttl (1 h)
], ids=["persist", "longer"])  # fmt: skip
def test_an_entry_whose_expiry_a_redis_writer_lifted_is_not_served(proxy, engine, prefix, outlive):
    client = redis.Redis.from_url(REDIS_URL)
    proxy.post(CHAT, STREAMED)
    name = prefix + stored_key(STREAMED)
    assert outlive(client, name)
    reply = proxy.post(CHAT, STREAMED)
    assert reply.headers["x-kcache-cache"] == "miss" and reply.body == engine.sent[1]
    assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1
    assert 0 < client.pttl(name) <= 3_600_000  # the next answer replaced it, with the proxy's expiry
    assert proxy.post(CHAT, STREAMED).headers["x-kcache-cache"] == "hit"


@pytest.mark.parametrize(
    "name", ["Transfer-Encoding", "Connection", "Content-Length", "Set-Cookie", "content-encoding"]
)
def test_an_entry_carrying_a_header_the_proxy_never_stores_is_a_miss(engine, prefix, name):
    client = redis.Redis.from_url(REDIS_URL)
    headers = (("Content-Type", "application/json"), (name, "chunked" if name == "Transfer-Encoding" else "x"))
    bad = sealed(entry.Entry(200, headers, json.dumps(COMPLETION).encode(), False), prefix + stored_key(ASK))
    client.set(prefix + stored_key(ASK), bad, px=60_000)
    with RunningProxy(config(engine.url, prefix)) as proxy:
        reply = proxy.post(CHAT, ASK)
        assert (reply.status, reply.headers["x-kcache-cache"], reply.body) == (200, "miss", engine.sent[0])
        assert "set-cookie" not in reply.headers
        assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 1


# --- the engine ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [429, 500, 503])
def test_an_engine_error_is_never_cached(prefix, status):
    with EngineServer(fail_status=status) as failing, RunningProxy(config(failing.url, prefix)) as proxy:
        replies = [proxy.post(CHAT, ASK) for _ in range(2)]
        assert [(r.status, r.headers["x-kcache-cache"]) for r in replies] == [(status, "miss")] * 2
        assert not list(redis.Redis.from_url(REDIS_URL).scan_iter(prefix + "*"))


NESTED = b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # valid JSON, nested past the parser's limit


def _nested_json(server, conn, request) -> None:
    server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                      b"Connection: close\r\n\r\n" % len(NESTED) + NESTED)  # fmt: skip


def _nested_events(server, conn, request) -> None:
    body = b"data: " + NESTED + b"\n\ndata: [DONE]\n\n"
    server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n"
                      b"Connection: close\r\n\r\n" % len(body) + body)  # fmt: skip


@pytest.mark.parametrize("route", [_nested_json, _nested_events], ids=["json", "event-stream"])
def test_an_answer_nested_past_the_parsers_limit_reaches_the_client_and_is_not_stored(prefix, route):
    # Deciding whether to store the answer parsed it; the RecursionError escaped the handler after the body
    # was sent, so the client's answer never ended cleanly and the next request found the entry missing.
    with HostileServer({f"POST {CHAT}": route}) as eng, RunningProxy(config(eng.url, prefix)) as proxy:
        replies = [proxy.post(CHAT, ASK) for _ in range(2)]
        assert [(r.status, r.headers["x-kcache-cache"]) for r in replies] == [(200, "miss")] * 2
        assert all(NESTED in r.body for r in replies)
        assert proxy.metric("kcache_proxy_not_stored_total", reason="upstream_error") == 2
        assert not list(redis.Redis.from_url(REDIS_URL).scan_iter(prefix + "*"))


def test_other_clients_are_served_while_a_request_body_is_judged(proxy, monkeypatch):
    """Parsing and keying a body of up to 64 MiB took seconds of CPU on the event loop, where no other
    client, cache hits and /metrics included, got an answer meanwhile. A large body is judged on a worker
    thread now: here it is held there until /metrics has answered."""
    entered, release = threading.Event(), threading.Event()
    judge = key.decide

    def held(*args, **kwargs):
        entered.set()
        release.wait(60)
        return judge(*args, **kwargs)

    monkeypatch.setattr(key, "decide", held)
    replies = []
    large = {**ASK, "messages": [{"role": "user", "content": "x" * (300 * 1024)}]}  # past what is judged inline
    asker = threading.Thread(target=lambda: replies.append(proxy.post(CHAT, large)), daemon=True)
    asker.start()
    try:
        assert entered.wait(30)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.metrics_port, timeout=10)  # served by the same loop
        try:
            conn.request("GET", "/metrics")
            assert conn.getresponse().status == 200  # a timeout here: the loop was held
        finally:
            conn.close()
    finally:
        release.set()
        asker.join(60)
    assert [r.headers["x-kcache-cache"] for r in replies] == ["miss"]


EVENTS = b'data: {"choices":[{"delta":{"content":"ok"}}]}\n\ndata: [DONE]\n\n'


def _chunked_events_with(header: bytes):
    def route(server, conn, request) -> None:
        server.send(conn, b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n" + header
                          + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                          + b"%x\r\n" % len(EVENTS) + EVENTS + b"\r\n0\r\n\r\n")  # fmt: skip
    return route


@pytest.mark.parametrize("header", [
    b"X-Server: caf\xe9\r\n",
    b"".join(b"X-H%d: v\r\n" % i for i in range(entry.MAX_HEADERS)),
], ids=["not-utf8", "too-many"])  # fmt: skip
def test_an_answer_whose_headers_the_cache_cannot_give_back_is_relayed_whole_and_not_stored(prefix, header):
    """A Latin-1 byte in an engine's header made storing the answer raise after the body was relayed: a
    streamed answer never got its last chunk. 65 headers were stored, then refused on every read."""
    ask = {**ASK, "stream": True}
    with HostileServer({f"POST {CHAT}": _chunked_events_with(header)}) as eng, \
            RunningProxy(config(eng.url, prefix)) as proxy:  # fmt: skip
        replies = [proxy.post(CHAT, ask) for _ in range(2)]
        assert [(r.status, r.headers["x-kcache-cache"], r.body) for r in replies] == [(200, "miss", EVENTS)] * 2
        assert proxy.metric("kcache_proxy_not_stored_total", reason="headers") == 2
        assert proxy.metric("kcache_proxy_redis_errors_total", kind="bad_entry") == 0
        assert not list(redis.Redis.from_url(REDIS_URL).scan_iter(prefix + "*"))


def test_a_fault_while_storing_still_ends_the_clients_answer(proxy, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a fault of the proxy's own")

    monkeypatch.setattr(entry, "encode", broken)
    reply = proxy.post(CHAT, {**ASK, "stream": True})
    assert (reply.status, reply.headers["x-kcache-cache"]) == (200, "miss") and reply.body.endswith(b"data: [DONE]\n\n")
    assert proxy.metric("kcache_proxy_not_stored_total", reason="error") == 1


def _parsed_bodies(marker: str) -> int:
    """How many dicts in this process hold `marker`, garbage aside: parsed request bodies that are still held
    (json makes plain dicts; `type`, not isinstance, which reads `__class__` of every object, deprecated ones too)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is dict and marker in o)


def _marked(content: int) -> tuple[str, bytes]:
    """A marker of its own and a chat body that carries it, built as bytes: no parsed copy in this process."""
    marker = f"kcache-test-marker-{uuid.uuid4().hex}"
    return marker, (b'{"%s": 1, "model": "m", "temperature": 0, "messages": [{"role": "user", "content": "%s"}]}'
                    % (marker.encode(), b"x" * content))  # fmt: skip


def _held_at_the_engine(arrived: threading.Semaphore, gate: threading.Event):
    def route(server, conn, request):
        arrived.release()
        gate.wait(60)
        server.send(conn, answer("200 OK", COMPLETION))

    return route


@pytest.mark.parametrize("content", [1, 300 * 1024], ids=["inline", "on-a-worker-thread"])
def test_a_parsed_request_body_is_not_held_while_the_engine_answers(prefix, content):
    # The parsed body (~30 times the raw one for tiny array elements) lived until the engine had answered: ten
    # clients waiting on the engine with 4 MiB bodies held 1066 MiB in the proxy, past the example sidecar's
    # 1Gi limit, where docs/proxy.md promises one parse at a time. Only the raw bytes are needed to forward.
    arrived, gate = threading.Semaphore(0), threading.Event()
    marker, raw = _marked(content)
    with HostileServer({f"POST {CHAT}": _held_at_the_engine(arrived, gate)}) as eng, \
            RunningProxy(config(eng.url, prefix)) as proxy:  # fmt: skip
        asker = threading.Thread(target=send, args=(proxy.port, "POST", CHAT, raw, []), daemon=True)
        asker.start()
        try:
            assert arrived.acquire(timeout=30)  # the request waits on the engine now
            held = _parsed_bodies(marker)
        finally:
            gate.set()
            asker.join(60)
        assert held == 0, "the parsed body is held while the engine answers"


@pytest.mark.parametrize("content", [1, 300 * 1024], ids=["inline", "on-a-worker-thread"])
def test_a_parsed_request_body_is_gone_before_the_cache_is_asked(engine, prefix, content):
    # Bodies over 256 KiB are parsed one at a time, but the parsed body outlived its turn: it was kept through
    # the Redis lookup and the prefix measurement after it, while the next body was parsed: ten clients with
    # 4 MiB bodies peaked the proxy at 362 MiB, 220 MiB with only the prompt's chain of hashes kept.
    entered, release = threading.Event(), threading.Event()
    marker, raw = _marked(content)
    with RunningProxy(config(engine.url, prefix)) as proxy:
        lookup = proxy.proxy.cache.get

        async def held(*args):
            entered.set()
            await asyncio.to_thread(release.wait, 60)
            return await lookup(*args)

        proxy.proxy.cache.get = held
        asker = threading.Thread(target=send, args=(proxy.port, "POST", CHAT, raw, []), daemon=True)
        asker.start()
        try:
            assert entered.wait(30)
            held = _parsed_bodies(marker)
        finally:
            release.set()
            asker.join(60)
        assert held == 0, "the parsed body is held while the cache is asked"
        assert proxy.metric("kcache_proxy_prompt_bytes_total") > content  # measured all the same


def test_a_client_that_leaves_mid_parse_keeps_the_next_large_body_waiting_its_turn(proxy, monkeypatch):
    # Large bodies are parsed one at a time, but a client that hung up ended its turn while its parse ran on in
    # the worker thread: the next body was parsed beside it. Clients that sent 4 MiB bodies and left one after
    # another peaked the proxy at 383 MiB on 2 cores, 178 MiB once the turn lasts as long as the parse (the
    # executor has 20 threads on a 16-core node: up to 20 parses of ~100 MiB at once).
    first_in, release, second_in = threading.Event(), threading.Event(), threading.Event()
    judge = key.decide

    def held(*args, **kwargs):
        if not first_in.is_set():
            first_in.set()
            release.wait(60)
        else:
            second_in.set()
        return judge(*args, **kwargs)

    monkeypatch.setattr(key, "decide", held)
    large = json.dumps({**ASK, "messages": [{"role": "user", "content": "x" * (300 * 1024)}]}).encode()
    leaving = socket.create_connection(("127.0.0.1", proxy.port))
    leaving.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    % (CHAT.encode(), len(large)) + large)  # fmt: skip
    try:
        assert first_in.wait(30)
        leaving.close()  # its parse is still running
        asker = threading.Thread(target=send, args=(proxy.port, "POST", CHAT, large, []), daemon=True)
        asker.start()
        parsed_beside = second_in.wait(3)  # must not happen: the first parse has not ended
    finally:
        release.set()
    asker.join(60)
    assert not parsed_beside, "a second large body was parsed while the first one's parse ran on"
    assert second_in.is_set()  # and it had its turn once the first was done


class ClosesIdleConnections:
    """An engine that answers the first request on each connection with keep-alive, and closes the
    connection, unanswered, when a second request comes on it: what uvicorn's keep-alive (5 s, vLLM's and
    SGLang's) does to a request sent just as it runs out."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.answered = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if read_request(conn) is None:
                return
            body = json.dumps(COMPLETION).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: keep-alive\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)  # fmt: skip
            self.answered += 1
            read_request(conn)  # the next request on this connection: closed, never answered

    def close(self) -> None:
        self.listener.close()


def test_a_kept_alive_connection_the_engine_closed_as_the_request_went_out_is_retried(prefix):
    """The engine read the request and closed its idle connection unanswered: the client got a 502 for a
    request the engine never served. Sent again on a new connection, it is answered."""
    engine = ClosesIdleConnections()
    try:
        with RunningProxy(config(engine.url, prefix)) as proxy:
            sampled = {**ASK, "temperature": 0.7}  # not cached: both go to the engine
            first, second = proxy.post(CHAT, sampled), proxy.post(CHAT, sampled)
        assert (first.status, second.status) == (200, 200), second.body
        assert engine.answered == 2 and engine.connections == 2
    finally:
        engine.close()
