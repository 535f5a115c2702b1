"""What `kcache proxy` costs and gives, against calling the engine directly, in one run.

    upstream   a minimal OpenAI-compatible engine (aiohttp, own process) that answers
               /v1/chat/completions after --engine-ms; 0 measures the proxy's pure overhead
    proxy      the real `kcache proxy` CLI in its own process, on Redis at --redis
    client     aiohttp, keep-alive, in this process

Phases: sequential latency (p50/p99) of direct calls, proxy misses (every request new) and proxy
hits (one request repeated); then throughput with --clients concurrent clients for each. Figures
are printed as milliseconds and as ratios to the direct call; --json prints one JSON object.
On a small shared machine all four processes (client, proxy, engine, Redis) compete for cores:
the ratios are the figure to read, not the absolute numbers.

    python scripts/bench_proxy.py [--requests 400] [--clients 64] [--engine-ms 0] [--redis-timeout S]
                                  [--redis redis://127.0.0.1:6379/0] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import multiprocessing
import re
import subprocess
import sys
import time
import uuid

import aiohttp
import redis

CHAT = "/v1/chat/completions"


def _engine(port_box, engine_ms: float) -> None:
    """The stand-in engine's process: a fixed-size answer that echoes the prompt's length."""
    from aiohttp import web

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        if engine_ms:
            await asyncio.sleep(engine_ms / 1000)
        text = " tok" * 64
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model"), "usage": {"prompt_tokens": len(json.dumps(body)), "completion_tokens": 64},
            "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": text}}],
        })  # fmt: skip

    async def main() -> None:
        app = web.Application()
        app.router.add_post(CHAT, chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_box.put(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


def ask(i: int) -> bytes:
    return json.dumps({"model": "bench-model", "temperature": 0, "max_tokens": 64,
                       "messages": [{"role": "system", "content": "You are terse. " * 30},
                                    {"role": "user", "content": f"question number {i}"}]}).encode()  # fmt: skip


OUTCOMES: collections.Counter = collections.Counter()  # (phase, X-Kcache-Cache) -> requests


async def timed(session: aiohttp.ClientSession, url: str, body: bytes, phase: str) -> float:
    """Seconds for one request; what the proxy did with it is counted, not required: under load a
    Redis call past --redis-timeout turns a miss or a hit into a bypass, and that is part of the figure."""
    started = time.perf_counter()
    async with session.post(url + CHAT, data=body, headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{url}: status {resp.status}")
        OUTCOMES[phase, resp.headers.get("X-Kcache-Cache", "direct")] += 1
    return time.perf_counter() - started


async def latencies(session, url: str, n: int, bodies, phase) -> list[float]:
    return [await timed(session, url, bodies(i), phase) for i in range(n)]


async def throughput(session, url: str, n: int, clients: int, bodies, phase) -> float:
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            await timed(session, url, bodies(i), phase)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return n / (time.perf_counter() - started)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(engine_url: str, proxy_url: str, metrics_url: str, args) -> dict:
    n, clients = args.requests, args.clients
    fresh = iter(range(10**9))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        hit_body = ask(-1)
        await timed(session, proxy_url, hit_body, "warm")  # the one answer the hit phases replay
        for _ in range(20):  # warm connections and code paths
            await timed(session, engine_url, ask(0), "warm")
        seq = {
            "direct": await latencies(session, engine_url, n, ask, "direct"),
            "miss": await latencies(session, proxy_url, n, lambda _i: ask(next(fresh)), "miss"),
            "hit": await latencies(session, proxy_url, n, lambda _i: hit_body, "hit"),
        }
        async with session.get(metrics_url) as resp:
            sequential_metrics = await resp.text()  # before concurrency adds event-loop queueing to it
        rps = {
            "direct": await throughput(session, engine_url, n * 2, clients, ask, "direct@64"),
            "miss": await throughput(session, proxy_url, n * 2, clients, lambda _i: ask(next(fresh)), "miss@64"),
            "hit": await throughput(session, proxy_url, n * 2, clients, lambda _i: hit_body, "hit@64"),
        }
    return report(seq, rps, sequential_metrics, args)


def report(seq: dict[str, list[float]], rps: dict[str, float], metrics_text: str, args) -> dict:
    direct50, direct99 = percentile(seq["direct"], 0.5), percentile(seq["direct"], 0.99)
    out = {"requests": args.requests, "clients": args.clients, "engine_ms": args.engine_ms,
           "redis_timeout": args.redis_timeout}  # fmt: skip
    for kind in ("direct", "miss", "hit"):
        p50, p99 = percentile(seq[kind], 0.5), percentile(seq[kind], 0.99)
        out[kind] = {"p50_ms": round(p50 * 1000, 3), "p99_ms": round(p99 * 1000, 3),
                     "p50_ratio": round(p50 / direct50, 3), "p99_ratio": round(p99 / direct99, 3),
                     "added_p50_ms": round((p50 - direct50) * 1000, 3),
                     "rps": round(rps[kind], 1), "rps_ratio": round(rps[kind] / rps["direct"], 3)}  # fmt: skip
    for outcome in ("hit", "miss"):  # what the proxy itself measured, over the sequential phases
        total = _sample(metrics_text, "kcache_proxy_added_seconds_sum", outcome)
        count = _sample(metrics_text, "kcache_proxy_added_seconds_count", outcome)
        out[outcome]["self_reported_added_mean_ms"] = round(total / count * 1000, 3) if count else None
    out["outcomes"] = {f"{phase}:{answer}": n for (phase, answer), n in sorted(OUTCOMES.items()) if phase != "warm"}
    return out


def _sample(text: str, name: str, outcome: str) -> float:
    found = re.search(rf'^{name}{{outcome="{outcome}"}} (\S+)$', text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def start_proxy(engine_url: str, args, prefix: str) -> tuple[subprocess.Popen, str, str]:
    """The proxy's process, its URL and its metrics URL."""
    argv = [sys.executable, "-m", "kcache", "proxy", "--upstream", engine_url, "--redis", args.redis, "--port", "0",
            "--metrics-port", "0", "--key-prefix", prefix, "--model", "bench/model", "--ttl", "10m"]  # fmt: skip
    if args.redis_timeout is not None:
        argv += ["--redis-timeout", str(args.redis_timeout)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    metrics = re.search(r"metrics on (http://127\.0\.0\.1:\d+/metrics)", line)
    if found is None or metrics is None:
        proc.kill()
        raise SystemExit(f"bench_proxy: kcache proxy did not start: {line!r}")
    return proc, f"http://127.0.0.1:{found[1]}", metrics[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400, help="sequential requests per phase (throughput: 2x)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--engine-ms", type=float, default=0.0, help="the stand-in engine's time per answer")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--redis-timeout", type=float, help="passed to kcache proxy (default: the proxy's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    port_box = multiprocessing.Queue()
    engine = multiprocessing.Process(target=_engine, args=(port_box, args.engine_ms), daemon=True)
    engine.start()
    engine_url = f"http://127.0.0.1:{port_box.get(timeout=30)}"
    prefix = f"kcache-bench:{uuid.uuid4().hex}:"
    proxy, proxy_url, metrics_url = start_proxy(engine_url, args, prefix)
    try:
        out = asyncio.run(measure(engine_url, proxy_url, metrics_url, args))
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        engine.terminate()
        client = redis.Redis.from_url(args.redis)
        keys = list(client.scan_iter(prefix + "*", count=1000))
        for i in range(0, len(keys), 500):
            client.delete(*keys[i : i + 500])
    if args.json:
        print(json.dumps(out))
        return
    print(f"kcache proxy vs direct: {args.requests} sequential requests per phase, {args.clients} clients for "
          f"throughput, engine {args.engine_ms:g} ms")  # fmt: skip
    print(f"{'':8} {'p50 ms':>8} {'p99 ms':>8} {'p50 x':>7} {'p99 x':>7} {'added p50':>10} {'req/s':>8} {'req/s x':>8}")
    for kind in ("direct", "miss", "hit"):
        r = out[kind]
        print(f"{kind:8} {r['p50_ms']:8.3f} {r['p99_ms']:8.3f} {r['p50_ratio']:7.2f} {r['p99_ratio']:7.2f} "
              f"{r['added_p50_ms']:+9.3f}  {r['rps']:8.0f} {r['rps_ratio']:8.2f}")  # fmt: skip
    print("what the proxy answered: " + ", ".join(f"{k} {v}" for k, v in out["outcomes"].items()))
    for kind in ("miss", "hit"):
        print(f"proxy's own added-latency mean, sequential ({kind}): {out[kind]['self_reported_added_mean_ms']} ms")


if __name__ == "__main__":
    main()
