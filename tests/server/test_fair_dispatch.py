"""The fair dispatcher with simulated tenants on a real event loop (no engine: pure scheduling)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from loraplex.server.tenancy.errors import QueueFull
from loraplex.server.tenancy.fair import FairDispatcher, Ticket, water_fill


def run(coro):
    return asyncio.run(coro)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_backlogged_tenants_share_slots_by_weight() -> None:
    """Two tenants with deep backlogs and weights 3:1 get dispatches in a 3:1 ratio."""

    async def scenario() -> Counter[str]:
        d = FairDispatcher(max_running=1, max_queued=1000, active_window_s=10.0)
        tickets = [d.enqueue("a", 3.0) for _ in range(200)] + [
            d.enqueue("b", 1.0) for _ in range(200)
        ]
        served: Counter[str] = Counter()
        # The first "a" ticket was dispatched on arrival; serve 200 requests in dispatch order.
        for _ in range(200):
            current = next(t for t in tickets if t.dispatched and not t._closed)
            served[current.tenant_id] += 1
            current.close()
        for t in tickets:
            t.close()
        return served

    served = run(scenario())
    assert served["a"] == pytest.approx(150, abs=2)
    assert served["b"] == pytest.approx(50, abs=2)


def test_light_tenant_is_served_before_a_flooding_tenants_backlog() -> None:
    async def scenario() -> None:
        d = FairDispatcher(max_running=2, max_queued=1000, active_window_s=10.0)
        flood = [d.enqueue("a", 1.0) for _ in range(50)]
        light = d.enqueue("b", 1.0)
        assert sum(t.dispatched for t in flood) == 2
        next(t for t in flood if t.dispatched).close()
        assert light.dispatched  # next in line despite 48 older requests of "a"
        for t in [*flood, light]:
            t.close()

    run(scenario())


def test_active_light_tenant_finds_a_reserved_slot() -> None:
    """Once "b" has been seen, "a" may not fill every slot, so b's next request starts at once."""

    async def scenario() -> None:
        d = FairDispatcher(max_running=8, max_queued=1000, active_window_s=10.0)
        first_b = d.enqueue("b", 1.0)
        first_b.close()
        flood = [d.enqueue("a", 1.0) for _ in range(100)]
        running_a = sum(t.dispatched for t in flood)
        assert 5 <= running_a < 8  # b keeps its demand (1) plus one slot of headroom
        b = d.enqueue("b", 1.0)
        assert b.dispatched
        for t in [*flood, b]:
            t.close()

    run(scenario())


def test_lone_tenant_gets_every_slot_and_idle_tenants_stop_reserving() -> None:
    now = [0.0]
    d = FairDispatcher(max_running=8, max_queued=1000, active_window_s=10.0, clock=lambda: now[0])

    async def scenario() -> None:
        d.enqueue("b", 1.0).close()
        now[0] = 11.0  # b has been idle longer than the window
        flood = [d.enqueue("a", 1.0) for _ in range(20)]
        assert sum(t.dispatched for t in flood) == 8
        for t in flood:
            t.close()

    run(scenario())


def test_cancelled_while_queued_is_never_dispatched() -> None:
    async def scenario() -> None:
        d = FairDispatcher(max_running=1, max_queued=10, active_window_s=10.0)
        holder = d.enqueue("a", 1.0)
        waiter = d.enqueue("a", 1.0)
        later = d.enqueue("a", 1.0)
        dispatched: list[Ticket] = []

        async def client(ticket: Ticket) -> None:
            try:
                await ticket.wait()
                dispatched.append(ticket)
            finally:
                ticket.close()

        task = asyncio.create_task(client(waiter))
        later_task = asyncio.create_task(client(later))
        await settle()
        task.cancel()
        await settle()
        assert d.queued("a") == 1
        holder.close()
        await settle()
        assert dispatched == [later]
        assert not waiter.dispatched
        await later_task
        assert (d.queued("a"), d.running("a")) == (0, 0)

    run(scenario())


