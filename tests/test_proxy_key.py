"""The proxy's pure parts: which requests are cacheable, the key, entries, events, prefixes."""

import hashlib
import hmac
import json
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from multidict import CIMultiDict

from kcache.errors import ConfigError
from kcache.proxy import entry, key, prefix, sse
from kcache.readiness import RESTORE_MARKER, write_marker

FP = "0123456789abcdef0123456789abcdef"
CHAT = "/v1/chat/completions"
BODY = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


SENT_AS_JSON = {"Content-Type": "application/json"}


def decide(body, headers=None, **kw):
    sent = CIMultiDict(SENT_AS_JSON)
    sent.extend(headers or {})  # repeats kept
    return key.decide(CHAT, [], sent, json.dumps(body).encode(), FP, **kw)


# The tenant of `Authorization: Bearer t`: SHA-256 of the canonical list of [lower-case name, SHA-256 of the value].
CREDENTIAL_T = hashlib.sha256(b"Bearer t").hexdigest()
TENANT_T = hashlib.sha256(f'[["authorization","{CREDENTIAL_T}"]]'.encode()).hexdigest()


SCHEMA_PROPERTIES = [("name", {"type": "string"}), ("age", {"type": "integer"})]


def structured(properties):
    schema = {"type": "object", "properties": dict(properties), "required": [name for name, _ in properties]}
    return {**BODY, "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}


def test_order_and_number_spelling_below_the_top_level_are_kept():
    """An engine reads parameters by name, but what lies inside them it may read in order or as text:
    structured output follows a schema's property order, and chat templates render `tools` with
    json.dumps unsorted, so `1` and `1.0` there are different prompts. Such requests got one key."""
    assert key.request_key(CHAT, [], [], structured(SCHEMA_PROPERTIES), FP) != key.request_key(
        CHAT, [], [], structured(SCHEMA_PROPERTIES[::-1]), FP)  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": 1}}}
    spelled = json.loads(json.dumps(tool).replace('"minimum": 1', '"minimum": 1.0'))
    assert key.request_key(CHAT, [], [], {**BODY, "tools": [tool]}, FP) != key.request_key(
        CHAT, [], [], {**BODY, "tools": [spelled]}, FP)  # fmt: skip
    reordered = {"messages": [{"content": "hi", "role": "user"}], "model": "m", "temperature": 0}
    assert key.request_key(CHAT, [], [], BODY, FP) != key.request_key(CHAT, [], [], reordered, FP)


@pytest.mark.parametrize("name", ["temperature", "max_tokens", "top_p"])
def test_a_top_level_number_is_one_key_however_spelled(name):
    def keyed(value):
        return key.request_key(CHAT, [], [], {**BODY, name: value}, FP)

    assert keyed(1) == keyed(1.0) != keyed(1.5)


def test_a_string_never_shares_a_key_with_the_value_it_spells():
    assert key.request_key(CHAT, [], [], {**BODY, "stop": ["x"]}, FP) != key.request_key(
        CHAT, [], [], {**BODY, "stop": '["x"]'}, FP)  # fmt: skip
    assert key.request_key(CHAT, [], [], {**BODY, "stop": {"as_sent": '"x"'}}, FP) != key.request_key(
        CHAT, [], [], {**BODY, "stop": "x"}, FP)  # fmt: skip


def test_key_is_pinned():
    # A refactor must never change a key by accident: every cached answer would go cold at once.
    # The bytes below are the documented parts, written out by hand; bump KEY_SCHEMA to change them.
    # Top-level members sorted, numbers there integral when they can be; a list or object as the text of
    # its JSON, in the order and spelling it came in.
    parts = ('{"body":{"messages":{"as_sent":"[{\\"role\\":\\"user\\",\\"content\\":\\"hi\\"}]"},"model":"m",'
             f'"temperature":0}},"fingerprint":"{FP}","path":"/v1/chat/completions",'
             f'"query":[["a","1"],["a","0"],["b","2"]],"schema":4,"tenant":"{TENANT_T}"}}')  # fmt: skip
    assert TENANT_T == "b4e64ad2e1b894d9c48ac7338530cb66f303d364c592a5b227435807c8e464d4"
    got = key.request_key(CHAT, key.query_pairs("b=2&a=1&a=0"), [("Authorization", "Bearer t")],
                          {**BODY, "user": "u", "temperature": 0.0}, FP)  # fmt: skip
    assert got == hashlib.sha256(parts.encode()).hexdigest()
    assert got == "3cdc661259ced7765b0cff793d3ff44105f3f18b5c916a1b3b1bc8d5c1118cb9"
    assert key.tenant([]) == hashlib.sha256(b"[]").hexdigest()  # no credential: the one anonymous tenant


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
    max_leaves=10,
)


