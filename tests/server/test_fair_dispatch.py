"""The fair dispatcher with simulated tenants on a real event loop (no engine: pure scheduling)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from loraplex.server.tenancy.errors import QueueFull
from loraplex.server.tenancy.fair import FairDispatcher, Ticket


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
