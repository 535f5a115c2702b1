"""Text from the store, the index or the network, made safe to show on one line.

Such text (a ref's bundle key, a manifest's fields, an S3 error's <Code> and <Message>) reaches
kcache.env comments, the terminal and logs. A newline ends a shell comment, so the next line
runs when the pod sources the file; an escape sequence rewrites the terminal; a lone surrogate
cannot even be encoded; a megabyte of error body floods a log. So such text is shown as one line
without control or format characters, and bounded.
"""

from __future__ import annotations

import logging
import unicodedata

LIMIT = 300  # characters: enough for any message kcache writes, short enough for a log line
_WHITESPACE_CONTROLS = frozenset("\t\n\v\f\r\x1c\x1d\x1e\x1f\x85")


def is_utf8(text: str) -> bool:
    """Whether `text` has a UTF-8 form: a lone surrogate (bytes no encoding names, read from a
    file name, an environment variable or JSON's \\ud800 escape) has none."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def one_line(text: object, limit: int = LIMIT) -> str:
    """`text` on one line: controls that break lines become spaces, other control, format,
    surrogate, private and unassigned characters become '?', runs of spaces collapse, and
    anything past `limit` characters is cut (marked with '...')."""
    raw = str(text)[: limit * 4]  # bound the work on huge input before looking at characters
    if raw.isascii() and raw.isprintable():  # the common case, no character to replace: skip the per-character walk
        line = " ".join(raw.split())
        return line if len(line) <= limit else line[: limit - 3] + "..."
    chars = []
    for ch in raw:
        category = unicodedata.category(ch)
        if ch in _WHITESPACE_CONTROLS or category in ("Zl", "Zp"):
            chars.append(" ")
        elif category.startswith("C"):
            chars.append("?")
        else:
            chars.append(ch)
    line = " ".join("".join(chars).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class OneLineFormatter(logging.Formatter):
    """Log lines for a terminal: each message on one line (tracebacks, with KCACHE_DEBUG=1, stay)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = one_line(record.message, limit=2000)
        return super().formatMessage(record)