@given(st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=6), st.randoms())
def test_key_ignores_top_level_order_and_non_semantic_fields(body, rnd):
    items = list(body.items())
    rnd.shuffle(items)
    noisy = dict(items, user="someone", request_id="r-1", priority=0, metadata={"team": "a"}, store=False)
    clean = {k: v for k, v in body.items() if k not in key.NON_SEMANTIC}
    assert key.request_key(CHAT, [], [], noisy, FP) == key.request_key(CHAT, [], [], clean, FP)


@pytest.mark.parametrize("field, value", [
    ("priority", 5),  # vLLM refuses it (400) unless started with --scheduling-policy priority
    ("priority", -1),
    ("priority", "high"),  # not an integer: refused (400, or 422)
    ("priority", True),
    ("user", 5),  # vLLM: user is a string or null
    ("user", ["a"]),
    ("request_id", None),  # vLLM: a string
    ("request_id", 7),
    ("metadata", ["a"]),  # OpenAI: an object of strings
    ("metadata", {"a": 1}),
    ("store", "yes"),  # OpenAI: a boolean
])  # fmt: skip
def test_a_field_left_out_of_the_key_is_keyed_in_a_form_an_engine_may_refuse(field, value):
    """The key left out `priority`, `user`, `request_id`, `metadata` and `store` whatever their value, so a request
    the engine refuses (priority 5 on an engine without priority scheduling, a user that is no string) got the
    200 answered to the same request without them. Left out now only in the forms every engine takes."""
    assert decide({**BODY, field: value}).key != decide(BODY).key


@pytest.mark.parametrize("field, value", [
    ("priority", 0), ("priority", 0.0), ("user", "u-1"), ("user", None), ("request_id", "r-1"),
    ("metadata", {"team": "a"}), ("metadata", None), ("store", True), ("store", False),
])  # fmt: skip
def test_a_field_left_out_of_the_key_in_a_form_every_engine_takes_is_still_left_out(field, value):
    assert decide({**BODY, field: value}).key == decide(BODY).key  # the keys of such requests did not change


def said(*parts):
    return {**BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]}


