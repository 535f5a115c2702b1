"""`kcache proxy`: an OpenAI-compatible caching reverse proxy keyed by the pod's fingerprint.

    key.py      which requests are cacheable; the request key (pure: no aiohttp, no redis)
    entry.py    a cached answer's bytes in Redis, and which answers may become one
    sse.py      server-sent events: cut a stream into events byte for byte; tell a finished one
    prefix.py   longest previously seen prompt prefix (what the engine's prefix cache could reuse)
    cache.py    Redis with a bounded timeout and a back-off after failures (the only redis importer)
    stats.py    counters and /metrics
    server.py   the aiohttp server and client (the only aiohttp importer)

Only this package imports aiohttp and redis, and only `kcache proxy` imports this package's
server, lazily: `kcache restore` in an init container never pays for either.
"""
