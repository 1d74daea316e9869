"""Admission: a request passes its tenant's quotas, then waits its fair turn for the engine.

`enter` decides before any response byte is sent, so refusals are proper HTTP answers (400 for
a request no wait can admit, 429 from quotas, 503 from a full queue). It checks the quotas,
queues, and only then takes from the quotas: the check and the queue change nothing when they
refuse, and the take cannot fail, so no refusal leaves a quota or a queue place behind.
With a shared quota store (`quota_store`), checking and taking are one atomic call to Redis
before the queue; a queue that then refuses gives the lease back (`SharedQuotas.cancel`). The
replica's own gate counts the request too, unchecked, for the store's `open` failure mode. A
tenant without any limit never calls the store: there is nothing to count, and its requests
neither wait for Redis nor fail with it.
The wait for the engine slot happens later, inside the response, where a client that goes away
cancels it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from loraplex.server.tenancy.errors import RequestTooLarge
from loraplex.server.tenancy.fair import FairDispatcher, Ticket
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.quota_store import SharedQuotas
from loraplex.server.tenancy.quotas import Demand, QuotaGate, Reservation
from loraplex.server.tenancy.redis_quotas import Lease
from loraplex.server.tenancy.settings import TenancySettings


class Entry:
    """An admitted request. `wait` for the engine slot; `close(tokens)` exactly once at the end."""

    def __init__(
        self,
        gate: QuotaGate,
        ticket: Ticket,
        reservation: Reservation,
        shared: tuple[SharedQuotas, Lease] | None = None,
    ) -> None:
        self._gate = gate
        self._ticket = ticket
        self._reservation = reservation
        self._shared = shared
        self._closed = False

    async def wait(self) -> float:
        """Seconds spent queued before the engine slot was granted."""
        return await self._ticket.wait()

    @property
    def engine_priority(self) -> int:
        return self._ticket.engine_priority

    async def close(self, tokens: int) -> None:
        """Free the slots (or leave the queue) and settle the tenant's quotas: `tokens` used,
        the rest of the reservation given back (in the shared store too, if it holds a lease:
        that release goes on if the caller is cancelled)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._ticket.close()
        finally:  # the ticket leaves the queue before anything in its close can fail
            self._gate.release(self._reservation, tokens)
            if self._shared is not None:
                shared, lease = self._shared
                await shared.release(lease, self._gate.quotas, tokens)


class Admission:
    def __init__(
        self,
        settings: TenancySettings,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedQuotas | None = None,
    ) -> None:
        self._clock = clock
        self._shared = shared
        self.dispatcher = FairDispatcher(
            settings.max_running,
            settings.max_queued,
            settings.active_window_s,
            clock,
            engine_priority=settings.engine_priority,
        )
        self._gates: dict[str, QuotaGate] = {}

    def _gate(self, tenant: Tenant) -> QuotaGate:
        gate = self._gates.get(tenant.id)
        if gate is None:
            gate = self._gates[tenant.id] = QuotaGate(tenant.quotas, self._clock)
        elif gate.quotas != tenant.quotas:
            gate.set_quotas(tenant.quotas)
        return gate

    async def enter(self, tenant: Tenant, demand: Demand) -> Entry:
        """Admit one request or raise RequestTooLarge (400) / RateLimited (429) / QueueFull (503)
        / QuotaStoreUnavailable (503). Its place in the fair queue costs what it may process
        (prompt + n x max_tokens)."""
        max_running = self.dispatcher.max_running
        if demand.n > max_running:
            raise RequestTooLarge(
                f"`n` ({demand.n}) exceeds tenancy.max_running ({max_running}), the sequences "
                "this server runs at once.",
                param="n",
                reason="max_running",
            )
        gate = self._gate(tenant)
        if self._shared is not None and tenant.quotas.limited:
            gate.check_size(demand)
            lease = await self._shared.acquire(tenant.id, tenant.quotas, demand)
            if lease is not None:
                return await self._enter_leased(self._shared, tenant, demand, gate, lease)
        reservation = gate.check(demand)
        ticket = self.dispatcher.enqueue(tenant.id, tenant.weight, float(demand.tokens), demand.n)
        gate.take(reservation)
        return Entry(gate, ticket, reservation)

    async def _enter_leased(
        self, shared: SharedQuotas, tenant: Tenant, demand: Demand, gate: QuotaGate, lease: Lease
    ) -> Entry:
        try:
            ticket = self.dispatcher.enqueue(
                tenant.id, tenant.weight, float(demand.tokens), demand.n
            )
        except BaseException:
            await shared.cancel(lease, tenant.quotas)
            raise
        gate.take(lease.reservation)
        return Entry(gate, ticket, lease.reservation, (shared, lease))