PIXEL = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize("body", [
    said({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}),
    said({"type": "image_url", "image_url": {"url": "HTTP://example.com/cat.png"}}),
    said({"type": "audio_url", "audio_url": {"url": "http://example.com/a.wav"}}),
    said({"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}),
    said({"type": "image_url", "image_url": {"url": "file:///srv/media/cat.png"}}),  # --allowed-local-media-path
    said({"image_url": "https://example.com/cat.png"}),  # vLLM reads a part without a type by its keys
    said({"type": "input_image", "image_url": "https://example.com/cat.png"}),  # the Responses API's shape
    said({"type": "image_url", "image_url": {"url": PIXEL}}, {"type": "image_url", "image_url": {"url": " x"}}),
    said({"type": "image_url", "image_url": None, "uuid": "cat-1"}),  # the engine's media cache answers for it
    said({"type": "image_url", "image_url": {"url": PIXEL}, "uuid": "cat-1"}),
    said({"type": "file", "file": {"file_id": "file-1"}}),  # an upload the server holds
    {**BODY, "kv_transfer_params": {"do_remote_prefill": True, "remote_block_ids": [1, 2]}},  # vLLM P/D
    {**BODY, "bootstrap_host": "10.0.0.7", "bootstrap_room": 12345},  # SGLang P/D
])  # fmt: skip
def test_a_request_whose_input_lies_elsewhere_is_not_cached(body):
    """What lies behind a URL may change behind a cached answer: an image at https:// was cached as if the URL
    were the image. So are media the engine looks up (a uuid, a file id) and KV blocks another engine transfers
    (disaggregated prefill, where a replayed answer would also name blocks freed long since)."""
    decision = decide(body)
    assert (decision.key, decision.reason) == (None, "remote_input")
    assert decide(body, cache_sampled=True).reason == "remote_input"


@pytest.mark.parametrize("body", [
    said({"type": "image_url", "image_url": {"url": PIXEL}}),  # the image itself: content, keyed
    said({"type": "image_url", "image_url": {"url": "DATA:image/png;base64,iVBORw0KGgo="}}),
    said({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}),
    said({"type": "text", "text": "see https://example.com/cat.png"}),  # text, never fetched
    {**BODY, "kv_transfer_params": None},
])  # fmt: skip
def test_a_request_that_carries_its_inputs_is_cached(body):
    assert decide(body).key is not None


@pytest.mark.parametrize("part", ["fingerprint", "tenant", "path", "query", "body"])
def test_every_part_changes_the_key(part):
    args = {"path": CHAT, "query": [], "credentials": [("Authorization", "Bearer a")], "body": BODY, "fingerprint": FP}
    changed = dict(args)
    changed[{"tenant": "credentials"}.get(part, part)] = {
        "fingerprint": "f" * 32, "tenant": [("Authorization", "Bearer b")], "path": "/v1/completions",
        "query": [("x", "1")], "body": {**BODY, "max_tokens": 5},
    }[part]  # fmt: skip
    assert key.request_key(**args) != key.request_key(**changed)


@pytest.mark.parametrize("one, other", [
    ("a=%ff", "a=%fe"),  # both decoded to U+FFFD
    ("a=%ff", "a=%EF%BF%BD"),
    ("a=1&a=2", "a=2&a=1"),  # an engine reads the first or the last
])  # fmt: skip
def test_queries_the_engine_reads_apart_have_different_keys(one, other):
    assert key.request_key(CHAT, key.query_pairs(one), [], BODY, FP) != key.request_key(
        CHAT, key.query_pairs(other), [], BODY, FP
    )


@pytest.mark.parametrize("one, other", [("a=1&b=2", "b=2&a=1"), ("a=b+c", "a=b%20c"), ("a=%C3%A9", "a=%c3%a9")])
def test_queries_that_mean_the_same_have_one_key(one, other):
    assert key.query_pairs(one) != [] and key.request_key(CHAT, key.query_pairs(one), [], BODY, FP) == (
        key.request_key(CHAT, key.query_pairs(other), [], BODY, FP)
    )


@pytest.mark.parametrize("name", ["Authorization", "X-Api-Key", "Api-Key", "Cookie", "x-api-key"])
def test_every_credential_header_names_the_tenant(name):
    # Only Authorization did: behind a gateway that authenticates with X-Api-Key every client was one tenant.
    alice, bob = decide(BODY, {name: "alice"}), decide(BODY, {name: "bob"})
    assert alice.key and bob.key and len({alice.key, bob.key, decide(BODY).key}) == 3
    assert decide(BODY, {name: ""}).key != decide(BODY).key  # an empty credential is not no credential


def test_each_credential_header_counts_apart():
    both = decide(BODY, {"Authorization": "Bearer a", "X-Api-Key": "k"}).key
    assert both not in {decide(BODY, {"Authorization": "Bearer a"}).key, decide(BODY, {"X-Api-Key": "k"}).key}
    assert decide(BODY, {"Authorization": "k"}).key != decide(BODY, {"X-Api-Key": "k"}).key


def test_an_operator_names_more_credential_headers():
    names = key.tenant_headers(["X-Goog-Api-Key", "authorization"])
    assert names == (*key.TENANT_HEADERS, "X-Goog-Api-Key")  # each name once, whatever its case
    alice, bob = (decide(BODY, {"X-Goog-Api-Key": who}, tenant_headers=names).key for who in ("alice", "bob"))
    assert alice != bob and alice != decide(BODY, tenant_headers=names).key
    assert decide(BODY, {"X-Goog-Api-Key": "alice"}).key == decide(BODY).key  # not named: not a credential


@pytest.mark.parametrize("pairs", [
    [("X-Api-Key", "alice"), ("X-Api-Key", "bob")],
    [("Api-Key", ""), ("api-key", "bob")],
    [("Cookie", "s=alice"), ("Cookie", "s=bob")],
    [("Authorization", "Bearer a"), ("Authorization", "Bearer a")],
])  # fmt: skip
def test_a_repeated_credential_header_is_not_cached(pairs):
    decision = decide(BODY, CIMultiDict(pairs))
    assert (decision.key, decision.reason) == (None, "ambiguous_auth")
    assert decide(BODY, CIMultiDict(pairs[:1])).key is not None


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "temperature": 0, "temperature": 1, "messages": []}',
    b'{"model": "m", "temperature": 1, "temperature": 0, "messages": []}',
    b'{"model": "m", "temperature": 0, "temperatur\\u0065": 1, "messages": []}',  # one name, escaped
    b'{"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "a", "content": "b"}]}',
    b'{"model": "m", "temperature": 0, "tools": [{"function": {"parameters": {"x": {}, "x": {"type": "int"}}}}]}',
    b'{"model": "m", "temperature": 0, "user": "a", "user": "b"}',  # even a field the key leaves out
])  # fmt: skip
def test_a_body_with_a_repeated_name_at_any_depth_is_not_json(raw):
    # Python keeps the last of two, other parsers the first: an engine may read another request than the key.
    for kw in ({}, {"cache_sampled": True}):
        decision = key.decide(CHAT, [], SENT_AS_JSON, raw, FP, **kw)
        assert (decision.key, decision.reason, decision.body) == (None, "not_json", None)
    assert key.decide(CHAT, [], SENT_AS_JSON, b'{"temperature": 0, "a": {"x": 1}, "b": {"x": 2}}', FP).key is not None


