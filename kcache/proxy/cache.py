"""The answers in Redis: one key per request key, with a TTL; Redis's own maxmemory policy evicts.

    <prefix><request key>   an entry (kcache.proxy.entry), SET with PX = the TTL

A value is read with GETRANGE 0..max_bytes, never GET: one round trip like GET, but a value that
someone else wrote larger than this proxy ever would is read only up to one byte past the bound,
which is enough to know it is not an entry. (STRLEN first would cost a second round trip on every
hit; a pipelined STRLEN + GET would still carry the whole value.) GETRANGE answers "" for an
absent key, and no entry is empty, so "" is a plain miss. A value of another type (a list, a hash)
answers WRONGTYPE: Redis is up and the key holds no entry, so it is a bad entry like any other,
and the next answer's SET replaces it, not a failure that would switch the cache off for everyone.
The value's PTTL comes in the same pipeline: one without an expiry (-1) or with a longer one than
this proxy gives (--ttl) was not written as this proxy writes, and would outlive what the operator
chose, so it is a bad entry too (the tag, kcache.proxy.entry, cannot cover what Redis keeps apart).
Not a MULTI: Redis over maxmemory queues no command in one, so a full Redis (noeviction) refused
every lookup; the two need not be atomic, as a PTTL that belongs to a newer value can only pass a
value whose tagged expiry (what bounds its life) still holds.

Every call is bounded by `timeout` (asyncio's, on top of the socket timeouts), and redis-py's own
retries are off, so a dead or stopped Redis costs a request at most one timeout. After
FAILURES_TO_SKIP failures in a row the cache is skipped for `retry_after` seconds: a black-holed
Redis would otherwise add the timeout to every request, while one slow reply in a burst (a busy
event loop counts against the timeout too) should not turn the cache off. An error reply (OOM when
Redis is full, READONLY from a replica) is no such failure: Redis answered, in one round trip, and
the next lookup may well be served, so it never starts the skipping. Failures never raise past this
module except as CacheUnavailable, which the server turns into a pass-through; nor does a server that
answers a command with a reply of another kind than Redis gives (a string for HELLO's map, for PTTL's
integer): redis-py raised AttributeError on it, the lookup a TypeError, and the client got a 500.

At most `connections` calls run at once, each on a connection of its own, so the pool never holds
more (a pool's own bound, a max_connections in the URL, lowers it): a slow Redis with many clients
would otherwise get one connection per request in flight. A call waits for its turn within the same
`timeout` as the rest of it; when none comes in time (kind "busy", no Redis failure: the turns are
this proxy's own limit) or Redis was skipped meanwhile, the request goes to the engine uncached. A turn
that comes with less than FAIR_SHARE of the timeout left is busy too, and Redis is not asked: the wait was
the proxy's (its connections, its loop), and a turn granted at the deadline had timed out without sending
Redis a byte, counted as Redis failing: three turned the cache off while Redis answered all it was sent.
So every timeout that counts gave Redis at least that share, and a stopped Redis is still skipped after
FAILURES_TO_SKIP of them, before those waiting open connections of their own.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeout

from kcache.errors import CacheUnavailable, ConfigError
from kcache.proxy import entry as entries
from kcache.proxy.stats import Stats

log = logging.getLogger(__name__)

FAILURES_TO_SKIP = 3
# The share of the timeout a call must still have once its turn comes for a timeout to count as Redis failing.
FAIR_SHARE = 0.5


class ResultCache:
    def __init__(self, url: str, stats: Stats, *, prefix: str, ttl: float, timeout: float, retry_after: float,
                 max_bytes: int, connections: int = 64):  # fmt: skip
        try:
            self._redis = redis.Redis.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False, health_check_interval=0, max_connections=connections,
            )  # fmt: skip
        except ValueError as exc:
            raise ConfigError("--redis", url, str(exc)) from None  # ConfigError redacts what it shows
        self._turns = asyncio.Semaphore(min(connections, self._redis.connection_pool.max_connections))
        self.prefix, self.ttl, self.timeout, self.retry_after = prefix, ttl, timeout, retry_after
        self.max_bytes = max_bytes  # the largest entry this proxy writes (--max-entry-bytes)
        self.stats = stats
        self._down_until = 0.0
        self._failures = 0  # in a row

    @property
    def up(self) -> bool:
        up = time.monotonic() >= self._down_until
        self.stats.redis_up = up
        return up

    def name(self, key: str) -> str:
        """The Redis key of request key `key`: what an entry's tag covers."""
        return self.prefix + key

    async def get(self, key: str, mac_key: bytes) -> entries.Entry | None:
        """The entry for `key`, tagged under `mac_key` (entry.tenant_key); None when absent or not one
        of ours (a miss, overwritten by the next answer). Raises CacheUnavailable."""
        try:
            pipe = self._redis.pipeline(transaction=False)  # one round trip; not MULTI (see the module docstring)
            pipe.getrange(self.name(key), 0, self.max_bytes)  # end inclusive
            pipe.pttl(self.name(key))
            raw, pttl = await self._call(pipe.execute(raise_on_error=False))
            if isinstance(raw, ResponseError) and str(raw).startswith("WRONGTYPE"):
                raise entries.BadEntry("the key holds a value of another type")
            if isinstance(raw, Exception) or isinstance(pttl, Exception):
                self._refused(raw if isinstance(raw, Exception) else pttl)
            if not isinstance(raw, bytes) or not isinstance(pttl, int) or isinstance(pttl, bool):
                log.debug("redis answered GETRANGE with a %s, PTTL with a %s", type(raw).__name__,
                          type(pttl).__name__)  # fmt: skip
                self._fail("error")  # not Redis as this proxy knows it: a failing one
            if not raw:
                return None
            if not 0 < pttl <= self._ttl_ms:  # -1: no expiry; -2: gone since, and then raw was ""
                raise entries.BadEntry(f"expires in {pttl} ms, not within --ttl")
            return entries.decode(raw, max_bytes=self.max_bytes, name=self.name(key), mac_key=mac_key,
                                  now_ms=_now_ms())  # fmt: skip
        except entries.BadEntry as exc:
            log.warning("ignoring the Redis value at %s%s: %s", self.prefix, key[:16], exc)
            self.stats.redis_errors["bad_entry"] += 1
            return None

    async def put(self, key: str, raw: bytes) -> None:
        """Store an encoded entry under `key` for the TTL. Raises CacheUnavailable."""
        await self._call(self._redis.set(self.name(key), raw, px=self._ttl_ms))

    def expiry_ms(self) -> int:
        """When an entry written now expires, in Unix ms: what its tag covers (Redis's PX is not)."""
        return _now_ms() + self._ttl_ms

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl * 1000))

    async def _call(self, command):
        """`command` (a coroutine not yet started) in its turn, within `timeout` from now in all."""
        deadline = time.monotonic() + self.timeout
        try:
            await self._turn(deadline)
        except BaseException:  # CacheUnavailable, or the request cancelled while it waited (the proxy stopping)
            command.close()  # the coroutine never ran; close it so Python does not warn
            raise
        try:
            result = await asyncio.wait_for(command, max(0.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, TimeoutError, RedisTimeout):
            self._fail("timeout")
        except ResponseError as exc:
            self._refused(exc)
        except Exception as exc:  # RedisError, OSError, or redis-py choking on a reply of the wrong kind
            log.debug("redis: %s", exc)
            self._fail("error")
        finally:
            self._turns.release()
        self._failures = 0
        return result

    async def _turn(self, deadline: float) -> None:
        """One of the `connections` turns, waited for until `deadline`. Raises CacheUnavailable."""
        if not self.up:
            raise CacheUnavailable("skipped")
        self.stats.redis_waiting += 1
        try:
            if self._turns.locked():  # wait_for, not asyncio.timeout: that is Python 3.11's (kcache runs on 3.10)
                await asyncio.wait_for(self._turns.acquire(), max(0.0, deadline - time.monotonic()))
            else:  # a free turn is taken at once, without a task to wait on
                await self._turns.acquire()
        except (asyncio.TimeoutError, TimeoutError):  # two classes before Python 3.11
            self.stats.redis_errors["busy"] += 1
            raise CacheUnavailable("busy") from None
        finally:
            self.stats.redis_waiting -= 1
        if not self.up:  # skipped while it waited: what Redis cost the calls before it is spent once
            self._turns.release()
            raise CacheUnavailable("skipped")
        if deadline - time.monotonic() < self.timeout * FAIR_SHARE:  # too late to judge Redis by (the docstring)
            self._turns.release()
            self.stats.redis_errors["busy"] += 1
            raise CacheUnavailable("busy")

    def _fail(self, kind: str):
        self.stats.redis_errors[kind] += 1
        self._failures += 1
        if self._failures >= FAILURES_TO_SKIP:
            self._failures = 0
            self._down_until = time.monotonic() + self.retry_after
            self.stats.redis_up = False
            log.warning("Redis %s, %d times in a row; answering from upstream only for %g s", kind,
                        FAILURES_TO_SKIP, self.retry_after)  # fmt: skip
        raise CacheUnavailable(kind)

    def _refused(self, exc: Exception):
        """Redis answered with an error: up, so the failures in a row end, and nothing is skipped."""
        log.debug("redis refused: %s", exc)
        self.stats.redis_errors["error"] += 1
        self._failures = 0
        raise CacheUnavailable("refused")

    async def close(self) -> None:
        await self._redis.aclose()


def _now_ms() -> int:
    return int(time.time() * 1000)  # wall clock: replicas that share Redis share it, unlike monotonic time