def test_bounded_queue_refuses_when_full_but_not_when_a_slot_is_free() -> None:
    async def scenario() -> None:
        d = FairDispatcher(max_running=2, max_queued=2, active_window_s=10.0)
        tickets = [d.enqueue("a", 1.0) for _ in range(4)]  # 2 running + 2 queued
        with pytest.raises(QueueFull, match="max_queued is 2"):
            d.enqueue("b", 1.0)
        tickets[0].close()  # a slot frees and a queued request takes it: one queue place frees
        tickets.append(d.enqueue("b", 1.0))
        for t in tickets:
            t.close()
        assert d.queued("a") == d.running("a") == d.running("b") == 0

    run(scenario())


def test_a_flood_cannot_take_more_than_its_share_of_the_queue_beside_others() -> None:
    async def scenario() -> None:
        d = FairDispatcher(max_running=2, max_queued=8, active_window_s=10.0)
        light = d.enqueue("b", 1.0)
        flood = [d.enqueue("a", 1.0) for _ in range(5)]  # 1 running + 4 queued: half of 8
        with pytest.raises(QueueFull, match="your share of the queue"):
            d.enqueue("a", 1.0)
        queued_b = [d.enqueue("b", 1.0) for _ in range(3)]  # b still has room to wait
        assert d.queued("b") == 3
        for t in [light, *flood, *queued_b]:
            t.close()

    run(scenario())


def test_a_tenant_alone_may_fill_the_whole_queue() -> None:
    async def scenario() -> None:
        d = FairDispatcher(max_running=1, max_queued=4, active_window_s=10.0)
        tickets = [d.enqueue("a", 1.0) for _ in range(5)]  # 1 running + 4 queued
        assert d.queued("a") == 4
        for t in tickets:
            t.close()

    run(scenario())


def test_queue_time_is_measured() -> None:
    async def scenario() -> float:
        d = FairDispatcher(max_running=1, max_queued=10, active_window_s=10.0)
        holder = d.enqueue("a", 1.0)
        waiter = d.enqueue("a", 1.0)
        asyncio.get_running_loop().call_later(0.05, holder.close)
        queued = await waiter.wait()
        waiter.close()
        return queued

    assert 0.04 <= run(scenario()) < 1.0


def test_headroom_follows_the_peak_within_the_window() -> None:
    """B's demand is its highest load in the last `active_window_s`, even after idle moments.

    (Measured on the CPU machine: when the peak was forgotten at B's first idle moment, A took
    the freed slots and B's next requests queued behind A's completions, p50 1.9 s.)
    """
    now = [0.0]
    d = FairDispatcher(max_running=8, max_queued=1000, active_window_s=10.0, clock=lambda: now[0])

    async def scenario() -> None:
        burst = [d.enqueue("b", 1.0) for _ in range(3)]  # t=0: B's load peaks at 3
        now[0] = 5.0  # t=5: B's load is 2, then 1, then 0
        for t in burst:
            t.close()
        now[0] = 11.0  # the t=0 peak has left the window; the t=5 load of 2 has not
        probe = d.enqueue("b", 1.0)
        probe.close()
        flood = [d.enqueue("a", 1.0) for _ in range(50)]
        assert sum(t.dispatched for t in flood) == 5  # 8 slots minus B's demand (2) + 1
        again = [d.enqueue("b", 1.0) for _ in range(2)]
        assert all(t.dispatched for t in again)
        for t in [*flood, *again]:
            t.close()

    run(scenario())


