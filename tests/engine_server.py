"""tests/openai_server.py's server, answering the way vLLM does where a caching proxy can tell.

Adds POST /v1/chat/completions, `stream: true` (server-sent events over chunked HTTP/1.1, one chunk
per event, ending with `data: [DONE]`), a fresh `id` and `created` in every answer (so a replayed
answer is told from a regenerated one), and `error_mid_stream`: a 200 stream that reports an error
as an event, as vLLM does when generation fails after the headers went out, and `gate`, which holds a stream
after its first event until the test sets it; `cut_mid_stream` drops the connection there; `abort` ends every answer
with finish_reason "abort", as SGLang ends one aborted gracefully (its /abort_request): a 200, its tokens so far, and
for a stream `data: [DONE]`. A `priority` other than 0 is refused (400), as vLLM refuses it unless started with
`--scheduling-policy priority`. `sent` holds the exact
body bytes of every answer, `headers` the request headers of every POST (`header_lists` with repeated names kept).
"""

from __future__ import annotations

import itertools
import json

from openai_server import OpenAIServer

SSE_TYPE = "text/event-stream; charset=utf-8"


class EngineServer(OpenAIServer):
    def __init__(self, *, error_mid_stream: bool = False, cut_mid_stream: bool = False, abort: bool = False,
                 gate=None, **kwargs):  # fmt: skip
        self.error_mid_stream, self.cut_mid_stream, self.abort = error_mid_stream, cut_mid_stream, abort
        self.gate = gate  # a threading.Event: a stream waits on it after its first event
        self.sent: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.header_lists: list[list[tuple[str, str]]] = []
        self._ids = itertools.count(1)
        super().__init__(**kwargs)

    def _handler(self):
        owner = self
        base = super()._handler()

        class Handler(base):
            protocol_version = "HTTP/1.1"  # keep-alive and chunked streams, like uvicorn

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner._lock:
                    owner.completions.append(body)
                    owner.headers.append(dict(self.headers))
                    owner.header_lists.append(list(self.headers.items()))
                    n = next(owner._ids)
                if owner.fail_status:
                    self._send(owner.fail_status, {"error": {"message": "engine exploded", "code": owner.fail_status}})
                    return
                if body.get("priority", 0) != 0:  # vLLM without --scheduling-policy priority (its default)
                    self._send(400, {"error": {"message": f"Got priority {body['priority']} but Priority scheduling "
                                                          "is not enabled.", "code": 400}})  # fmt: skip
                    return
                chat = self.path.startswith("/v1/chat/")
                tokens = [f" t{i}" for i in range(int(body.get("max_tokens") or 4))]
                if body.get("stream"):
                    events = [owner.chunk(n, body, chat, t) for t in tokens]
                    if owner.abort:
                        events[-1]["choices"][0]["finish_reason"] = "abort"
                    self._stream(events)
                else:
                    doc = owner.whole(n, body, chat, "".join(tokens))
                    with owner._lock:
                        owner.sent.append(json.dumps(doc).encode())
                    self._send(200, doc)

            def _stream(self, events: list[dict]) -> None:
                payloads = [json.dumps(e) for e in events]
                if owner.error_mid_stream:
                    payloads = payloads[:1] + [json.dumps({"error": {"message": "engine died", "code": 500}})]
                pieces = [f"data: {p}\n\n".encode() for p in payloads] + [b"data: [DONE]\n\n"]
                with owner._lock:
                    owner.sent.append(b"".join(pieces))
                self.send_response(200)
                self.send_header("Content-Type", SSE_TYPE)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for i, piece in enumerate(pieces):
                    self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    self.wfile.flush()
                    if i == 0 and owner.gate is not None:
                        owner.gate.wait(30)
                    if i == 0 and owner.cut_mid_stream:  # the engine process dies: no more chunks, no terminator
                        self.close_connection = True
                        return
                self.wfile.write(b"0\r\n\r\n")

        return Handler

    def chunk(self, n: int, body: dict, chat: bool, token: str) -> dict:
        choice = {"index": 0, "finish_reason": None}
        choice.update({"delta": {"content": token}} if chat else {"text": token})
        kind = "chat.completion.chunk" if chat else "text_completion"
        return {"id": f"cmpl-{n}", "object": kind, "created": 1_700_000_000 + n, "model": body.get("model"),
                "choices": [choice]}  # fmt: skip

    def whole(self, n: int, body: dict, chat: bool, text: str) -> dict:
        choice = {"index": 0, "finish_reason": "abort" if self.abort else "length"}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        kind = "chat.completion" if chat else "text_completion"
        return {"id": f"cmpl-{n}", "object": kind, "created": 1_700_000_000 + n, "model": body.get("model"),
                "choices": [choice]}  # fmt: skip
