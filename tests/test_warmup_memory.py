"""What a warmup server's answers may cost in memory: a batch of B holds B answers at once, so a
server that pads each one must not be able to take the sidecar's memory (tests/hostile_http.py)."""

from hostile_http import COMPLETION, HostileServer, answer

from kcache import warmup, warmup_http
from kcache.profiles import Profile


def padded(size: int):
    """A valid completion whose text is `size` bytes: what a real answer of few tokens never is."""
    data = answer("200 OK", {"choices": [{**COMPLETION["choices"][0], "text": "x" * size}]})
    return lambda server, conn, request: server.send(conn, data)


def run(server, profile):
    return warmup.run(warmup.HttpTarget(server.url, wait_timeout=10, retries=0), [profile])


def test_a_batch_of_padded_answers_is_refused_before_it_is_held():
    batch = Profile("batch", 64, 8, 16)  # vLLM warms up batches this large and larger
    with HostileServer({"POST /v1/completions": padded(5 * 1024 * 1024)}) as server:  # each under 8 MiB
        report = run(server, batch)
    assert report.status == "failed"
    assert f"over the {warmup_http.answer_limit(batch)}-byte limit" in report.results[0].error
    assert warmup_http.answer_limit(batch) * batch.batch_size <= warmup_http.MAX_BATCH_ANSWERS


def test_an_answer_far_longer_than_its_tokens_is_refused():
    one = Profile("one", 1, 8, 4)
    with HostileServer({"POST /v1/completions": padded(2 * 1024 * 1024)}) as server:
        report = run(server, one)
    assert report.status == "failed" and "byte limit" in report.results[0].error


def test_real_answers_fit_the_limit_of_any_profile():
    # Generous for real text: a token is a few bytes, JSON escapes it to at most six times that.
    for profile in (Profile("a", 1, 8, 1), Profile("b", 16, 8, 4096), Profile("c", 1024, 8, 4096)):
        assert warmup_http.answer_limit(profile) >= 8 * 6 * profile.output_tokens + 16 * 1024
    long = Profile("long", 1, 8, 1 << 17)
    assert warmup_http.answer_limit(long) == warmup_http.MAX_COMPLETION_ANSWER
    with HostileServer({"POST /v1/completions": padded(4 * 1024)}) as server:
        assert run(server, Profile("fine", 4, 8, 64)).status == "ok"
