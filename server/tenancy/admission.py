"""Admission: a request passes its tenant's quotas, then waits its fair turn for the engine.

`enter` decides synchronously, before any response byte is sent, so refusals are proper HTTP
answers (429 from quotas, 503 from a full queue). The wait for the engine slot happens later,
inside the response, where a client that goes away cancels it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from loraplex.server.tenancy.errors import QueueFull
from loraplex.server.tenancy.fair import FairDispatcher, Ticket
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.quotas import QuotaGate
from loraplex.server.tenancy.settings import TenancySettings


class Entry:
    """An admitted request. `wait` for the engine slot; `close(tokens)` exactly once at the end."""

    def __init__(self, gate: QuotaGate, ticket: Ticket) -> None:
        self._gate = gate
        self._ticket = ticket
        self._closed = False

    async def wait(self) -> float:
        """Seconds spent queued before the engine slot was granted."""
        return await self._ticket.wait()

    @property
    def engine_priority(self) -> int:
        return self._ticket.engine_priority

    def close(self, tokens: int) -> None:
        """Free the slot (or leave the queue) and charge `tokens` to the tenant's token quota."""
        if self._closed:
            return
        self._closed = True
        self._ticket.close()
        self._gate.release(tokens)


class Admission:
    def __init__(self, settings: TenancySettings, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
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

    def enter(self, tenant: Tenant, cost: float = 1.0) -> Entry:
        """Admit one request or raise RateLimited (429) / QueueFull (503)."""
        gate = self._gate(tenant)
        gate.admit()
        try:
            ticket = self.dispatcher.enqueue(tenant.id, tenant.weight, cost)
        except QueueFull:
            gate.refuse()
            raise
        return Entry(gate, ticket)
