"""Weighted fair dispatch of requests to the engine across tenants.

At most `max_running` sequences are in the engine at once (a request with `n` choices is `n`
sequences: vLLM runs each choice as a request of its own); the rest wait in one queue per tenant.
Three rules decide who goes next when slots free:

1. **Order: start-time fair queuing.** Each request gets a start tag `S = max(V, F_prev)` and a
   finish tag `F = S + cost / weight`, where `V` is the start tag of the last request dispatched,
   `F_prev` the finish tag of the tenant's previous request and `cost` what the request may
   process (prompt + n x max_tokens). The startable head with the smallest start tag goes first,
   so backlogged tenants are served in proportion to their weights and a tenant that was idle
   does not bank credit.
2. **Caps: weighted max-min shares of the slots.** Ordering alone cannot help a light tenant whose
   request arrives while a flooding tenant holds every slot: engine requests cannot be preempted,
   so it would wait for one to finish (seconds on a CPU). Each tenant seen in the last
   `active_window_s` therefore has a demand (its peak of running + queued sequences in that
   window, plus one slot of headroom) and the slots are divided by weighted max-min fairness over
   those demands. A flooding tenant gets everything the others do not need, and a light tenant
   always finds a free slot for its next request. A request starts within its tenant's share
   when all its sequences fit under the share rounded up, and then only if they fit the free
   slots.
3. **One loan for a request wider than its share.** A request of n = 16 beside a share of 14 slots
   would never start while the others stay active. A tenant that runs nothing may start one such
   request at once; the sequences beyond its share are a loan, by which the room for every other
   request widens until it ends, so the others keep their shares. One loan is out at a time, so
   the engine holds at most `max_running + n` sequences (n <= 16): `engine.max_num_seqs` of that
   much keeps a dispatched request from waiting inside the engine, where fairness cannot reach it
   (with requests counted instead of sequences, n = 16 filled the engine's batch, and a light
   tenant's first token took 278 s while its queue wait here was 1 ms).

Each dispatched request also carries an engine priority: 0 when its tenant's requests all fit its
share (none left waiting here) or the tenant is alone, and 1 + the tenant's requests already in
the engine when it is backlogged beside others. vLLM (scheduling_policy "priority") takes waiting
requests lowest first, and on CPU engines the paced-prefill scheduler (engine/paced_prefill.py)
prefills priority-0 requests whole in a step of their own while prefilling the others in small
chunks. On the CPU fairness bench (`bench.fairness`, 300 s) priority ordering alone left the light
tenant's p90 TTFT at 1.75x alone: it waited for a step already running one of the flood's whole
prefills, which no ordering can shorten. With pacing it was 1.36x
(bench/results/fairness.jsonl, the row of 29bcbb9 at rate 0.25, mr8, win60).

**Exception safety.** Every change is decided first and written second. The decisions (the clock,
the slot caps, the next grant, tags, the new future) may raise and change nothing; the writes
(`_join`, `_start`, `_remove`, `_touch`) only move a waiter between a deque and the running
counts and resolve its future, none of which can raise. `enqueue` decides everything about a new
request before writing it anywhere, so a failure strands no waiter that the caller has no ticket
for; `Ticket.close` writes the removal before anything that can fail; and a failure in a dispatch
after a change leaves every waiter queued and owned by its ticket, for the next change to grant.

Requests cancelled while queued are removed and never dispatched. Used from one event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from loraplex.server.tenancy.errors import QueueFull
from loraplex.server.tenancy.settings import MAX_WEIGHT, MIN_WEIGHT


@dataclass(eq=False)  # identity: `deque.remove` must find this waiter, not an equal one
class _Waiter:
    future: asyncio.Future[None]
    sequences: int
    start_tag: float
    finish_tag: float
    arrived: float
    engine_priority: int = 0
    loan: int = 0  # sequences beyond its tenant's share (rule 3), repaid when it ends


@dataclass
class _TenantQueue:
    weight: float
    waiting: deque[_Waiter] = field(default_factory=deque)
    waiting_sequences: int = 0
    running: int = 0  # sequences
    running_requests: int = 0
    last_finish_tag: float = 0.0
    # (time, load) within the active window, loads strictly falling from the oldest: the oldest
    # still inside the window is the window's peak, which is the demand (a sliding-window max).
    history: deque[tuple[float, int]] = field(default_factory=deque)
    seen_at: float = 0.0

    @property
    def load(self) -> int:
        return self.running + self.waiting_sequences

    def peak(self, now: float, window_s: float, load: int) -> int:
        """The highest load in the window ending `now`, the load from now on being `load`."""
        within = (past for at, past in self.history if now - at <= window_s)
        return max(load, next(within, 0))


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
    def sequences(self) -> int:
        return self._waiter.sequences

    @property
    def dispatched(self) -> bool:
        future = self._waiter.future
        return future.done() and not future.cancelled()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._dispatcher._remove(self.tenant_id, self._waiter)  # written first: cannot raise
        self._dispatcher._after_change(self.tenant_id)


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
        self._running = 0  # sequences
        self._queued = 0  # requests
        self._loaned = 0  # the loan out (rule 3), 0 if none

    def enqueue(
        self, tenant_id: str, weight: float, cost: float = 1.0, sequences: int = 1
    ) -> Ticket:
        """Join the tenant's queue (dispatching at once if a slot is free and it is our turn).

        Must be called from the event loop's thread. Raises ValueError for a weight outside
        [MIN_WEIGHT, MAX_WEIGHT], a cost that is not finite and >= 0, or more sequences than
        `max_running`; raises QueueFull, without queueing, when the request would have to wait and
        `max_queued` requests are already waiting, or the tenant already has its weighted share of
        `max_queued` waiting while other tenants are active (so a flood cannot fill the queue and
        turn a light tenant's next request into a 503). Whatever it raises, nothing was queued.
        """
        if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise ValueError(f"weight {weight!r} is outside [{MIN_WEIGHT}, {MAX_WEIGHT}]")
        if not (math.isfinite(cost) and cost >= 0):
            raise ValueError(f"cost {cost!r} must be finite and >= 0")
        if not 1 <= sequences <= self.max_running:
            raise ValueError(f"sequences {sequences} must be in [1, {self.max_running}]")
        self._dispatch()  # others first: an idle tenant's lapsed reservation may have freed slots
        # Decide everything about the new request; nothing is written until all of it is known.
        now = self._clock()
        queue = self._tenants.get(tenant_id)
        caps = self._caps(now, joining=(tenant_id, weight, sequences))
        loan = None
        if queue is None or not queue.waiting:  # else it waits behind the tenant's own
            running = queue.running if queue else 0
            loan = self._loan_to_start(running, sequences, caps[tenant_id])
        if loan is None:
            self._check_queue_room(tenant_id, weight, queue, caps)
        start = max(self._virtual_time, queue.last_finish_tag if queue else 0.0)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(future, sequences, start, start + cost / weight, now)
        # Written: nothing below can raise.
        if queue is None:
            queue = self._tenants[tenant_id] = _TenantQueue(weight=weight)
        queue.weight = weight
        queue.last_finish_tag = waiter.finish_tag
        if loan is None:
            self._join(queue, waiter)
        else:  # nothing of the tenant's waits: it is not backlogged, priority 0
            self._start(queue, waiter, 0, loan)
        self._touch(queue, now)
        return Ticket(self, tenant_id, waiter)

    # --- decisions: may raise, change nothing -------------------------------------------------
    def _check_queue_room(
        self,
        tenant_id: str,
        weight: float,
        queue: _TenantQueue | None,
        caps: dict[str, float],
    ) -> None:
        if self._queued >= self.max_queued:
            raise QueueFull(
                f"The server is overloaded: {self._queued} requests are queued "
                f"(tenancy.max_queued is {self.max_queued})."
            )
        waiting = len(queue.waiting) if queue else 0
        if waiting >= self._queue_share(tenant_id, weight, caps):
            raise QueueFull(
                f"The server is overloaded: {waiting} of your requests are queued, your share "
                "of the queue (tenancy.max_queued) while other tenants are active."
            )

    def _queue_share(self, tenant_id: str, weight: float, caps: dict[str, float]) -> int:
        """The tenant's weighted share of `max_queued` among the active tenants (and itself)."""
        weights = weight + sum(self._tenants[t].weight for t in caps if t != tenant_id)
        return max(1, int(self.max_queued * weight / weights))

    def _loan_to_start(self, running: int, sequences: int, cap: float) -> int | None:
        """None if a tenant running `running` sequences may not start `sequences` more now; else
        the slots the start borrows (rule 3): 0 within the tenant's share."""
        share = math.ceil(cap)
        if running + sequences <= share:
            fits = self._running + sequences <= self.max_running + self._loaned
            return 0 if fits else None
        if running == 0 and self._loaned == 0:
            return sequences - share
        return None

    def _caps(self, now: float, joining: tuple[str, float, int] | None = None) -> dict[str, float]:
        """Each active tenant's share of the slots; `joining` = (tenant, weight, sequences) of a
        request counted as if it had joined its tenant's queue."""
        window = self.active_window_s
        demands = {
            tid: (q.weight, q.peak(now, window, q.load) + 1)
            for tid, q in self._tenants.items()
            if q.load or now - q.seen_at <= window
        }
        if joining is not None:
            tid, weight, sequences = joining
            queue = self._tenants.get(tid)
            load = sequences + (queue.load if queue else 0)
            demands[tid] = (weight, (queue.peak(now, window, load) if queue else load) + 1)
        return water_fill(demands, float(self.max_running))

    def _next_grant(self, caps: dict[str, float]) -> tuple[_TenantQueue, int] | None:
        """The queue whose head starts next, and the head's loan: the smallest start tag among
        the heads that may start now."""
        best: tuple[float, _TenantQueue, int] | None = None
        for tid, queue in self._tenants.items():
            if not queue.waiting:
                continue
            head = queue.waiting[0]
            cap = caps.get(tid, float(self.max_running))
            loan = self._loan_to_start(queue.running, head.sequences, cap)
            if loan is not None and (best is None or head.start_tag < best[0]):
                best = (head.start_tag, queue, loan)
        return None if best is None else (best[1], best[2])

    def _engine_priority_of(
        self, queue: _TenantQueue, caps: dict[str, float], *, backlogged: bool
    ) -> int:
        """0 for a tenant whose requests all fit its share (none left waiting here behind this
        one); for one still backlogged, 1 + its requests in the engine. Alone, always 0."""
        if not self._engine_priority or len(caps) < 2 or not backlogged:
            return 0
        return 1 + queue.running_requests

    # --- writes: cannot raise ------------------------------------------------------------------
    def _join(self, queue: _TenantQueue, waiter: _Waiter) -> None:
        queue.waiting.append(waiter)
        queue.waiting_sequences += waiter.sequences
        self._queued += 1

    def _start(self, queue: _TenantQueue, waiter: _Waiter, priority: int, loan: int) -> None:
        """Give `waiter` (no longer or never queued) its slots; its future is pending."""
        waiter.future.set_result(None)
        waiter.engine_priority = priority
        waiter.loan = loan
        queue.running += waiter.sequences
        queue.running_requests += 1
        self._running += waiter.sequences
        self._loaned += loan
        self._virtual_time = waiter.start_tag

    def _grant_head(self, queue: _TenantQueue, priority: int, loan: int) -> None:
        waiter = queue.waiting.popleft()
        queue.waiting_sequences -= waiter.sequences
        self._queued -= 1
        self._start(queue, waiter, priority, loan)

    def _remove(self, tenant_id: str, waiter: _Waiter) -> None:
        """Free a dispatched waiter's slots, or take a queued one out of its queue for good."""
        queue = self._tenants[tenant_id]
        if waiter.future.done():  # dispatched: only `_start` resolves a future
            queue.running -= waiter.sequences
            queue.running_requests -= 1
            self._running -= waiter.sequences
            self._loaned -= waiter.loan
        else:
            queue.waiting.remove(waiter)  # queued, by the same rule
            queue.waiting_sequences -= waiter.sequences
            self._queued -= 1
            waiter.future.cancel()

    def _touch(self, queue: _TenantQueue, now: float) -> None:
        queue.seen_at = now
        while queue.history and queue.history[-1][1] <= queue.load:
            queue.history.pop()  # older and no higher: never the peak again
        queue.history.append((now, queue.load))
        while queue.history and now - queue.history[0][0] > self.active_window_s:
            queue.history.popleft()

    # --- after a change ----------------------------------------------------------------------
    def _after_change(self, tenant_id: str) -> None:
        self._touch(self._tenants[tenant_id], self._clock())
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant slots while a waiting head may start, each grant decided, then written."""
        if not self._queued:
            return
        caps = self._caps(self._clock())  # loads do not change while granting: neither do caps
        while (grant := self._next_grant(caps)) is not None:
            queue, loan = grant
            priority = self._engine_priority_of(queue, caps, backlogged=len(queue.waiting) > 1)
            self._grant_head(queue, priority, loan)

    # --- reading -----------------------------------------------------------------------------
    def queued(self, tenant_id: str) -> int:
        """The tenant's requests waiting here."""
        queue = self._tenants.get(tenant_id)
        return len(queue.waiting) if queue else 0

    def running(self, tenant_id: str) -> int:
        """The tenant's requests holding engine slots."""
        queue = self._tenants.get(tenant_id)
        return queue.running_requests if queue else 0

    def running_sequences(self, tenant_id: str) -> int:
        queue = self._tenants.get(tenant_id)
        return queue.running if queue else 0

    def totals(self) -> dict[str, int]:
        """Sequences in the engine and requests waiting, over all tenants."""
        return {"running": self._running, "queued": self._queued}

    def tenant_ids(self) -> list[str]:
        return list(self._tenants)


def water_fill(demands: dict[str, tuple[float, int]], slots: float) -> dict[str, float]:
    """Weighted max-min division of `slots` over `{tenant: (weight, demand)}`: each tenant gets
    its weighted part of what is left, at most its demand and at least one slot, in order of
    demand per weight; the tenant with the largest demand per weight takes what is left."""
    order = sorted(demands, key=lambda tid: demands[tid][1] / demands[tid][0])
    # The weight still to serve, summed from the back rather than subtracted from the total:
    # subtraction lost a weight below the total's precision (1.0 + 1e-17 - 1.0 == 0.0) and
    # divided by zero.
    weight_left = list(itertools.accumulate(demands[t][0] for t in reversed(order)))[::-1]
    caps: dict[str, float] = {}
    remaining = slots
    for tid, weight_from_here in zip(order, weight_left, strict=True):
        weight, demand = demands[tid]
        caps[tid] = max(1.0, min(float(demand), remaining * weight / weight_from_here))
        remaining -= min(caps[tid], remaining)
    if order:
        caps[order[-1]] += remaining
    return caps
