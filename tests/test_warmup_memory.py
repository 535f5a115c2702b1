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


class _BatchServer:
    """Answers a completion once the whole batch has arrived, as a batcher does; reads and drops the
    request bodies a piece at a time (this process's memory is what the test measures)."""

    def __init__(self, batch_size: int):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        gathered = threading.Barrier(batch_size, timeout=120)
        self.prompt_bytes: list[int] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _answer(self, body: bytes):
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._answer(b'{"data": [{"id": "m"}]}')

            def do_POST(handler):
                left = int(handler.headers["Content-Length"])
                self.prompt_bytes.append(left)
                while left:
                    left -= len(handler.rfile.read(min(left, 64 * 1024)))
                gathered.wait()
                handler._answer(b'{"choices": [{"text": "x"}]}')

        class Server(ThreadingHTTPServer):
            request_queue_size = 4 * batch_size  # a batch connects at once (socketserver's default: 5)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._server.shutdown()
        self._server.server_close()


def test_a_batch_of_long_prompts_holds_the_prompt_once_not_once_per_request():
    """Each of a batch's B requests built its own prompt, then its JSON, then its bytes, and held them
    until the server answered (a batcher answers once the batch is in): a profile within the limits,
    64 x 1M tokens, took kcache warmup to 933 MiB, over the sidecar's 1 GiB at 128, 14 GiB at 1024."""
    import tracemalloc

    batch = Profile("long", 16, 1 << 20, 1)
    with _BatchServer(batch.batch_size) as server:
        target = warmup.HttpTarget(server.url, wait_timeout=10, retries=0)
        target.prepare()
        tracemalloc.start()
        try:
            target(batch)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    one = server.prompt_bytes[0]
    assert len(server.prompt_bytes) == batch.batch_size and one > 5 << 20
    assert peak < 3 * one, f"{peak >> 20} MiB traced for a batch of {batch.batch_size} prompts of {one >> 20} MiB"


def test_parallel_batches_hold_at_most_the_batch_limit_of_answers_together(monkeypatch):
    """Each batch's answers were capped at MAX_BATCH_ANSWERS, but --parallel runs several batches at
    once: --parallel 4 let a server that holds its padded answers back to the last byte take warmup
    to 1.9 GiB (one batch: 0.4 GiB), and --parallel goes to 64. A batch now waits for room."""
    import threading

    monkeypatch.setattr(warmup_http, "MAX_BATCH_ANSWERS", 8 << 20)  # the test's scale; the rule is the same
    batches = [Profile(f"b{i}", 16, 8, 2048) for i in range(4)]  # each may hold the whole limit
    per_answer = warmup_http.answer_limit(batches[0])
    fits = warmup_http.MAX_BATCH_ANSWERS // per_answer
    assert fits == 16
    # A request past what fits in the limit trips the barrier; with room for one batch at a time
    # none ever does, and the barrier's wait ends at its timeout instead.
    past_the_limit = threading.Barrier(fits + 1, timeout=5)
    in_flight, most, lock = [0], [0], threading.Lock()

    def batcher(server, conn, request):
        with lock:
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
        try:
            past_the_limit.wait()
        except threading.BrokenBarrierError:
            pass
        with lock:
            in_flight[0] -= 1
        server.send(conn, answer("200 OK", COMPLETION))

    with HostileServer({"POST /v1/completions": batcher}) as server:
        target = warmup.HttpTarget(server.url, wait_timeout=10, retries=0)
        report = warmup.run(target, batches, parallel=len(batches))
    assert report.status == "ok", [r.error for r in report.results]
    assert most[0] * per_answer <= warmup_http.MAX_BATCH_ANSWERS, f"{most[0]} answers of {per_answer} B at once"