def test_engine_priority_is_zero_unless_the_tenant_is_backlogged_beside_others() -> None:
    """vLLM schedules lower priorities first, and the paced-prefill scheduler paces any priority
    above 0: a tenant whose requests all fit its share gets 0, a backlogged one 1 + its requests
    already in the engine, and a tenant alone always 0."""

    async def scenario(engine_priority: bool) -> tuple[int, list[int], int, int]:
        d = FairDispatcher(
            max_running=4, max_queued=100, active_window_s=10.0, engine_priority=engine_priority
        )
        light = d.enqueue("b", 1.0)  # alone: 0
        flood = [d.enqueue("a", 1.0) for _ in range(6)]  # two fit a's share, four wait
        first = [t.engine_priority for t in flood if t.dispatched]
        flood[0].close()  # a's next goes in with three more behind it: backlogged
        backlogged = next(t for t in flood[2:] if t.dispatched).engine_priority
        light_again = d.enqueue("b", 1.0).engine_priority  # b is within its share
        for t in [light, *flood]:
            t.close()
        return light.engine_priority, first, backlogged, light_again

    assert run(scenario(True)) == (0, [0, 0], 2, 0)
    assert run(scenario(False)) == (0, [0, 0], 0, 0)  # off: vLLM's first come, first served


def test_a_tenant_alone_is_never_backlogged_for_the_engine() -> None:
    async def scenario() -> list[int]:
        d = FairDispatcher(max_running=2, max_queued=100, active_window_s=10.0)
        flood = [d.enqueue("a", 1.0) for _ in range(5)]
        for t in flood[:2]:  # two more go in, one still waiting behind them
            t.close()
        priorities = [t.engine_priority for t in flood if t.dispatched]
        for t in flood:
            t.close()
        return priorities

    assert run(scenario()) == [0, 0, 0, 0]


# --- sequences: a request with n choices is n sequences ----------------------------------------
def test_a_request_counts_its_sequences_against_max_running() -> None:
    async def scenario() -> None:
        d = FairDispatcher(max_running=4, max_queued=100, active_window_s=10.0)
        wide = d.enqueue("a", 1.0, sequences=3)
        pair = d.enqueue("a", 1.0, sequences=2)  # 3 + 2 > 4: waits
        one = d.enqueue("a", 1.0)  # behind a's own pair, though one slot is free
        assert wide.dispatched and not pair.dispatched and not one.dispatched
        assert d.totals() == {"running": 3, "queued": 2}
        wide.close()
        assert pair.dispatched and one.dispatched
        assert d.totals() == {"running": 3, "queued": 0} and d.running("a") == 2
        for t in (pair, one):
            t.close()
        assert d.totals() == {"running": 0, "queued": 0}

    run(scenario())


def test_a_wide_request_borrows_past_its_share_and_others_keep_theirs() -> None:
    """b was active: its share is 2 of 16 slots, a's 14. a's requests of n=16 start one at a
    time, borrowing the 2 sequences past a's share, so b's next two requests still start at once
    and the engine never holds more than max_running + n sequences."""

    async def scenario() -> None:
        d = FairDispatcher(max_running=16, max_queued=100, active_window_s=10.0)
        d.enqueue("b", 1.0).close()
        flood = [d.enqueue("a", 1.0, cost=16.0, sequences=16) for _ in range(3)]
        assert [t.dispatched for t in flood] == [True, False, False]
        light = [d.enqueue("b", 1.0) for _ in range(2)]
        assert all(t.dispatched for t in light)
        assert d.totals() == {"running": 18, "queued": 2}
        assert not d.enqueue("c", 1.0, sequences=16).dispatched  # one loan at a time
        for t in light:
            t.close()
        flood[0].close()
        assert d.totals()["running"] <= 16 + 16
        assert d.running("a") + d.running("c") == 1  # the next wide request, on the next loan

    run(scenario())