@pytest.mark.parametrize("headers", [
    {},  # vLLM refuses a body without one (validate_json_request); FastAPI alone, as SGLang runs it, reads it as JSON
    {"Content-Type": "text/plain"},  # FastAPI hands the raw bytes to the model: 422; vLLM: 400
    {"Content-Type": "application/x-www-form-urlencoded"},  # what `curl -d` sends unless told otherwise
    {"Content-Type": "application/vnd.api+json"},  # FastAPI reads it as JSON, vLLM refuses it
    {"Content-Type": "multipart/form-data; boundary=x"},
    CIMultiDict([("Content-Type", "application/json"), ("Content-Type", "text/plain")]),  # which one is read?
    # vLLM compares what comes before the ';' unstripped: "application/json " is not its media type (400)
    {"Content-Type": "application/json ;charset=utf-8"},
    {"Content-Type": "application/json\t; charset=utf-8"},
])  # fmt: skip
def test_a_body_the_engine_may_not_read_as_json_is_not_cached(headers):
    """Only a body sent as application/json is one the engines all read as JSON: a hit had answered 200 to a
    text/plain body the engine would have refused, with the answer to the JSON request of the same bytes."""
    decision = key.decide(CHAT, [], headers, json.dumps(BODY).encode(), FP)
    assert (decision.key, decision.reason) == (None, "content_type")


@pytest.mark.parametrize("value", ["application/json", "Application/JSON", "application/json; charset=utf-8",
                                   " application/json;charset=UTF-8 "])  # fmt: skip
def test_application_json_is_one_key_however_spelled(value):
    # vLLM compares the media type alone, lower-cased; json.loads reads the bytes' encoding itself.
    assert key.decide(CHAT, [], {"Content-Type": value}, json.dumps(BODY).encode(), FP).key == decide(BODY).key


def test_zero_point_zero_is_zero():
    assert decide({**BODY, "temperature": 0.0}).key == decide(BODY).key


@pytest.mark.parametrize("body, reason", [
    ({**BODY, "temperature": 0.7}, "sampling"),
    ({k: v for k, v in BODY.items() if k != "temperature"}, "sampling"),  # engines default to sampling
    ({**BODY, "temperature": 1, "seed": True}, "sampling"),  # a bool is not a seed
    ({**BODY, "temperature": 0.9, "seed": -1}, "sampling"),  # vLLM reads -1 as no seed at all
    ({**BODY, "temperature": 0.9, "seed": -2}, ""),
    ({**BODY, "n": 2}, "n"),
    ({**BODY, "temperature": 0.9, "seed": 7}, ""),
    ({**BODY, "n": 1}, ""),
])  # fmt: skip
def test_only_deterministic_requests_are_cacheable(body, reason):
    decision = decide(body)
    assert decision.reason == reason and (decision.key is None) == bool(reason)
    assert decide(body, cache_sampled=True).key is not None


@pytest.mark.parametrize("headers", [{"X-Kcache-Bypass": "1"}, {"Cache-Control": "no-cache"},
                                     {"Cache-Control": "max-age=0, no-store"}])  # fmt: skip
def test_bypass_headers(headers):
    assert decide(BODY, headers).reason == "bypass_header"


@pytest.mark.parametrize("raw", [b"[1]", b"{", b'{"temperature": NaN}', b"\xff"])
def test_bodies_that_are_not_json_objects_bypass(raw):
    assert key.decide(CHAT, [], SENT_AS_JSON, raw, FP).reason == "not_json"


