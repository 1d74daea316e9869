"""Weighted fair dispatch of requests to the engine across tenants.

At most `max_running` requests are in the engine at once; the rest wait in one queue per tenant.
Two rules decide who goes next when a slot frees:

1. **Order: start-time fair queuing.** Each request gets a start tag `S = max(V, F_prev)` and a
   finish tag `F = S + cost / weight`, where `V` is the start tag of the last request dispatched
   and `F_prev` the finish tag of the tenant's previous request. The eligible head with the
   smallest start tag goes first, so backlogged tenants are served in proportion to their weights
   and a tenant that was idle does not bank credit.
2. **Caps: weighted max-min shares of the slots.** Ordering alone cannot help a light tenant whose
   request arrives while a flooding tenant holds every slot: engine requests cannot be preempted,
   so it would wait for one to finish (seconds on a CPU). Each tenant seen in the last
   `active_window_s` therefore has a demand (its peak of running + queued in that window, plus one
   slot of headroom) and the slots are divided by weighted max-min fairness over those demands. A
   flooding tenant gets everything the others do not need, and a light tenant always finds a free
   slot for its next request.

Each dispatched request also carries an engine priority: 0 when its tenant's requests all fit its
share (none left waiting here) or the tenant is alone, and 1 + the tenant's requests already in
the engine when it is backlogged beside others. vLLM (scheduling_policy "priority") takes waiting
requests lowest first, and on CPU engines the paced-prefill scheduler (engine/paced_prefill.py)
prefills priority-0 requests whole in a step of their own while prefilling the others in small
chunks. On the CPU fairness bench (`bench.fairness`, 300 s) priority ordering alone left the light
tenant's p90 TTFT at 1.75x alone: it waited for a step already running one of the flood's whole
prefills, which no ordering can shorten. With pacing it was 1.36x
(bench/results/fairness-29bcbb9-rate0.25-mr8-win60.json).

Requests cancelled while queued are removed and never dispatched. Used from one event loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.server.tenancy.errors import QueueFull


@dataclass
class _Waiter:
    future: asyncio.Future[None]
    start_tag: float
    finish_tag: float
    arrived: float
    engine_priority: int = 0


@dataclass
class _TenantQueue:
    weight: float
    waiting: deque[_Waiter] = field(default_factory=deque)
    running: int = 0
    last_finish_tag: float = 0.0
    # (time, load) within the active window, loads strictly falling from the oldest: the oldest is
    # the window's peak, which is the demand (a sliding-window maximum, O(1) to read).
    history: deque[tuple[float, int]] = field(default_factory=deque)
    seen_at: float = 0.0

    @property
    def load(self) -> int:
        return self.running + len(self.waiting)

    @property
    def peak(self) -> int:
        """The highest load in the active window (as of the last change) and now."""
        return max(self.load, self.history[0][1] if self.history else 0)


class Ticket:
    """One request's place in the fair queue: `wait` for the engine slot, `close` when done.

    `close` is idempotent and safe in every state: it leaves the queue if the request never got a
    slot (so a cancelled request never reaches the engine) and frees the slot if it did.
    """

    def __init__(self, dispatcher: FairDispatcher, tenant_id: str, waiter: _Waiter) -> None:
        self._dispatcher = dispatcher
        self.tenant_id = tenant_id
        self._waiter = waiter
        self._closed = False
        self.queued_s = 0.0

    async def wait(self) -> float:
        """Block until dispatched; returns seconds spent queued."""
        await asyncio.shield(self._waiter.future)
        self.queued_s = self._dispatcher._clock() - self._waiter.arrived
        return self.queued_s

    @property
    def engine_priority(self) -> int:
        """vLLM priority (lower first): the tenant's requests in the engine at dispatch."""
        return self._waiter.engine_priority

    @property
    def dispatched(self) -> bool:
        future = self._waiter.future
        return future.done() and not future.cancelled()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.dispatched:
            self._dispatcher._release(self.tenant_id)
        else:
            self._waiter.future.cancel()
            self._dispatcher._leave(self.tenant_id, self._waiter)


