"""Engine tiers and single flight: bounded CPU tier, LRU of idle adapters, pins, reconcile."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from registry_builders import write_adapter
from registry_fake_engine import FakeEngine

from loraplex.adapters_registry.base import AdapterConflict, ServableAdapter
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.pins import PinLimit
from loraplex.adapters_registry.single_flight import SingleFlight
from loraplex.adapters_registry.tiers import EngineTier, EngineTiers

pytestmark = pytest.mark.anyio


def adapters(tmp_path: Path, n: int) -> list[ServableAdapter]:
    folder = write_adapter(tmp_path / "a")
    return [ServableAdapter(f"a{i}", "v", i, folder, 4) for i in range(1, n + 1)]


def make(engine: FakeEngine, max_cpu: int = 2, max_pinned: int = 1) -> EngineTiers:
    metrics = RegistryMetrics(CollectorRegistry())
    return EngineTiers(engine, max_cpu=max_cpu, pins=PinLimit(max_pinned), metrics=metrics)


async def test_single_flight_runs_once_and_survives_a_cancelled_caller() -> None:
    flight: SingleFlight[str, int] = SingleFlight()
    runs = 0

    async def work() -> int:
        nonlocal runs
        runs += 1
        await asyncio.sleep(0.05)
        return 7

    callers = [asyncio.create_task(flight.do("k", work)) for _ in range(50)]
    await asyncio.sleep(0.01)
    callers[0].cancel()
    results = await asyncio.gather(*callers[1:])
    assert runs == 1 and set(results) == {7} and not flight.running("k")


async def test_lru_of_idle_adapters_and_view_matches_engine(tmp_path: Path) -> None:
    engine = FakeEngine()
    tiers = make(engine)
    a1, a2, a3 = adapters(tmp_path, 3)
    for a in (a1, a2):
        await tiers.load(a, 100)
    assert tiers.try_hold(1)  # a1 busy: a2 is the only idle victim
    await tiers.load(a3, 100)
    assert set(engine.loaded) == tiers.loaded_ids() == {1, 3}
    await tiers.release(1)
    assert await tiers.reconcile() == (set(), set())


async def test_load_waits_while_every_slot_is_busy(tmp_path: Path) -> None:
    tiers = make(FakeEngine(), max_cpu=1)
    a1, a2 = adapters(tmp_path, 2)
    await tiers.load(a1, 100)
    assert tiers.try_hold(1)
    waiting = asyncio.create_task(tiers.load(a2, 100))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # vLLM's own LRU would have evicted a1 under a running request
    await tiers.release(1)
    await asyncio.wait_for(waiting, 1)
    assert tiers.loaded_ids() == {2}


async def test_pins_stay_below_max_loras_and_unpin_keeps_cpu(tmp_path: Path) -> None:
    engine = FakeEngine()
    tiers = make(engine, max_cpu=3, max_pinned=1)
    a1, a2 = adapters(tmp_path, 2)
    await tiers.load(a1, 100)
    await tiers.load(a2, 100)
    await tiers.pin(1)
    assert engine.pinned == {1} and tiers.tier(1) is EngineTier.GPU
    with pytest.raises(AdapterConflict, match="max_loras"):
        await tiers.pin(2)
    await tiers.unpin(1)
    assert engine.pinned == set() and tiers.tier(1) is EngineTier.CPU and 1 in engine.loaded


async def test_two_pins_at_once_cannot_both_pass_the_limit(tmp_path: Path) -> None:
    engine = FakeEngine()
    engine.pin_delay_s = 0.05  # each pin awaits the engine between its check and its effect
    tiers = make(engine, max_cpu=3, max_pinned=1)
    for a in adapters(tmp_path, 2):
        await tiers.load(a, 100)
    results = await asyncio.gather(tiers.pin(1), tiers.pin(2), return_exceptions=True)
    assert len(tiers.pinned_ids()) == len(engine.pinned) == 1
    assert sum(isinstance(r, AdapterConflict) for r in results) == 1


async def test_unpin_waits_for_no_request_in_flight_and_holds_none_up(tmp_path: Path) -> None:
    engine = FakeEngine(load_delay_s=0.05)
    tiers = make(engine, max_cpu=3, max_pinned=1)
    (a1,) = adapters(tmp_path, 1)
    await tiers.load(a1, 100)
    await tiers.pin(1)
    assert tiers.try_hold(1)  # a running request
    unpinning = asyncio.create_task(tiers.unpin(1))
    await asyncio.sleep(0.02)
    # vLLM would load a removed adapter back by itself for the running request: still pinned,
    # and a new request is served at once.
    assert not unpinning.done() and engine.pinned == {1}
    assert tiers.try_hold(1)
    await tiers.release(1)
    await asyncio.sleep(0.02)
    assert not unpinning.done()  # the second request still runs
    await tiers.release(1)  # none in flight: removed, being added back
    await asyncio.sleep(0.01)
    assert tiers.tier(1) is EngineTier.LOADING and not tiers.try_hold(1)
    await asyncio.wait_for(tiers.load(a1, 100), 1)  # waits for the re-add, adds nothing itself
    assert tiers.tier(1) is EngineTier.CPU and engine.add_calls == 2
    await asyncio.wait_for(unpinning, 1)
    assert engine.pinned == set() and tiers.leases(1) == 0


async def test_an_unpin_and_an_evict_waiting_on_one_adapter_leave_the_view_true(
    tmp_path: Path,
) -> None:
    engine = FakeEngine()
    tiers = make(engine, max_cpu=3, max_pinned=1)
    (a1,) = adapters(tmp_path, 1)
    await tiers.load(a1, 100)
    await tiers.pin(1)
    assert tiers.try_hold(1)
    unpinning = asyncio.create_task(tiers.unpin(1))
    evicting = asyncio.create_task(tiers.evict(1, drain_s=5))
    await asyncio.sleep(0.01)
    await tiers.release(1)  # both wake
    await asyncio.wait_for(asyncio.gather(unpinning, evicting), 2)
    assert tiers.loaded_ids() == set(engine.loaded) and engine.pinned == set()


async def test_reconcile_keeps_a_load_that_ends_while_the_engine_answers(tmp_path: Path) -> None:
    engine = FakeEngine(load_delay_s=0.02)
    engine.list_delay_s = 0.05
    tiers = make(engine)
    (a1,) = adapters(tmp_path, 1)
    loading = asyncio.create_task(tiers.load(a1, 100))
    await asyncio.sleep(0)
    extra, lost = await tiers.reconcile()  # the engine's list predates the load's end
    await loading
    assert (extra, lost) == (set(), set())
    assert tiers.loaded_ids() == set(engine.loaded) == {1}


async def test_evict_waits_for_in_flight_requests(tmp_path: Path) -> None:
    engine = FakeEngine()
    tiers = make(engine)
    (a1,) = adapters(tmp_path, 1)
    await tiers.load(a1, 100)
    assert tiers.try_hold(1)
    assert not await tiers.evict(1, drain_s=0.05)  # still in use: refused after the wait
    eviction = asyncio.create_task(tiers.evict(1, drain_s=5))
    await asyncio.sleep(0.05)
    assert 1 in engine.loaded
    await tiers.release(1)
    assert await eviction and engine.loaded == {}


async def test_reconcile_drops_what_only_one_side_holds(tmp_path: Path) -> None:
    engine = FakeEngine()
    tiers = make(engine)
    a1, a2 = adapters(tmp_path, 2)
    await tiers.load(a1, 100)
    engine.loaded[99] = a2.path  # something loaded behind the registry's back
    del engine.loaded[1]  # and something the engine lost
    assert await tiers.reconcile() == ({99}, {1})
    assert engine.loaded == {} and tiers.loaded_ids() == set()


async def test_retire_takes_no_new_lease_and_removes_a_pinned_adapter_once_idle(
    tmp_path: Path,
) -> None:
    engine = FakeEngine()
    tiers = make(engine, max_cpu=3, max_pinned=1)
    (a1,) = adapters(tmp_path, 1)
    await tiers.load(a1, 100)
    await tiers.pin(1)
    assert tiers.try_hold(1)  # the request that found it bad
    retiring = asyncio.create_task(tiers.retire(1))
    await asyncio.sleep(0.02)
    assert not tiers.try_hold(1)  # no new lease from the call on
    assert not retiring.done() and engine.pinned == {1}  # the running request finishes
    loading = asyncio.create_task(tiers.load(a1, 100))  # a load waits for the removal
    await asyncio.sleep(0.02)
    assert not loading.done()
    await tiers.release(1)
    await asyncio.wait_for(asyncio.gather(retiring, loading), 1)
    assert engine.loaded == {} and engine.pinned == set() and tiers.loaded_ids() == set()
    await tiers.retire(1)  # not loaded: returns at once