# JSON that parses to something canonical JSON cannot write: no key, no prefix measurement.
NO_CANONICAL_FORM = [
    b'{"temperature": 0, "messages": [{"role": "user", "content": "\\ud800"}]}',  # a lone surrogate, escaped
    b'{"temperature": 0, "prompt": "\xed\xa0\x80"}',  # one in raw bytes (json.loads decodes with surrogatepass)
    b'{"temperature": 0, "top_p": 1e400}',  # overflows to inf
    b'{"temperature": 0, "top_p": -1e400}',
]


@pytest.mark.parametrize("raw", NO_CANONICAL_FORM)
@pytest.mark.parametrize("headers, kw, reason", [
    ({}, {}, "not_json"),
    ({}, {"cache_sampled": True}, "not_json"),
    ({"X-Kcache-Bypass": "1"}, {}, "bypass_header"),
    ({}, {"off": "disabled"}, "disabled"),
])  # fmt: skip
def test_bodies_without_a_canonical_form_are_neither_keyed_nor_measured(raw, headers, kw, reason):
    decision = key.decide(CHAT, [], {**SENT_AS_JSON, **headers}, raw, FP, **kw)
    assert (decision.key, decision.reason, decision.body) == (None, reason, None)
    sampled = key.decide(CHAT, [], SENT_AS_JSON, raw.replace(b'"temperature": 0', b'"temperature": 0.7'), FP)
    assert (sampled.reason, sampled.body) == ("not_json", None)


def test_no_nesting_depth_makes_the_key_or_the_prefix_measurement_raise():
    memory = prefix.PrefixMemory(capacity=10)
    for depth in range(1, sys.getrecursionlimit() + 10):  # from fine, past where the parser gives up
        nested = "[" * depth + "]" * depth
        raw = f'{{"temperature": 0, "messages": [{{"role": "user", "content": {nested}}}]}}'.encode()
        decision = key.decide(CHAT, [], SENT_AS_JSON, raw, FP)
        assert (decision.key is None) == (decision.body is None), depth
        if decision.body is not None:
            memory.observe(FP, CHAT, decision.body)
        raw = f'{{"temperature": 0, "prompt": {nested}}}'.encode()
        completion = key.decide("/v1/completions", [], SENT_AS_JSON, raw, FP)
        assert (completion.key is None) == (completion.body is None), depth


def test_fingerprint_comes_from_the_restore_state(tmp_path):
    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": FP})
    assert key.fingerprint_from_root(tmp_path) == FP
    write_marker(tmp_path, RESTORE_MARKER, {"status": "miss", "bundle_key": "../../etc"})
    with pytest.raises(ConfigError, match="bundle_key"):
        key.fingerprint_from_root(tmp_path)
    with pytest.raises(ConfigError, match="kcache restore"):
        key.fingerprint_from_root(tmp_path / "nothing")


@given(st.lists(st.sampled_from([b"data: x", b"\n", b"\r", b"\r\n", b"y", b":c"]), max_size=20))
def test_events_never_change_a_byte(pieces):
    body = b"".join(pieces)
    assert b"".join(sse.events(body)) == body


@given(st.lists(st.sampled_from([b"data: x", b"\n", b"\r", b"\r\n", b"y" * 700, b":c"]), max_size=60),
       st.sampled_from([1, 100, 1000]))  # fmt: skip
def test_batches_are_runs_of_whole_events_never_changing_a_byte(pieces, at_least):
    body = b"".join(pieces)
    batches = list(sse.batches(body, at_least))
    assert b"".join(batches) == body
    assert all(len(b) >= at_least for b in batches[:-1])
    ends = {0}
    for event in sse.events(body):
        ends.add(max(ends) + len(event))
    cuts = [sum(len(b) for b in batches[: i + 1]) for i in range(len(batches))]
    assert set(cuts) <= ends  # every cut falls where an event ends


def test_a_stream_of_more_events_than_a_replay_may_write_is_neither_stored_nor_served():
    many = b"\n\n" * entry.MAX_EVENTS + b"data: [DONE]\n\n"
    stream = (("Content-Type", "text/event-stream"),)
    assert entry.storable(200, stream, many) == "too_large"
    with pytest.raises(entry.BadEntry, match="events"):
        unseal(seal(entry.Entry(200, stream, many, True)), max_bytes=len(many) + 4096)
    fewer = many[len(b"\n\n") :]
    assert unseal(seal(entry.Entry(200, stream, fewer, True)), max_bytes=len(many) + 4096).body == fewer