def test_a_light_tenants_requests_start_at_once_beside_a_flood_of_n16() -> None:
    """Finding 5 of issue 45 in the dispatcher: every one of b's requests starts on arrival
    while a keeps 20 requests of n=16 queued, and the sequences dispatched stay within
    max_running + 16 whatever is in flight."""

    async def scenario() -> None:
        d = FairDispatcher(max_running=16, max_queued=100, active_window_s=60.0)
        d.enqueue("b", 1.0).close()
        flood = [d.enqueue("a", 1.0, cost=16 * 64.0, sequences=16) for _ in range(20)]
        for _ in range(10):
            b = d.enqueue("b", 1.0, cost=64.0)
            assert b.dispatched
            assert d.totals()["running"] <= 16 + 16
            b.close()
            next(t for t in flood if t.dispatched and not t.closed).close()
        for t in flood:
            t.close()

    run(scenario())


# --- bounds and exception safety ---------------------------------------------------------------
@pytest.mark.parametrize("weight", [5e-324, 1e-17, 0.0, -1.0, float("nan"), float("inf"), 1001.0])
def test_a_weight_out_of_bounds_is_refused_before_anything_is_queued(weight: float) -> None:
    """Issue 45, finding 2: a weight of 5e-324 or 1e-17 raised ZeroDivisionError after the waiter
    was queued, and every later request of every tenant failed on the phantom."""

    async def scenario() -> None:
        d = FairDispatcher(max_running=1, max_queued=10, active_window_s=10.0)
        holder = d.enqueue("a", 1.0)
        with pytest.raises(ValueError, match="weight"):
            d.enqueue("tiny", weight)
        assert d.totals() == {"running": 1, "queued": 0} and "tiny" not in d.tenant_ids()
        waiter = d.enqueue("b", 1.0)
        holder.close()
        assert waiter.dispatched
        waiter.close()
        assert d.totals() == {"running": 0, "queued": 0}

    run(scenario())


def test_the_slot_division_survives_weights_apart_beyond_float_precision() -> None:
    """1.0 + 1e-17 == 1.0: subtracting the served weights from their total left 0 for the last
    tenant, and the division by it raised. Summed from the back, each tenant's part is finite."""
    caps = water_fill({"a": (1.0, 50), "tiny": (1e-17, 2), "b": (1000.0, 3)}, 16.0)
    assert all(math.isfinite(c) and c >= 1.0 for c in caps.values())
    assert sum(caps.values()) == pytest.approx(16.0 + 1.0)  # tiny's floor of one slot on top


class InjectedFault(Exception):
    pass


class Faults:
    """Makes the k-th call of any of the dispatcher's decisions raise: its clock, the new
    waiter's future, the slot caps, the choice of the next grant, the queue-room check, the
    engine priority. k counts over all of them, so k = 1, 2, ... hits every step in turn."""

    DECISIONS = ("_caps", "_next_grant", "_loan_to_start", "_check_queue_room",
                 "_engine_priority_of")  # fmt: skip

    def __init__(self, d: FairDispatcher, fail_at: int) -> None:
        self.calls = 0
        self.fail_at = fail_at
        self.fired: str | None = None
        for name in self.DECISIONS:
            setattr(d, name, self._wrap(name, getattr(d, name)))
        d._clock = self._wrap("clock", d._clock)
        loop = asyncio.get_running_loop()
        loop.create_future = self._wrap("create_future", loop.create_future)  # type: ignore[method-assign]
        self.armed = True

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            if self.armed:
                self.calls += 1
                if self.calls == self.fail_at:
                    self.fired = name
                    raise InjectedFault(name)
            return fn(*args, **kw)

        return call


def assert_consistent(d: FairDispatcher, tickets: list[Ticket]) -> None:
    """The dispatcher's counts are exactly those of the tickets still open: no waiter without a
    ticket, no slot without one, and every queued waiter can still be granted."""
    open_tickets = [t for t in tickets if not t.closed]
    running = [t for t in open_tickets if t.dispatched]
    queued = [t for t in open_tickets if not t.dispatched]
    assert d.totals() == {
        "running": sum(t.sequences for t in running),
        "queued": len(queued),
    }
    assert d._loaned == sum(t._waiter.loan for t in running)
    for tid, queue in d._tenants.items():
        mine = [t._waiter for t in queued if t.tenant_id == tid]
        assert list(queue.waiting) == mine  # same waiters, in arrival order
        assert queue.waiting_sequences == sum(w.sequences for w in mine)
        assert all(not w.future.done() for w in mine)
        assert queue.running == sum(t.sequences for t in running if t.tenant_id == tid)
        assert queue.running_requests == sum(t.tenant_id == tid for t in running)


