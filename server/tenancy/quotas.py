"""Per-tenant quotas: concurrent sequences, sequences per minute, tokens per minute.

A request is paid for up front: it counts its `n` sequences against `max_concurrent` and
`requests_per_minute`, and reserves what it may process, prompt + n x max_tokens, against
`tokens_per_minute`. When it ends, what the engine did not process is given back (all of it for a
request that never reached the engine). So a tenant is never served more than its quota: charged
only at the end, one request of n = 16 gave a tenant at 200 tokens a minute 6,431 tokens before
its first 429.

Rates are token buckets holding one minute's allowance and refilling continuously. A bucket can
still be in debt (a request that used more than it reserved, a quota lowered under requests in
flight); a tenant in debt is refused until the refill pays it back, and Retry-After says when that
will be. A request that needs more than a whole limit can never be admitted: 400, not 429.

`check` decides and changes nothing; `take` writes and cannot raise, so admission can check the
quotas, then queue, then take, and a refusal anywhere leaves nothing to undo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from loraplex.server.tenancy.errors import RateLimited, RequestTooLarge
from loraplex.server.tenancy.settings import Quotas

Clock = Callable[[], float]


@dataclass(frozen=True)
class Demand:
    """What one request may cost: `n` sequences, and its prompt plus n x max_tokens tokens."""

    prompt_tokens: int
    n: int = 1
    max_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.n * self.max_tokens

    def spelled(self) -> str:
        return (
            f"{self.tokens} tokens ({self.prompt_tokens} in the prompt + n {self.n} x max_tokens "
            f"{self.max_tokens})"
        )


@dataclass(frozen=True)
class Reservation:
    """What admission took from the quotas for one request, given back or settled at its end."""

    sequences: int
    tokens: int  # 0 when tokens_per_minute was unlimited at admission


def reservation_for(quotas: Quotas, demand: Demand) -> Reservation:
    """What admitting `demand` takes under `quotas`: its sequences, and its tokens where
    tokens_per_minute is limited."""
    return Reservation(demand.n, demand.tokens if quotas.tokens_per_minute else 0)


def refusal(
    reason: str, quotas: Quotas, demand: Demand, in_flight: int, wait: float
) -> RateLimited:
    """The 429 for `demand` refused by the quota `reason` (a field of Quotas): `in_flight`
    sequences were held, and `wait` seconds will admit it (Retry-After)."""
    if reason == "max_concurrent":
        message = (
            f"Too many concurrent requests: {in_flight} sequences are in flight and the limit "
            f"is {quotas.max_concurrent} (a request counts its `n`)."
        )
    elif reason == "tokens_per_minute":
        message = (
            f"Token rate limit reached: this request reserves {demand.spelled()} and the limit "
            f"is {quotas.tokens_per_minute} tokens per minute."
        )
    else:
        message = (
            f"Request rate limit reached: the limit is {quotas.requests_per_minute} requests "
            "per minute (a request counts its `n`)."
        )
    return RateLimited(message, reason=reason, retry_after=wait)


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

    def wait_for(self, n: float) -> float:
        """Seconds until `n` units are there (0.0: now); takes nothing."""
        level = self._refill()
        return 0.0 if level >= n else (n - level) / self._rate

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
        self.in_flight = 0  # sequences
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

    def check(self, demand: Demand) -> Reservation:
        """What admitting `demand` would take; raises RequestTooLarge (400) if no wait can admit
        it, RateLimited (429) naming the exhausted quota if it must wait. Takes nothing."""
        self.check_size(demand)
        limit = self.quotas.max_concurrent
        if limit and self.in_flight + demand.n > limit:
            raise refusal("max_concurrent", self.quotas, demand, self.in_flight, 1.0)
        if self._tokens is not None and (wait := self._tokens.wait_for(demand.tokens)) > 0:
            raise refusal("tokens_per_minute", self.quotas, demand, self.in_flight, wait)
        if self._requests is not None and (wait := self._requests.wait_for(demand.n)) > 0:
            raise refusal("requests_per_minute", self.quotas, demand, self.in_flight, wait)
        return reservation_for(self.quotas, demand)

    def check_size(self, demand: Demand) -> None:
        """Raise RequestTooLarge (400) if `demand` needs more than a whole limit: no wait can
        admit it. Depends on the limits alone, not on what is in flight."""
        q = self.quotas
        per_sequence = {
            "max_concurrent": q.max_concurrent,
            "requests_per_minute": q.requests_per_minute,
        }
        for name, limit in per_sequence.items():
            if limit and demand.n > limit:
                raise RequestTooLarge(
                    f"`n` ({demand.n}) exceeds your quota {name} ({limit}): a request counts "
                    "each of its choices.",
                    param="n",
                    reason=name,
                )
        tpm = q.tokens_per_minute
        if tpm and demand.tokens > tpm:
            smaller_output_fits = demand.prompt_tokens + demand.n <= tpm
            raise RequestTooLarge(
                f"This request reserves {demand.spelled()}, more than your quota "
                f"tokens_per_minute ({tpm}) holds: it can never be admitted. Lower max_tokens "
                "or n, or shorten the prompt.",
                param="max_tokens" if smaller_output_fits else None,
                reason="tokens_per_minute",
            )

    def take(self, reservation: Reservation) -> None:
        """Count an admitted request in (after `check` allowed it, with nothing between)."""
        self.in_flight += reservation.sequences
        if self._requests is not None:
            self._requests.charge(reservation.sequences)
        if self._tokens is not None and reservation.tokens:
            self._tokens.charge(reservation.tokens)

    def release(self, reservation: Reservation, used_tokens: int) -> None:
        """An admitted request is done and used `used_tokens`: give back the rest of its
        reservation (or charge what it used beyond it)."""
        self.in_flight -= reservation.sequences
        if self._tokens is None:
            return
        unused = reservation.tokens - used_tokens
        if unused > 0:
            self._tokens.give_back(unused)
        elif unused < 0:
            self._tokens.charge(-unused)
