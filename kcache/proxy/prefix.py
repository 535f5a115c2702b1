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
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kcache import canonical

BLOCK_CHARS = 256
BLOCK_TOKENS = 16  # vLLM's default KV block size


@dataclass(frozen=True)
class Seen:
    total: int  # bytes of the prompt, canonical JSON of its segments
    seen: int  # bytes of the longest prefix seen before


def segments(path: str, body: Mapping[str, Any]) -> list[bytes]:
    """The prompt of a chat or completion request, cut at reusable boundaries ([] when there is none)."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        return [canonical.dumps(m) for m in messages] if isinstance(messages, list) else []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [canonical.dumps(prompt[i : i + BLOCK_CHARS]) for i in range(0, len(prompt), BLOCK_CHARS)]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [canonical.dumps(prompt[i : i + BLOCK_TOKENS]) for i in range(0, len(prompt), BLOCK_TOKENS)]
    return []  # a batch of prompts: each would need its own chain; not measured


class PrefixMemory:
    """Chained prefix hashes of the prompts forwarded to the engine, the `capacity` most recent kept."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._hashes: OrderedDict[bytes, None] = OrderedDict()

    def observe(self, fingerprint: str, path: str, body: Mapping[str, Any]) -> Seen:
        """Measure this prompt against what was seen, then remember it."""
        parts = segments(path, body)
        root = {"fingerprint": fingerprint, "model": body.get("model"), "path": path}
        if path.endswith("/chat/completions"):
            root["tools"] = body.get("tools")
        chain = hashlib.sha256(canonical.dumps(root)).digest()
        total = seen = 0
        for part in parts:
            chain = hashlib.sha256(chain + part).digest()
            total += len(part)
            if chain in self._hashes:
                seen = total
            self._remember(chain)
        return Seen(total, seen)

    def _remember(self, digest: bytes) -> None:
        self._hashes[digest] = None
        self._hashes.move_to_end(digest)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)
