"""Server-sent events, as far as a cache needs them: cut a recorded stream into its events without
changing a byte, batch them into writes, and tell a finished stream from a broken one.

An event ends at a blank line (LF LF, CR LF CR LF or CR CR, per the HTML spec). OpenAI-compatible
engines send `data: {json}` events and finish with `data: [DONE]`; an error after the 200 arrives as
`data: {"error": ...}`, and an answer the engine stopped short as a choice whose finish_reason is
CUT_SHORT: SGLang ends one aborted gracefully (its /abort_request, a session closed) that way, with
the tokens it had so far, a 200 and, for a stream, `data: [DONE]` after it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import islice

_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_LINE = re.compile(rb"\r\n|\n|\r")
DONE = b"[DONE]"
# A replay writes runs of whole events of at least this many bytes: one write per event cost a
# cached stream of 2-byte events ~4 s of the event loop, every other client's time included.
MIN_WRITE_BYTES = 16 * 1024
CUT_SHORT = frozenset({"abort", "error"})  # finish reasons of an answer that is not whole


def events(body: bytes) -> list[bytes]:
    """`body` cut after each event's blank line; b"".join(events(body)) == body, always."""
    pieces, start = [], 0
    for end in _END.finditer(body):
        pieces.append(body[start : end.end()])
        start = end.end()
    if start < len(body):
        pieces.append(body[start:])
    return pieces


def count(body: bytes, limit: int) -> int:
    """How many events `body` holds, counting no further than limit + 1."""
    n = last = 0
    for end in islice(_END.finditer(body), limit + 1):
        n, last = n + 1, end.end()
    return n + (1 if n <= limit and last < len(body) else 0)  # what follows the last blank line is one more


def batches(body: bytes, at_least: int = MIN_WRITE_BYTES) -> Iterator[bytes]:
    """`body` cut after event boundaries into pieces of at least `at_least` bytes (the last may be
    shorter); b"".join(batches(body)) == body, always."""
    start = 0
    for end in _END.finditer(body):
        if end.end() - start >= at_least:
            yield body[start : end.end()]
            start = end.end()
    if start < len(body):
        yield body[start:]


def data(event: bytes) -> bytes | None:
    """The event's data (its `data:` lines joined by LF), or None when it has none (a comment, a retry)."""
    lines = [line for line in _LINE.split(event) if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:] for line in lines)


def cut_short(doc: dict) -> bool:
    """Whether an answer (a whole one, or one event of a stream) has a choice the engine stopped short."""
    choices = doc.get("choices")
    return isinstance(choices, list) and any(
        isinstance(c, dict) and isinstance(c.get("finish_reason"), str) and c["finish_reason"] in CUT_SHORT
        for c in choices
    )


def complete(body: bytes) -> bool:
    """True for a stream that ended with [DONE], whose every other event is a JSON object without `error`
    and with no choice cut short."""
    payloads = [d for d in (data(e) for e in events(body)) if d is not None]
    if not payloads or payloads[-1] != DONE or not body.endswith((b"\n\n", b"\r\n\r\n", b"\r\r")):
        return False
    for payload in payloads[:-1]:
        try:
            doc = json.loads(payload)
        except (ValueError, RecursionError):  # RecursionError: an event nested past the parser's limit
            return False
        if not isinstance(doc, dict) or "error" in doc or cut_short(doc):
            return False
    return True
