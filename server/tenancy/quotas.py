"""Per-tenant quotas: concurrent requests, requests per minute, tokens per minute.

Rates are token buckets holding one minute's allowance and refilling continuously. Requests are
taken from their bucket on admission. Tokens are charged when they are known (prompt and generated
counts at the end of a request), so the token bucket may go into debt; a tenant in debt is refused
until the refill pays it back, and Retry-After says when that will be.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from loraplex.server.tenancy.errors import RateLimited
from loraplex.server.tenancy.settings import Quotas

Clock = Callable[[], float]


class TokenBucket:
    """`per_minute` units per minute, at most one minute's worth banked."""

    def __init__(self, per_minute: int, clock: Clock) -> None:
        self.capacity = float(per_minute)
        self._rate = per_minute / 60.0
        self._clock = clock
        self._level = self.capacity
        self._at = clock()

    def _refill(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self._rate)
        self._at = now
        return self._level

    def try_take(self, n: float = 1.0) -> float:
        """Take `n` units if available and return 0.0; else take nothing and return the wait."""
        level = self._refill()
        if level >= n:
            self._level = level - n
            return 0.0
        return (n - level) / self._rate

    def debt_wait(self) -> float:
        """Seconds until the bucket is out of debt (0.0 if it is not in debt)."""
        level = self._refill()
        return 0.0 if level >= 0 else -level / self._rate

    def charge(self, n: float) -> None:
        """Take `n` units unconditionally (the bucket may go negative)."""
        self._level = self._refill() - n

    def give_back(self, n: float) -> None:
        """Return `n` units taken for something that did not happen (up to capacity)."""
        self._level = min(self.capacity, self._refill() + n)

    def resized(self, per_minute: int) -> TokenBucket:
        """A bucket of the new rate holding this one's level: what is left (up to the new
        capacity), or the debt."""
        bucket = TokenBucket(per_minute, self._clock)
        bucket._level = min(bucket.capacity, self._refill())
        return bucket


class QuotaGate:
    """The quotas of one tenant. Not thread-safe: used from the event loop only."""

    def __init__(self, quotas: Quotas, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self.in_flight = 0
        self._requests: TokenBucket | None = None
        self._tokens: TokenBucket | None = None
        self.set_quotas(quotas)

    def set_quotas(self, quotas: Quotas) -> None:
        """Apply new limits; requests in flight keep counting, and a rate that stays limited
        keeps its level: what is left of it, or its debt (an admin edit is no way out of debt)."""
        self.quotas = quotas
        rpm, tpm = quotas.requests_per_minute, quotas.tokens_per_minute
        self._requests = self._bucket(self._requests, rpm)
        self._tokens = self._bucket(self._tokens, tpm)

    def _bucket(self, old: TokenBucket | None, per_minute: int | None) -> TokenBucket | None:
        if not per_minute:
            return None
        return old.resized(per_minute) if old else TokenBucket(per_minute, self._clock)

    def admit(self) -> None:
        """Count one request in, or raise RateLimited naming the exhausted quota."""
        limit = self.quotas.max_concurrent
        if limit and self.in_flight >= limit:
            raise RateLimited(
                f"Too many concurrent requests: the limit is {limit}.",
                reason="max_concurrent",
                retry_after=1.0,
            )
        if self._tokens is not None and (wait := self._tokens.debt_wait()) > 0:
            raise RateLimited(
                f"Token rate limit reached: the limit is {self.quotas.tokens_per_minute} "
                "tokens per minute.",
                reason="tokens_per_minute",
                retry_after=wait,
            )
        if self._requests is not None and (wait := self._requests.try_take()) > 0:
            raise RateLimited(
                f"Request rate limit reached: the limit is {self.quotas.requests_per_minute} "
                "requests per minute.",
                reason="requests_per_minute",
                retry_after=wait,
            )
        self.in_flight += 1

    def release(self, tokens: int) -> None:
        """One admitted request is done; charge the tokens it used."""
        self.in_flight -= 1
        if self._tokens is not None and tokens:
            self._tokens.charge(tokens)

    def refuse(self) -> None:
        """Undo `admit` for a request refused after it (queue full): it used no allowance."""
        self.in_flight -= 1
        if self._requests is not None:
            self._requests.give_back(1)
