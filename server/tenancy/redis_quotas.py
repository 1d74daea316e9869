"""Tenants' quotas in Redis: the calls, one round trip each, over `redis_scripts`' Lua scripts.

This module speaks to Redis and nothing else; what to do when Redis cannot be reached is
`quota_store`'s decision. Every call is bounded by `timeout_s`, connecting included, so a dead
Redis costs one request at most `timeout_s` and never blocks the event loop (the client is
redis-py's asyncio one). A call is retried once, at once and within the same bound, only when
its connection broke (a pooled connection that a restarted Redis closed fails on first use);
every script is safe to run twice. redis-py's default (three retries with backoff, on timeouts
too) could hold an admission for seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from loraplex.server.tenancy.errors import RateLimited
from loraplex.server.tenancy.quotas import Demand, Reservation, refusal, reservation_for
from loraplex.server.tenancy.redis_scripts import ACQUIRE, RELEASE, RENEW
from loraplex.server.tenancy.settings import Quotas

KEY_PREFIX = "loraplex:quota:"
# A lease lapses this long after its last renewal; replicas renew every third of it. A replica
# that dies gives its tenants' concurrency back within this time, and renewal costs each replica
# one pipelined round trip every 10 s, however many requests it holds.
LEASE_TTL_S = 30.0
# Connections per replica: a call holds one for a round trip (~0.1 ms on loopback), so 32 serve
# far more admissions a second than an engine does; more callers wait for a free one.
MAX_CONNECTIONS = 32

_REFUSALS = {1: "max_concurrent", 2: "tokens_per_minute", 3: "requests_per_minute"}


def _port(port: int | None) -> str:
    return f":{port}" if port else ""


class QuotaStoreError(Exception):
    """Redis could not be reached, answered an error, or took longer than the timeout (any
    failure of the call: none may reach a client as a 500). Whether the call took effect is
    unknown."""


@dataclass(frozen=True)
class Lease:
    """A request's hold on its tenant's quotas in Redis: `member` in the tenant's lease set,
    `<replica>:<serial>:<sequences>`, and what its admission took."""

    tenant_id: str
    member: str
    reservation: Reservation


class RedisQuotas:
    """One replica's connection to the shared quota store. Safe to use from one event loop."""

    def __init__(
        self,
        url: str,
        timeout_s: float,
        *,
        lease_ttl_s: float = LEASE_TTL_S,
        prefix: str = KEY_PREFIX,
    ) -> None:
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1, (RedisConnectionError,)),
        )
        self._redis = Redis(connection_pool=pool)
        parts = urlsplit(url)  # for logs: the URL without its credentials
        self.address = f"{parts.scheme}://{parts.hostname or ''}{_port(parts.port)}{parts.path}"
        self._timeout_s = timeout_s
        self.lease_ttl_s = lease_ttl_s
        self._prefix = prefix
        self._replica = secrets.token_hex(6)
        self._serials = itertools.count()
        self._acquire = self._redis.register_script(ACQUIRE)
        self._release = self._redis.register_script(RELEASE)
        self._renew = self._redis.register_script(RENEW)

    def _keys(self, tenant_id: str) -> list[str]:
        state = f"{self._prefix}{{{tenant_id}}}"
        return [state, state + ":leases"]

    def new_lease(self, tenant_id: str, quotas: Quotas, demand: Demand) -> Lease:
        """A lease, not yet taken, for `demand`: `acquire` takes it."""
        reservation = reservation_for(quotas, demand)
        member = f"{self._replica}:{next(self._serials)}:{demand.n}"
        return Lease(tenant_id, member, reservation)

    async def acquire(self, lease: Lease, quotas: Quotas, demand: Demand) -> RateLimited | None:
        """Take `lease` from the tenant's quotas if every limit allows it (None), else take
        nothing and return the 429 naming the quota and its Retry-After. Raises
        QuotaStoreError (the lease may or may not have been taken: `release` it to be sure)."""
        args = (
            quotas.max_concurrent, quotas.requests_per_minute, quotas.tokens_per_minute,
            demand.n, lease.reservation.tokens, lease.member, self.lease_ttl_s,
        )  # fmt: skip
        code, wait, held = await self._call(self._acquire(self._keys(lease.tenant_id), args))
        if code == 0:
            return None
        return refusal(_REFUSALS[int(code)], quotas, demand, int(held), float(wait))

    async def release(
        self, lease: Lease, quotas: Quotas, *, requests_back: int, tokens_back: int
    ) -> bool:
        """Drop `lease`, giving `requests_back` sequences and `tokens_back` tokens back to the
        limited buckets (tokens_back < 0 charges them). Only a lease still held is dropped and
        refunded: True if it was. Raises QuotaStoreError."""
        args = (
            lease.member, quotas.requests_per_minute, requests_back,
            quotas.tokens_per_minute, tokens_back, self.lease_ttl_s,
        )  # fmt: skip
        return bool(await self._call(self._release(self._keys(lease.tenant_id), args)))

    async def renew(self, members: dict[str, list[str]], *, load_scripts: bool = False) -> None:
        """Extend the leases `{tenant: [member, ...]}` this replica holds by the lease ttl, taking
        again any that lapsed or vanished; one pipelined round trip (and, with `load_scripts`,
        every script loaded in it, so that the next admissions need no second round trip to
        load theirs into a Redis that restarted without them). Raises QuotaStoreError."""
        pipe = self._redis.pipeline(transaction=False)
        if load_scripts:
            for script in (self._acquire, self._release, self._renew):
                pipe.script_load(script.script)
        for tenant_id, held in members.items():
            await self._renew(self._keys(tenant_id), [self.lease_ttl_s, *held], client=pipe)
        if not members:
            pipe.ping()
        await self._call(pipe.execute())

    async def _call(self, call: Awaitable[Any]) -> Any:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await call
        except TimeoutError as e:
            raise QuotaStoreError(f"no answer within {self._timeout_s} s") from e
        except Exception as e:  # whatever the client raises (RedisError, OSError, a bad reply)
            raise QuotaStoreError(f"{type(e).__name__}: {e}") from e

    async def aclose(self) -> None:
        await self._redis.aclose()