def test_a_failure_at_any_step_leaves_the_queue_consistent() -> None:
    """For k = 1, 2, ...: the k-th decision raises in the middle of a mixed workload (joins,
    grants, wide requests on loan, cancellations, releases). After every operation the counts
    match the open tickets; a failed enqueue left nothing behind; once the fault is gone, every
    queued request is granted and closing everything leaves the dispatcher empty."""
    now = [0.0]

    def workload(d: FairDispatcher, tickets: list[Ticket]) -> None:
        def enqueue(tenant: str, weight: float, sequences: int = 1) -> None:
            with contextlib.suppress(InjectedFault, QueueFull):
                tickets.append(d.enqueue(tenant, weight, cost=10.0 * sequences,
                                         sequences=sequences))  # fmt: skip
            assert_consistent(d, tickets)

        def close(i: int) -> None:
            with contextlib.suppress(InjectedFault):
                tickets[i % len(tickets)].close()
            assert_consistent(d, tickets)

        for tenant, weight, sequences in [("a", 1.0, 1), ("a", 1.0, 2), ("b", 3.0, 1),
                                          ("a", 1.0, 4), ("c", 0.5, 6), ("b", 3.0, 2)]:  # fmt: skip
            enqueue(tenant, weight, sequences)
        now[0] += 1.0
        for i in (0, 2, 4):
            close(i)
        enqueue("c", 0.5, 1)
        now[0] += 20.0  # past the window: reservations lapse
        enqueue("d", 2.0, 6)
        for i in range(len(tickets)):
            close(i)

    async def scenario(fail_at: int) -> str | None:
        now[0] = 0.0
        d = FairDispatcher(max_running=6, max_queued=5, active_window_s=10.0, clock=lambda: now[0])
        faults = Faults(d, fail_at)
        tickets: list[Ticket] = []
        workload(d, tickets)
        faults.armed = False
        probe = d.enqueue("probe", 1.0)  # a change without faults: grants what may start
        tickets.append(probe)
        assert_consistent(d, tickets)
        for t in tickets:
            t.close()
        assert_consistent(d, tickets)
        assert d.totals() == {"running": 0, "queued": 0} and d._loaned == 0
        return faults.fired

    fired = []
    for fail_at in itertools.count(1):
        step = run(scenario(fail_at))
        if step is None:  # the workload made fewer decisions than k: every step was hit
            break
        fired.append(step)
    assert set(fired) == {"clock", "create_future", *Faults.DECISIONS}, set(fired)
    assert len(fired) > 50


def test_a_failure_while_granting_strands_no_waiter_and_the_next_change_grants_it() -> None:
    """The release is written before the dispatch that follows it; if that dispatch fails, the
    waiter stays queued with its ticket and the next change grants it."""

    async def scenario() -> None:
        d = FairDispatcher(max_running=1, max_queued=10, active_window_s=10.0)
        holder = d.enqueue("a", 1.0)
        waiter = d.enqueue("b", 1.0)
        faults = Faults(d, fail_at=1)
        with pytest.raises(InjectedFault):
            holder.close()
        assert holder.closed and not waiter.dispatched
        assert_consistent(d, [holder, waiter])
        faults.armed = False
        other = d.enqueue("c", 1.0)
        assert waiter.dispatched and not other.dispatched  # b's turn came first
        for t in (waiter, other):
            t.close()
        assert d.totals() == {"running": 0, "queued": 0}

    run(scenario())
