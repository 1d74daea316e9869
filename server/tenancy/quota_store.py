"""Fleet-wide quotas: tenants' quotas kept in Redis (`tenancy.quota_store`), and what happens
while Redis cannot be reached (`tenancy.quota_store_failure`).

Reachable, Redis decides: one atomic script per admission takes the request's lease (its
sequences against max_concurrent, its n against requests_per_minute, prompt + n x max_tokens
against tokens_per_minute) or answers the 429 with its Retry-After; one per release gives back
the unused tokens (`redis_scripts` says how the buckets and leases are kept there). A request
admitted by Redis is also counted in its replica's own gate (`quotas.QuotaGate`), unchecked, so
that gate always knows what this replica holds and has served in the last minute.

Unreachable (refused, erroring, or slower than `quota_store_timeout_s`): the store is marked
down, and for the next second admissions are decided without trying it; then one admission (or
the background loop, every second) probes it again, and the first success brings it back.
While it is down:
- `open` admits on the replica's own gate, exactly as without a quota store: each replica
  enforces the full limits, so a fleet of N grants up to N times each limit until Redis returns.
  Not "no quota at all": one tenant could then take every replica's engine, and the replica's own
  gate already knows this replica's in-flight sequences and last minute.
- `closed` refuses every request 503 `quota_store_unavailable` with Retry-After.
Both are counted (`loraplex_quota_store_bypassed_requests_total`, by tenant and mode), failed
calls by operation (`loraplex_quota_store_failed_requests_total`), and
`loraplex_quota_store_healthy` is 0; the log says so once when it goes down, at most every 30 s
while down, and once when it is back.

Leases lapse `lease_ttl_s` after their last renewal: the background loop renews those this
replica holds every third of that, so a replica that dies stops holding its tenants'
concurrency within `lease_ttl_s` (30 s). A release that fails is retried by the loop until it
succeeds or its lease would have lapsed anyway; a lease that lapsed while this replica was cut
off, or that an empty restarted Redis lost, is taken again at the next renewal, so the sequences
still running count again. An admission whose call failed or was cancelled may have taken its
lease: it is released too (releases act only on a lease still held).
What a Redis restart without persistence does lose is the buckets: every tenant starts a full
minute again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Literal

from loraplex.server.metrics import GatewayMetrics
from loraplex.server.tenancy.errors import QuotaStoreUnavailable
from loraplex.server.tenancy.quotas import Demand
from loraplex.server.tenancy.redis_quotas import Lease, QuotaStoreError, RedisQuotas
from loraplex.server.tenancy.settings import Quotas

log = logging.getLogger(__name__)

# How long the store stays marked down after a failure before one call probes it again.
RETRY_S = 1.0
# At most one "still down" log line per this many seconds.
LOG_EVERY_S = 30.0
# Releases waiting for Redis to come back, at most (a release older than the lease ttl is
# dropped anyway: its lease has lapsed, and a release acts only on a held lease).
MAX_PENDING_RELEASES = 100_000

FailureMode = Literal["open", "closed"]


class StoreState(Enum):
    UP = "up"
    DOWN = "down"  # failed; no call is made until the retry time
    PROBING = "probing"  # down, and one call is trying it


@dataclass
class _PendingRelease:
    lease: Lease
    quotas: Quotas
    requests_back: int
    tokens_back: int
    give_up_at: float


class SharedQuotas:
    """The replica's side of the shared quota store. Used from one event loop; `running()` is
    the background loop (renewals, retried releases, the probe while down)."""

    def __init__(
        self,
        store: RedisQuotas,
        failure: FailureMode,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.failure = failure
        self._metrics = metrics
        self._clock = clock
        self.state = StoreState.UP
        self._retry_at = 0.0
        self._down_since = 0.0
        self._last_log = 0.0
        self._bypassed = 0  # admissions decided without the store since the last log line
        self._held: dict[str, set[str]] = {}  # tenant -> members of the leases this replica holds
        self._pending: dict[str, _PendingRelease] = {}
        self._renewed_at = clock()
        self._scripts_loaded = False  # in this Redis, as far as we know
        self._renewing: asyncio.Future[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        metrics.quota_store_healthy.set(1)

    # --- admission ---------------------------------------------------------------------------
    async def acquire(self, tenant_id: str, quotas: Quotas, demand: Demand) -> Lease | None:
        """Take `demand` from the tenant's shared quotas: its lease, or raise RateLimited (429).
        With the store down: None under `open` (decide on the replica's own gate), or raise
        QuotaStoreUnavailable (503) under `closed`."""
        if not self._may_call():
            self._bypass(tenant_id)
            return None
        lease = self.store.new_lease(tenant_id, quotas, demand)
        try:
            refused = await self.store.acquire(lease, quotas, demand)
        except QuotaStoreError as e:
            self._failed("acquire", e)
            self._undo_later(lease, quotas)  # the script may have run
            self._bypass(tenant_id)
            return None
        except BaseException:  # cancelled mid-call: the script may have run
            self._undo_later(lease, quotas)
            self._probe_done()
            raise
        self._succeeded()
        if refused is not None:
            raise refused
        self._held.setdefault(tenant_id, set()).add(lease.member)
        return lease

    async def release(self, lease: Lease, quotas: Quotas, used_tokens: int) -> None:
        """The request is done and used `used_tokens`: drop its lease and give back the unused
        part of its token reservation. Never raises for the store; a release that cannot reach
        it is retried later."""
        tokens_back = lease.reservation.tokens - used_tokens if lease.reservation.tokens else 0
        await self._finish(lease, quotas, requests_back=0, tokens_back=tokens_back)

    async def cancel(self, lease: Lease, quotas: Quotas) -> None:
        """Undo an admission that did not happen after all (the queue refused it): everything
        it took comes back."""
        reservation = lease.reservation
        await self._finish(
            lease, quotas, requests_back=reservation.sequences, tokens_back=reservation.tokens
        )

    async def _finish(
        self, lease: Lease, quotas: Quotas, *, requests_back: int, tokens_back: int
    ) -> None:
        held = self._held.get(lease.tenant_id)
        if held is not None:
            held.discard(lease.member)  # no renewal from now on may take it again
            if not held:
                del self._held[lease.tenant_id]
        pending = _PendingRelease(lease, quotas, requests_back, tokens_back, self._give_up_at())
        # Shielded: a client gone mid-release (its task cancelled) must not leave the lease held.
        task = asyncio.ensure_future(self._release_now(pending))
        self._track(task)
        await asyncio.shield(task)

    async def _release_now(self, pending: _PendingRelease) -> None:
        if not self._may_call():
            self._pending[pending.lease.member] = pending
            return
        if self._renewing is not None:  # a renewal sent before this release could retake it
            await asyncio.shield(self._renewing)
        try:
            await self.store.release(
                pending.lease,
                pending.quotas,
                requests_back=pending.requests_back,
                tokens_back=pending.tokens_back,
            )
        except QuotaStoreError as e:
            self._failed("release", e)
            self._keep_pending(pending)
        except BaseException:
            self._probe_done()
            self._keep_pending(pending)
            raise
        else:
            self._succeeded()

    def _undo_later(self, lease: Lease, quotas: Quotas) -> None:
        """Cancel, from the background loop, an acquire whose outcome is unknown."""
        reservation = lease.reservation
        self._keep_pending(
            _PendingRelease(
                lease, quotas, reservation.sequences, reservation.tokens, self._give_up_at()
            )
        )

    def _keep_pending(self, pending: _PendingRelease) -> None:
        if len(self._pending) < MAX_PENDING_RELEASES:
            self._pending[pending.lease.member] = pending

    def _give_up_at(self) -> float:
        return self._clock() + self.store.lease_ttl_s

    def _track(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- the store's state -------------------------------------------------------------------
    def _may_call(self) -> bool:
        """Whether a call may go to the store now; the first call after the retry time is the
        probe, and others wait for its outcome (they are decided without the store)."""
        if self.state is StoreState.UP:
            return True
        if self.state is StoreState.DOWN and self._clock() >= self._retry_at:
            self.state = StoreState.PROBING
            return True
        return False

    def _probe_done(self) -> None:
        if self.state is StoreState.PROBING:
            self.state = StoreState.DOWN

    def _succeeded(self) -> None:
        if self.state is StoreState.UP:
            return
        down_s = self._clock() - self._down_since
        log.info(
            "quota store reachable again after %.1f s; %d admissions were decided without it "
            "since the last report (quota_store_failure=%s)",
            down_s, self._bypassed, self.failure,
        )  # fmt: skip
        self.state = StoreState.UP
        self._bypassed = 0
        self._metrics.quota_store_healthy.set(1)

    def _failed(self, operation: str, error: QuotaStoreError) -> None:
        now = self._clock()
        self._metrics.quota_store_failed_requests.labels(operation).inc()
        self._retry_at = now + RETRY_S
        self._scripts_loaded = False
        if self.state is StoreState.UP:
            self._down_since = self._last_log = now
            self._metrics.quota_store_healthy.set(0)
            log.warning(
                "quota store unreachable (%s: %s); until it is back, requests are %s",
                operation, error, self._failure_words(),
            )  # fmt: skip
        elif now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning(
                "quota store still unreachable after %.0f s (%s: %s); %d admissions were "
                "decided without it since the last report",
                now - self._down_since, operation, error, self._bypassed,
            )  # fmt: skip
            self._bypassed = 0
        self.state = StoreState.DOWN

    def _failure_words(self) -> str:
        if self.failure == "open":
            return "admitted on this replica's own quotas (quota_store_failure=open)"
        return "refused 503 (quota_store_failure=closed)"

    def _bypass(self, tenant_id: str) -> None:
        """Count an admission decided without the store; under `closed`, refuse it."""
        self._bypassed += 1
        self._metrics.quota_store_bypassed_requests.labels(tenant_id, self.failure).inc()
        if self.failure == "open":
            return
        retry_after = max(1.0, self._retry_at - self._clock())
        raise QuotaStoreUnavailable(
            "The quota store is unreachable and this server is configured to refuse requests "
            f"until it is back (tenancy.quota_store_failure=closed). Retry in "
            f"{math.ceil(retry_after)} s.",
            retry_after=retry_after,
        )

    # --- the background loop -----------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SharedQuotas]:
        """Renew held leases, retry pending releases and probe the store while down, every
        second; on exit, wait (bounded) for releases in flight and close the connections."""
        task = asyncio.create_task(self._loop(), name="quota-store")
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=self.store.lease_ttl_s / 10)
            await self.store.aclose()

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("quota store upkeep failed; retrying")
            await asyncio.sleep(RETRY_S)

    async def tick(self) -> None:
        """One round of upkeep: renew the held leases when a third of their ttl has passed
        (or the store is down and its retry time has come: the renewal is the probe; or the
        scripts may be missing: at start and after any failure, Redis may have restarted), then
        retry the pending releases."""
        now = self._clock()
        due = now - self._renewed_at >= self.store.lease_ttl_s / 3 or not self._scripts_loaded
        if (due or self.state is not StoreState.UP) and self._may_call():
            await self._renew()
        if self._pending and self.state is StoreState.UP:
            await self._retry_pending()

    async def _renew(self) -> None:
        members = {tenant: sorted(held) for tenant, held in self._held.items()}
        self._renewing = asyncio.get_running_loop().create_future()
        try:
            await self.store.renew(members, load_scripts=not self._scripts_loaded)
        except QuotaStoreError as e:
            self._failed("renew", e)
        else:
            self._renewed_at = self._clock()
            self._scripts_loaded = True
            self._succeeded()
        finally:
            self._renewing.set_result(None)
            self._renewing = None

    async def _retry_pending(self) -> None:
        now = self._clock()
        for member, pending in list(self._pending.items()):
            if now >= pending.give_up_at:  # its lease has lapsed: nothing left to release
                del self._pending[member]
        for member, pending in list(self._pending.items()):
            if self.state is not StoreState.UP:
                return
            del self._pending[member]
            await self._release_now(pending)
