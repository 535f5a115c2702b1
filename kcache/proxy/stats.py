"""The proxy's counters and their Prometheus text on GET /metrics.

    kcache_proxy_info{fingerprint}                1; the bundle key answers are filed under ("" when none)
    kcache_proxy_requests_total{outcome}          hit | miss | bypass | pass (a path the cache never answers)
    kcache_proxy_bypasses_total{reason}           bypass_header | disabled | no_fingerprint | content_type |
                                                  not_json | ambiguous_auth | remote_input | too_large |
                                                  sampling | n | redis
    kcache_proxy_not_stored_total{reason}         upstream_error | headers | too_large | redis | client_gone | error
    kcache_proxy_redis_errors_total{kind}         timeout | error | bad_entry | busy (no connection free in time)
    kcache_proxy_redis_up                         0 while Redis is skipped after a failure
    kcache_proxy_redis_waiting                    Redis calls waiting for a connection (--redis-connections)
    kcache_proxy_hit_bytes_total                  bytes answered from the cache
    kcache_proxy_stored_bytes_total               bytes written to Redis
    kcache_proxy_added_seconds{outcome}           histogram: time the proxy adds (a hit: all of it;
                                                  otherwise total minus the time spent waiting on upstream)
    kcache_proxy_prompt_bytes_total               prompt bytes forwarded to the engine
    kcache_proxy_prompt_seen_bytes_total          of which the longest prefix already seen (kcache.proxy.prefix)
    kcache_proxy_prefix_seen_ratio                the two above divided: high means turn on prefix caching

One event loop owns a Stats, so the counters need no lock.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from kcache import metrics

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
OUTCOMES = ("hit", "miss", "bypass", "pass")


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        for bound, count in zip(BUCKETS + (float("inf"),), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        out.append(f"{name}_sum{{{labels}}} {self.total!r}")
        out.append(f"{name}_count{{{labels}}} {running}")
        return out


@dataclass
class Stats:
    fingerprint: str = ""
    requests: Counter = field(default_factory=Counter)
    bypasses: Counter = field(default_factory=Counter)
    not_stored: Counter = field(default_factory=Counter)
    redis_errors: Counter = field(default_factory=Counter)
    redis_up: bool = True
    redis_waiting: int = 0
    hit_bytes: int = 0
    stored_bytes: int = 0
    prompt_bytes: int = 0
    prompt_seen_bytes: int = 0
    added: dict[str, Histogram] = field(default_factory=lambda: {o: Histogram() for o in OUTCOMES})

    def render(self) -> str:
        ratio = self.prompt_seen_bytes / self.prompt_bytes if self.prompt_bytes else 0.0
        families = [
            metrics.family("kcache_proxy_info", "gauge", "1; the fingerprint (bundle key) answers are filed under.",
                           ({"fingerprint": self.fingerprint}, 1)),
            _labelled("kcache_proxy_requests_total", "Requests by how they were answered.", "outcome", self.requests),
            _labelled("kcache_proxy_bypasses_total", "Requests the cache could not answer, by reason.", "reason",
                      self.bypasses),
            _labelled("kcache_proxy_not_stored_total", "Answers forwarded but not cached, by reason.", "reason",
                      self.not_stored),
            _labelled("kcache_proxy_redis_errors_total", "Redis calls that failed, by kind.", "kind",
                      self.redis_errors),
            metrics.family("kcache_proxy_redis_up", "gauge", "0 while Redis is skipped after a failure.",
                           ({}, 1 if self.redis_up else 0)),
            metrics.family("kcache_proxy_redis_waiting", "gauge",
                           "Redis calls waiting for a connection (--redis-connections are in use).",
                           ({}, self.redis_waiting)),
            metrics.family("kcache_proxy_hit_bytes_total", "counter", "Bytes answered from the cache.",
                           ({}, self.hit_bytes)),
            metrics.family("kcache_proxy_stored_bytes_total", "counter", "Bytes written to Redis.",
                           ({}, self.stored_bytes)),
            metrics.family("kcache_proxy_prompt_bytes_total", "counter", "Prompt bytes forwarded to the engine.",
                           ({}, self.prompt_bytes)),
            metrics.family("kcache_proxy_prompt_seen_bytes_total", "counter",
                           "Forwarded prompt bytes in the longest prefix seen before.", ({}, self.prompt_seen_bytes)),
            metrics.family("kcache_proxy_prefix_seen_ratio", "gauge",
                           "Seen prefix bytes / prompt bytes; high means the engine's prefix cache pays.",
                           ({}, ratio)),
        ]  # fmt: skip
        return metrics.render(families) + self._histogram()

    def _histogram(self) -> str:
        name = "kcache_proxy_added_seconds"
        lines = [f"# HELP {name} Seconds the proxy adds to a request, by outcome.", f"# TYPE {name} histogram"]
        for outcome, histogram in self.added.items():
            lines += histogram.lines(name, f'outcome="{outcome}"')
        return "\n".join(lines) + "\n"


def _labelled(name: str, help_: str, label: str, counter: Counter) -> metrics.Family:
    return metrics.family(name, "counter", help_, *(({label: k}, v) for k, v in sorted(counter.items())))
