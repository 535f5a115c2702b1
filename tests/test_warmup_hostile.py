"""The warmup HTTP client against servers that lie, stall, flood or redirect (tests/hostile_http.py)."""

import json

from click.testing import CliRunner
from hanging_server import SilentServer
from hostile_http import (
    COMPLETION,
    HostileServer,
    answer,
    endless_chunks,
    fail_then_ok,
    huge_body,
    ok,
    redirect,
    trickle,
)
from openai_server import OpenAIServer

from kcache import http_client, readiness, warmup, warmup_http
from kcache.cli import main
from kcache.cli.errors import ExitCode
from kcache.profiles import Profile

ONE = [Profile("p", 1, 4, 1)]


def run(server, profiles=ONE, **kwargs):
    kwargs = {"wait_timeout": 10, "retries": 0, "backoff": 0.01, **kwargs}
    return warmup.run(warmup.HttpTarget(server.url, **kwargs), profiles)


def test_a_2gb_body_is_refused_without_reading_it():
    with HostileServer({"POST /v1/completions": huge_body}) as server:
        report = run(server)
    assert report.status == "failed"
    assert f"over the {warmup_http.answer_limit(ONE[0])}-byte limit" in report.results[0].error
    assert server.sent < 2 * warmup_http.MAX_COMPLETION_ANSWER  # what the socket buffers took, not 2 GB


def test_an_endless_chunked_body_stops_at_the_cap():
    with HostileServer({"POST /v1/completions": endless_chunks, "GET /v1/models": endless_chunks}) as server:
        report = run(server)
    assert report.status == "failed"
    assert f"over the {warmup_http.answer_limit(ONE[0])}-byte limit" in report.results[0].error
    assert server.sent < 4 * warmup_http.MAX_COMPLETION_ANSWER


def test_a_byte_at_a_time_body_meets_the_request_deadline():
    whole = answer("200 OK", {**COMPLETION, "pad": "x" * 300})
    with HostileServer({"POST /v1/completions": trickle(whole)}) as server:
        report = run(server, request_timeout=0.5)
    assert report.results[0].error == "no complete answer within 0.5 s (--request-timeout)"
    assert server.sent < len(whole)  # the client gave up long before the answer was complete


def test_byte_at_a_time_headers_meet_the_deadline_too():
    head = b"HTTP/1.1 200 OK\r\n" + b"X-Slow: " + b"y" * 400 + b"\r\n\r\n"
    with HostileServer({"POST /v1/completions": trickle(head)}) as server:
        report = run(server, request_timeout=0.5)
    assert "no complete answer within 0.5 s" in report.results[0].error
    assert server.sent < len(head)


def test_a_redirected_post_is_never_followed_or_counted_as_success():
    with HostileServer({"GET /v1/completions": ok(COMPLETION), "POST /v1/completions": ok(COMPLETION)}) as sink:
        with HostileServer({"POST /v1/completions": redirect(sink.url + "/v1/completions")}) as server:
            report = run(server)
    assert report.status == "failed"
    assert "HTTP 302 redirect to http://127.0.0.1" in report.results[0].error
    assert "follows no redirects" in report.results[0].error
    assert sink.requests == []


def test_a_redirected_health_check_is_not_healthy():
    with HostileServer({"GET /health": redirect("http://127.0.0.1:9/health")}) as server:
        report = run(server, wait_timeout=0.3, poll_interval=0.05)
    assert report.status == "failed" and "GET /health: HTTP 302 redirect" in report.error


def test_the_wait_message_names_the_wait_flag(tmp_path):
    with SilentServer() as server:
        result = CliRunner().invoke(main, ["warmup", "--url", server.url, "--wait-timeout", "0.3"])
    assert result.exit_code == ExitCode.WARMUP
    assert "was not healthy within 0.3 s (--wait-timeout): no complete answer within" in result.output
    assert "--request-timeout" not in result.output


def test_hostile_reason_and_location_text_is_made_printable():
    evil = "\x1b]2;pwned\x07" + "A" * 5000
    with HostileServer({"POST /v1/completions": redirect(evil, status="302 \x1b[31mred")}) as server:
        report = run(server)
    error = report.results[0].error
    assert "\x1b" not in error and "\x07" not in error and len(error) < 700


# ---- retries --------------------------------------------------------------------------------------


def test_a_transient_503_is_retried_and_warmup_succeeds(tmp_path):
    with HostileServer({"POST /v1/completions": fail_then_ok(2)}) as server:
        result = CliRunner().invoke(main, ["warmup", "--url", server.url, "--retries", "3", "--root", str(tmp_path),
                                           "--profiles", _one_profile(tmp_path), "--json"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["status"] == "ok"
    assert server.requests.count(("POST", "/v1/completions")) == 3
    assert readiness.read_marker(tmp_path, readiness.WARMUP_MARKER)["status"] == "ok"


def test_without_retries_one_503_fails_the_profile():
    with HostileServer({"POST /v1/completions": fail_then_ok(1)}) as server:
        report = run(server, retries=0)
    assert report.status == "failed" and report.results[0].error.startswith("HTTP 503")


def test_a_client_error_is_not_retried():
    with HostileServer({"POST /v1/completions": fail_then_ok(5, status="400 Bad Request")}) as server:
        report = run(server, retries=4)
    assert report.status == "failed" and report.results[0].error.startswith("HTTP 400")
    assert server.requests.count(("POST", "/v1/completions")) == 1


def test_retries_stop_when_the_budget_is_spent():
    with HostileServer({"POST /v1/completions": fail_then_ok(10**9)}) as server:
        report = run(server, retries=10**6, budget=1.0, backoff=0.05)
    assert report.status == "failed" and "(--budget)" in report.results[0].error
    assert server.requests.count(("POST", "/v1/completions")) < 1000  # bounded by the budget, not the retries


def test_retries_are_logged_one_line_each(caplog):
    caplog.set_level("INFO", logger="kcache.warmup_http")
    with HostileServer({"POST /v1/completions": fail_then_ok(1)}) as server:
        assert run(server, retries=1).status == "ok"
    (line,) = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert "HTTP 503" in line


def test_a_url_that_is_not_http_is_a_config_error():
    for bad in ("ftp://x", "http://", "http://host:notaport", "http://[::1:8000", "http://a..b:8000"):
        try:
            http_client.split_url(bad)
        except http_client.ConfigError as exc:
            assert exc.what == "--url"
        else:
            raise AssertionError(bad)


def test_warmup_appends_its_paths_to_the_url_without_its_query_or_trailing_slash():
    with OpenAIServer() as server:
        target = warmup_http.HttpTarget(server.url + "/?tenant=a#x", wait_timeout=5)
        target.prepare()
    assert server.health_checks == 1 and target.model == OpenAIServer.MODEL


def _one_profile(tmp_path):
    path = tmp_path / "one.yaml"
    path.write_text("profiles:\n  - {name: p, batch_size: 1, input_tokens: 4, output_tokens: 1}\n")
    return str(path)