class FairDispatcher:
    def __init__(
        self,
        max_running: int,
        max_queued: int,
        active_window_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        engine_priority: bool = True,
    ) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.active_window_s = active_window_s
        self._clock = clock
        self._engine_priority = engine_priority
        self._tenants: dict[str, _TenantQueue] = {}
        self._virtual_time = 0.0
        self._running = 0
        self._queued = 0

    def enqueue(self, tenant_id: str, weight: float, cost: float = 1.0) -> Ticket:
        """Join the tenant's queue (dispatching at once if a slot is free and it is our turn).

        Must be called from the event loop's thread. Raises QueueFull, without queueing, when the
        request would have to wait and `max_queued` requests are already waiting, or the tenant
        already has its weighted share of `max_queued` waiting while other tenants are active (so
        a flood cannot fill the queue and turn a light tenant's next request into a 503).
        """
        queue = self._tenants.get(tenant_id)
        if queue is None:
            queue = self._tenants[tenant_id] = _TenantQueue(weight=weight)
        queue.weight = weight
        caps = self._caps()
        if not self._may_start_now(tenant_id, queue, caps):
            if self._queued >= self.max_queued:
                raise QueueFull(
                    f"The server is overloaded: {self._queued} requests are queued "
                    f"(tenancy.max_queued is {self.max_queued})."
                )
            if len(queue.waiting) >= self._queue_share(tenant_id, caps):
                raise QueueFull(
                    f"The server is overloaded: {len(queue.waiting)} of your requests are "
                    "queued, your share of the queue (tenancy.max_queued) while other tenants "
                    "are active."
                )
        start = max(self._virtual_time, queue.last_finish_tag)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(future, start, start + cost / weight, self._clock())
        queue.last_finish_tag = waiter.finish_tag
        queue.waiting.append(waiter)
        self._queued += 1
        self._touch(queue)
        self._dispatch()
        return Ticket(self, tenant_id, waiter)

    def _leave(self, tenant_id: str, waiter: _Waiter) -> None:
        queue = self._tenants[tenant_id]
        queue.waiting.remove(waiter)
        self._queued -= 1
        self._touch(queue)
        self._dispatch()

    def _may_start_now(self, tenant_id: str, queue: _TenantQueue, caps: dict[str, float]) -> bool:
        return (
            not queue.waiting
            and self._running < self.max_running
            and queue.running < caps.get(tenant_id, self.max_running)
        )

    def _queue_share(self, tenant_id: str, caps: dict[str, float]) -> int:
        """The tenant's weighted share of `max_queued` among the active tenants (and itself)."""
        active = {*caps, tenant_id}
        weights = sum(self._tenants[tid].weight for tid in active)
        return max(1, int(self.max_queued * self._tenants[tenant_id].weight / weights))

    def _release(self, tenant_id: str) -> None:
        queue = self._tenants[tenant_id]
        queue.running -= 1
        self._running -= 1
        self._touch(queue)
        self._dispatch()

    def _touch(self, queue: _TenantQueue) -> None:
        now = self._clock()
        queue.seen_at = now
        while queue.history and queue.history[-1][1] <= queue.load:
            queue.history.pop()  # older and no higher: never the peak again
        queue.history.append((now, queue.load))
        while queue.history and now - queue.history[0][0] > self.active_window_s:
            queue.history.popleft()

    def _caps(self) -> dict[str, float]:
        """Weighted max-min division of the slots over active tenants' demands (water-filling)."""
        now = self._clock()
        demands = {
            tid: (q.weight, q.peak + 1)
            for tid, q in self._tenants.items()
            if q.load or now - q.seen_at <= self.active_window_s
        }
        caps: dict[str, float] = {}
        remaining = float(self.max_running)
        weight_left = sum(w for w, _ in demands.values())
        order = sorted(demands, key=lambda tid: demands[tid][1] / demands[tid][0])
        for tid in order:
            weight, demand = demands[tid]
            caps[tid] = max(1.0, min(float(demand), remaining * weight / weight_left))
            remaining -= min(caps[tid], remaining)
            weight_left -= weight
        if order:  # the tenant with the largest demand per weight takes what is left
            caps[order[-1]] += remaining
        return caps

    def _dispatch(self) -> None:
        while self._running < self.max_running and self._queued:
            caps = self._caps()
            best: tuple[float, str] | None = None
            for tid, queue in self._tenants.items():
                if queue.waiting and queue.running < caps.get(tid, self.max_running):
                    tag = queue.waiting[0].start_tag
                    if best is None or tag < best[0]:
                        best = (tag, tid)
            if best is None:
                return  # the free slots are reserved for active tenants below their share
            queue = self._tenants[best[1]]
            waiter = queue.waiting.popleft()
            self._queued -= 1
            waiter.engine_priority = self._engine_priority_of(queue, caps)
            queue.running += 1
            self._running += 1
            self._virtual_time = waiter.start_tag
            waiter.future.set_result(None)

    def _engine_priority_of(self, queue: _TenantQueue, caps: dict[str, float]) -> int:
        """0 for a tenant whose requests all fit its share (none left waiting here); for one
        still backlogged, 1 + its requests in the engine. Alone, a tenant's requests are all 0."""
        if not self._engine_priority or len(caps) < 2 or not queue.waiting:
            return 0
        return 1 + queue.running

    def queued(self, tenant_id: str) -> int:
        queue = self._tenants.get(tenant_id)
        return len(queue.waiting) if queue else 0

    def running(self, tenant_id: str) -> int:
        queue = self._tenants.get(tenant_id)
        return queue.running if queue else 0

    def totals(self) -> dict[str, int]:
        """Requests in the engine and waiting, over all tenants."""
        return {"running": self._running, "queued": self._queued}

    def tenant_ids(self) -> list[str]:
        return list(self._tenants)