def test_a_stream_is_complete_only_when_it_ends_with_done_and_no_error():
    ok = b'data: {"choices": []}\n\ndata: [DONE]\n\n'
    assert sse.complete(ok)
    assert not sse.complete(ok[: -len(b"data: [DONE]\n\n")])  # cut short
    assert not sse.complete(b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n')
    assert not sse.complete(b"data: not json\n\ndata: [DONE]\n\n")
    assert sse.complete(b': keep-alive\r\n\r\ndata: {"a": 1}\r\n\r\ndata: [DONE]\r\n\r\n')


SECRET = b"s" * entry.MIN_SECRET_BYTES
MAC = entry.tenant_key(SECRET, [])  # the anonymous tenant's
NOW = 1_700_000_000_000  # Unix ms
LATER = NOW + 60_000


def seal(e: entry.Entry, name: str = "k", mac_key: bytes = MAC) -> bytes:
    return entry.encode(e, name=name, mac_key=mac_key, expires_ms=LATER)


def unseal(raw: bytes, name: str = "k", mac_key: bytes = MAC, max_bytes: int = 1 << 20, now_ms: int = NOW):
    return entry.decode(raw, max_bytes=max_bytes, name=name, mac_key=mac_key, now_ms=now_ms)


def test_entries_round_trip_and_refuse_tampering():
    e = entry.Entry(200, (("Content-Type", "application/json"), ("X-Request-Id", "7")), b'{"choices": []}', False)
    raw = seal(e, "p:k1")
    assert unseal(raw, "p:k1") == e
    refused = [
        (raw, "p:k2", MAC),  # copied from another key: another request's, tenant's or fingerprint's answer
        (raw, "p:k1", entry.tenant_key(b"t" * 32, [])),  # tagged under another secret
        (raw, "p:k1", entry.tenant_key(SECRET, [("Authorization", "Bearer t")])),  # for another tenant
        (raw[: -TAG - 1] + b"]" + raw[-TAG:], "p:k1", MAC),  # the body changed
        (raw.replace(b'"X-Request-Id","7"', b'"X-Request-Id","8"'), "p:k1", MAC),  # a header changed
    ]
    for value, name, mac_key in refused:
        with pytest.raises(entry.BadEntry, match="not written by a proxy with this entry key"):
            unseal(value, name, mac_key)
    with pytest.raises(entry.BadEntry, match="expired"):  # saved, and SET again with a fresh Redis expiry
        unseal(raw, "p:k1", now_ms=LATER)


TAG = 32


def _tagged(signed: bytes, name: bytes = b"k", mac_key: bytes = MAC) -> bytes:
    """A value as a writer holding the key would tag it: this is the format, written out again."""
    mac = hmac.new(mac_key, b"%d:%s" % (len(name), name), hashlib.sha256)
    mac.update(signed)
    return signed + mac.digest()


def test_the_tag_covers_the_key_name_and_the_value():
    e = entry.Entry(200, (("Content-Type", "application/json"),), b'{"choices": []}', False)
    signed = (b'kcp3\n{"expires":1700000060000,"headers":[["Content-Type","application/json"]],"status":200,'
              b'"stream":false}\n{"choices": []}')  # fmt: skip
    assert seal(e) == _tagged(signed)


def test_tenant_keys_are_pinned_and_need_the_credential():
    assert entry.tenant_key(SECRET, []) == hmac.digest(SECRET, b"kcache-proxy-tenant-key-1", "sha256")
    bearer = entry.tenant_key(SECRET, [("Authorization", "Bearer t")])
    assert bearer == entry.tenant_key(SECRET, [("authorization", "Bearer t")])  # names are case-insensitive
    assert bearer == hmac.digest(SECRET, b"kcache-proxy-tenant-key-1" + b"13:authorization8:Bearer t", "sha256")
    assert bearer.hex().startswith("af1e9585")  # a golden value: the derivation never changes by accident
    others = [[("Authorization", "Bearer u")], [("X-Api-Key", "Bearer t")], [("Authorization", "")],
              [("Authorization", "Bearer t"), ("Cookie", "c")], []]  # fmt: skip
    assert len({bearer, *(entry.tenant_key(SECRET, creds) for creds in others)}) == len(others) + 1
    # Framed by length: moving a byte between a name and its value is another tenant.
    assert entry.tenant_key(SECRET, [("a", "bc")]) != entry.tenant_key(SECRET, [("ab", "c")])


def _head(head: bytes) -> bytes:
    return _tagged(entry.MAGIC + head + b'\n{"choices": []}')


@pytest.mark.parametrize("raw", [
    _tagged(entry.MAGIC + b"[" * 200_000 + b"\n{}"),  # nested past the parser's recursion limit
    _head(b'{"expires": 1700000060000, "headers": [["X-A", "\\ud800"]], "status": 200, "stream": false}'),
    _head(b'{"expires": 1700000060000, "headers": [["X-A", "\xed\xa0\x80"]], "status": 200, "stream": false}'),
    _head(b'{"expires": 1700000060000, "headers": [], "status": 200, "stream": false}\xff'),  # not UTF-8
    _head(b'{"expires": 1700000060000, "headers": [], "status": 2e400, "stream": false}'),
    _head(b'{"expires": 1700000060000, "headers": [], "status": 500, "stream": false}'),
    _head(b'{"expires": 1700000060000, "headers": [], "status": 200}'),
    _head(b'{"headers": [], "status": 200, "stream": false}'),  # no expiry
    _head(b'{"expires": 1700000060000.5, "headers": [], "status": 200, "stream": false}'),
    _head(b'{"expires": true, "headers": [], "status": 200, "stream": false}'),
    _head(b'["headers"]'),
    _tagged(entry.MAGIC + b'{"expires": 1700000060000, "headers": [], "status": 200, "stream": false}'),  # no body line
    b'kcp2\n{"headers":[],"key":"k","sha256":"' + hashlib.sha256(b"{}").hexdigest().encode()
    + b'","status":200,"stream":false}\n{}',  # the previous format: no tag, so anyone could write it
    _tagged(b"kcp2\n" + b'{"headers": [], "status": 200, "stream": false}\n{}'),
    entry.MAGIC,
    entry.MAGIC + b"x" * TAG,
    b"",
])  # fmt: skip
def test_every_value_that_does_not_decode_is_a_bad_entry(raw):
    with pytest.raises(entry.BadEntry):
        unseal(raw)


def test_an_entry_over_the_size_limit_is_a_bad_entry():
    raw = seal(entry.Entry(200, (), b'{"choices": []}', False))
    assert unseal(raw, max_bytes=len(raw)).body == b'{"choices": []}'
    with pytest.raises(entry.BadEntry, match="larger than"):
        unseal(raw, max_bytes=len(raw) - 1)


@pytest.mark.parametrize("content, why", [
    (None, "cannot be read"),
    ("", "holds 0 bytes"),
    ("  \n", "holds 0 bytes"),
    ("x" * 31 + "\n", "holds 31 bytes"),
])  # fmt: skip
def test_an_entry_secret_that_is_missing_empty_or_short_is_refused(tmp_path, content, why):
    path = tmp_path / "entry-key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=why):
        entry.read_secret(path)


def test_an_entry_secret_is_the_files_bytes_without_the_whitespace_around_them(tmp_path):
    (tmp_path / "a").write_text("k" * 64 + "\n")
    (tmp_path / "b").write_text("k" * 64)
    assert entry.read_secret(tmp_path / "a") == entry.read_secret(tmp_path / "b") == b"k" * 64
    with pytest.raises(ConfigError, match="regular file"):
        entry.read_secret(tmp_path)


@pytest.mark.parametrize("status, headers, body, reason", [
    (200, (("Content-Type", "application/json"),), b'{"choices": []}', ""),
    (500, (("Content-Type", "application/json"),), b'{"choices": []}', "upstream_error"),
    (200, (("Content-Type", "application/json"),), b'{"error": {"message": "x"}}', "upstream_error"),
    (200, (("Content-Type", "application/json"),), b"not json", "upstream_error"),
    (200, (("Content-Type", "text/event-stream"),), b"data: [DONE]\n\n", ""),
    (200, (("Content-Type", "text/event-stream"),), b'data: {"a": 1}\n\n', "upstream_error"),
    # SGLang's graceful abort: a 200, the tokens so far, and for a stream [DONE]
    (200, (("Content-Type", "application/json"),), b'{"choices": [{"finish_reason": "abort"}]}', "upstream_error"),
    (200, (("Content-Type", "text/event-stream"),),
     b'data: {"choices": [{"finish_reason": "abort"}]}\n\ndata: [DONE]\n\n', "upstream_error"),
    (200, (("Content-Type", "application/json"),), b'{"choices": [{"finish_reason": "error"}]}', "upstream_error"),
    (200, (("Content-Type", "application/json"),), b'{"choices": [{"finish_reason": {"type": "x"}}]}', ""),
])  # fmt: skip
def test_only_complete_successful_answers_are_storable(status, headers, body, reason):
    assert entry.storable(status, headers, body) == reason


JSON_TYPE = ("Content-Type", "application/json")


@pytest.mark.parametrize("headers", [
    (JSON_TYPE, ("X-Server", "caf\udce9")),  # aiohttp's reading of a Latin-1 byte (surrogateescape)
    (JSON_TYPE, *((f"X-H{i}", "v") for i in range(entry.MAX_HEADERS))),
    (JSON_TYPE, ("X-Odd", "a\x01b")),
    (JSON_TYPE, ("Bad Name", "v")),
], ids=["not-utf8", "too-many", "control-character", "not-a-token"])  # fmt: skip
def test_an_answer_whose_headers_could_not_be_read_back_is_not_storable(headers):
    """Encoding a non-UTF-8 header raised in the handler after the body was sent (a streamed answer lost
    its last chunk); 65 headers were stored and then refused on every read, a miss each time."""
    assert entry.storable(200, headers, b'{"choices": []}') == "headers"


header_texts = st.text(alphabet=st.characters(codec="utf-8") | st.sampled_from("\udce9\x01\x7f"), max_size=6)


@given(st.lists(st.tuples(header_texts, header_texts), max_size=entry.MAX_HEADERS + 2))
def test_whatever_is_storable_reads_back_as_it_was(headers):
    headers = tuple(headers)
    if entry.storable(200, headers, b'{"choices": []}') == "":
        raw = seal(entry.Entry(200, headers, b'{"choices": []}', False))
        assert unseal(raw, max_bytes=len(raw)).headers == headers


def test_prefix_memory_measures_the_longest_seen_prefix_at_message_boundaries():
    memory = prefix.PrefixMemory(capacity=100)
    turns = [("system", "be brief"), ("user", "hi"), ("assistant", "hello"), ("user", "more")]
    sys_msg, u1, a1, u2 = ({"role": r, "content": c} for r, c in turns)
    first = memory.observe(FP, CHAT, {"model": "m", "messages": [sys_msg, u1]})
    assert first.seen == 0 and first.total == sum(len(json.dumps(m, separators=(",", ":"))) for m in (sys_msg, u1))
    second = memory.observe(FP, CHAT, {"model": "m", "messages": [sys_msg, u1, a1, u2]})
    assert second.seen == first.total and second.total > first.total
    assert memory.observe(FP, CHAT, {"model": "other", "messages": [sys_msg, u1]}).seen == 0
    assert memory.observe("f" * 32, CHAT, {"model": "m", "messages": [sys_msg, u1]}).seen == 0


def test_prefix_memory_forgets_the_oldest():
    memory = prefix.PrefixMemory(capacity=2)
    memory.observe(FP, "/v1/completions", {"prompt": "a" * prefix.BLOCK_CHARS * 3})
    assert memory.observe(FP, "/v1/completions", {"prompt": "a" * prefix.BLOCK_CHARS}).seen == 0


@pytest.mark.parametrize("path, body", [
    (CHAT, {"model": "m", "messages": [0] * 300_000}),
    ("/v1/completions", {"model": "m", "prompt": "a" * (prefix.BLOCK_CHARS * 300_000)}),
    ("/v1/completions", {"model": "m", "prompt": [1] * (prefix.BLOCK_TOKENS * 300_000)}),
], ids=["messages", "text", "tokens"])  # fmt: skip
def test_a_prompt_is_measured_over_its_first_segments_only(path, body):
    """A body of millions of one-byte messages, 64 MiB at most, took a canonical dump, a hash and an LRU
    update each on the proxy's event loop: ~100 s in which no other client was served."""
    memory = prefix.PrefixMemory(capacity=10**7)
    measured = prefix.segments(path, body)
    assert len(measured) == prefix.MAX_SEGMENTS
    first = memory.observe(FP, path, body)
    assert (first.seen, first.total) == (0, sum(map(len, measured)))
    assert memory.observe(FP, path, body).seen == first.total
