"""How much of each prompt the engine has already seen: the case for its prefix (KV) cache.

A prompt is cut at boundaries the engine's prefix cache can reuse: each chat message, or every
BLOCK_CHARS characters (BLOCK_TOKENS tokens) of a completion prompt. Segment i is known by a chained
hash h_i = sha256(h_{i-1} + canonical(segment_i)); the chain starts from the fingerprint, the model
and (for chat) the tools, which chat templates render ahead of the first message. The longest
prefix seen before is the last segment whose hash is remembered.

The memory is per proxy, in process, LRU-bounded: an engine's KV cache is per engine, so a prefix
that only another replica saw would not be reused here either. Tenants are not separated: engines
share their prefix cache across tenants too.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kcache import canonical

BLOCK_CHARS = 256
BLOCK_TOKENS = 16  # vLLM's default KV block size
# Segments measured of one prompt, its first: each costs a canonical dump, a hash and an LRU update on
# the proxy's event loop, and a 64 MiB body of one-byte messages had ~30 million of them (~100 s in which
# no other client was served). 16384 blocks are 4 MiB of text or 262k tokens.
MAX_SEGMENTS = 16384


@dataclass(frozen=True)
class Seen:
    total: int  # bytes of the prompt measured, canonical JSON of its segments
    seen: int  # bytes of the longest prefix seen before


def segments(path: str, body: Mapping[str, Any]) -> list[bytes]:
    """The first MAX_SEGMENTS segments of a chat or completion request's prompt, cut at reusable
    boundaries ([] when there is none)."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        return [canonical.dumps(m) for m in messages[:MAX_SEGMENTS]] if isinstance(messages, list) else []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ends = range(0, min(len(prompt), BLOCK_CHARS * MAX_SEGMENTS), BLOCK_CHARS)
        return [canonical.dumps(prompt[i : i + BLOCK_CHARS]) for i in ends]
    head = prompt[: BLOCK_TOKENS * MAX_SEGMENTS] if isinstance(prompt, list) else None
    if head and all(isinstance(t, int) for t in head):
        ends = range(0, len(head), BLOCK_TOKENS)
        return [canonical.dumps(prompt[i : i + BLOCK_TOKENS]) for i in ends]
    return []  # a batch of prompts: each would need its own chain; not measured


def chain(fingerprint: str, path: str, body: Mapping[str, Any]) -> tuple[tuple[int, bytes], ...]:
    """Each measured segment's size and chained hash: all PrefixMemory needs of a prompt, so that the parsed
    body (up to ~30 times its raw size) need not be kept until the prompt is measured."""
    root = {"fingerprint": fingerprint, "model": body.get("model"), "path": path}
    if path.endswith("/chat/completions"):
        root["tools"] = body.get("tools")
    digest = hashlib.sha256(canonical.dumps(root)).digest()
    links = []
    for part in segments(path, body):
        digest = hashlib.sha256(digest + part).digest()
        links.append((len(part), digest))
    return tuple(links)


class PrefixMemory:
    """Chained prefix hashes of the prompts forwarded to the engine, the `capacity` most recent kept."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()  # the proxy measures on worker threads

    def observe(self, fingerprint: str, path: str, body: Mapping[str, Any]) -> Seen:
        """Measure this prompt against what was seen, then remember it."""
        return self.see(chain(fingerprint, path, body))

    def see(self, links: tuple[tuple[int, bytes], ...]) -> Seen:
        """observe() of the prompt whose chain() this is."""
        total = seen = 0
        with self._lock:
            for size, digest in links:
                total += size
                if digest in self._hashes:
                    seen = total
                self._remember(digest)
        return Seen(total, seen)

    def _remember(self, digest: bytes) -> None:
        self._hashes[digest] = None
        self._hashes.move_to_end(digest)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)
