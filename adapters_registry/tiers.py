"""The engine's tiers as the registry drives them: vLLM's CPU cache and pinned GPU slots.

The registry, not vLLM's LRU, decides what the engine holds: at most `max_cpu` adapters are added
at once (vLLM's `max_cpu_loras`), so vLLM never evicts on its own and this view always matches
`list_loras()`. To make room the least recently used adapter with no request in flight and no pin
is removed; when every slot is busy, a load waits for a request to finish. Pins stay within the
`PinLimit`: pins and unpins take turns, so two at once cannot both pass its check. An adapter
leaves the engine only with no request in flight on it: vLLM would load a removed adapter back by
itself for a running request, behind this view's back; an unpin waits for such a moment without
holding any request up, and so does a retirement (a quarantined adapter: no new lease from the
moment it is retired).

All methods run on the event loop; `add_lora` awaits the engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from enum import Enum

from loraplex.adapters_registry.base import ServableAdapter
from loraplex.adapters_registry.engine import EngineLoraControl
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.pins import PinLimit


class EngineTier(Enum):
    LOADING = "loading"
    CPU = "cpu"
    GPU = "gpu"  # pinned: loaded and kept in a GPU slot


@dataclass
class _Slot:
    adapter: ServableAdapter
    size: int
    tier: EngineTier
    leases: int = 0
    last_used: float = 0.0
    draining: bool = False  # being unpinned: no new lease until it is back in the CPU cache
    retiring: bool = False  # quarantined: no new lease; removed once the last one ends


class EngineTiers:
    def __init__(
        self, engine: EngineLoraControl, *, max_cpu: int, pins: PinLimit, metrics: RegistryMetrics
    ) -> None:
        self._engine = engine
        self._max_cpu = max_cpu
        self._pins = pins
        self._metrics = metrics
        self._slots: dict[int, _Slot] = {}
        self._changed = asyncio.Condition()
        self._pinning = asyncio.Lock()

    # ---- views ----

    def tier(self, engine_id: int) -> EngineTier | None:
        slot = self._slots.get(engine_id)
        return slot.tier if slot else None

    def leases(self, engine_id: int) -> int:
        slot = self._slots.get(engine_id)
        return slot.leases if slot else 0

    def last_used(self, engine_id: int) -> float | None:
        slot = self._slots.get(engine_id)
        return slot.last_used if slot else None

    def loaded_ids(self) -> set[int]:
        return {i for i, s in self._slots.items() if s.tier is not EngineTier.LOADING}

    def pinned_ids(self) -> set[int]:
        return set(self.pinned_names())

    def pinned_names(self) -> dict[int, str]:
        """Engine id -> adapter name of each pinned adapter."""
        return {i: s.adapter.name for i, s in self._slots.items() if s.tier is EngineTier.GPU}

    def residents(self) -> list[tuple[ServableAdapter, bool]]:
        """(adapter, pinned) for each adapter in the engine, those still being added left out."""
        return [
            (s.adapter, s.tier is EngineTier.GPU)
            for s in self._slots.values()
            if s.tier is not EngineTier.LOADING
        ]

    def _publish(self) -> None:
        for tier in (EngineTier.CPU, EngineTier.GPU):
            slots = [s for s in self._slots.values() if s.tier is tier]
            self._metrics.resident.labels(tier.value).set(len(slots))
            self._metrics.resident_bytes.labels(tier.value).set(sum(s.size for s in slots))

    # ---- leases ----

    def try_hold(self, engine_id: int) -> bool:
        """Take a lease on a loaded adapter (no await: the routing fast path)."""
        slot = self._slots.get(engine_id)
        if slot is None or not self._settled(slot):
            return False
        slot.leases += 1
        slot.last_used = time.time()
        return True

    @staticmethod
    def _settled(slot: _Slot | None) -> bool:
        """Neither being added, unpinned nor retired: its leases can be taken."""
        return slot is None or (
            slot.tier is not EngineTier.LOADING and not slot.draining and not slot.retiring
        )

    async def release(self, engine_id: int) -> None:
        slot = self._slots.get(engine_id)
        if slot is not None:
            slot.leases -= 1
            slot.last_used = time.time()
        async with self._changed:
            self._changed.notify_all()

    # ---- loading and eviction ----

    async def load(self, adapter: ServableAdapter, size: int) -> None:
        """Add `adapter` to the engine's CPU cache, evicting or waiting for room. Idempotent;
        while the adapter is being added back by `unpin`, waits for that to end."""
        if adapter.engine_id in self._slots:
            async with self._changed:
                await self._changed.wait_for(
                    lambda: self._settled(self._slots.get(adapter.engine_id))
                )
            return
        async with self._changed:
            while len(self._slots) >= self._max_cpu:
                victim = self._victim()
                if victim is not None:
                    await self._remove(victim)
                else:
                    await self._changed.wait()
            self._slots[adapter.engine_id] = _Slot(adapter, size, EngineTier.LOADING)
        start = time.perf_counter()
        try:
            await self._engine.add_lora(adapter)
        except BaseException:
            del self._slots[adapter.engine_id]
            self._metrics.load_failures.labels("cpu").inc()
            async with self._changed:
                self._changed.notify_all()
            raise
        self._slots[adapter.engine_id].tier = EngineTier.CPU
        self._metrics.loads.labels("cpu").inc()
        self._metrics.load_seconds.labels("cpu").observe(time.perf_counter() - start)
        self._publish()
        async with self._changed:
            self._changed.notify_all()

    def _victim(self) -> int | None:
        idle = [
            (s.last_used, i)
            for i, s in self._slots.items()
            if s.tier is EngineTier.CPU and s.leases == 0
        ]
        return min(idle)[1] if idle else None

    async def _remove(self, engine_id: int) -> None:
        slot = self._slots.pop(engine_id)
        await self._engine.remove_lora(engine_id)
        self._metrics.evictions.labels(slot.tier.value).inc()
        self._publish()

    async def pin(self, engine_id: int) -> None:
        """Pin a loaded adapter to a GPU slot. Raises AdapterConflict past the pin limit."""
        async with self._pinning:
            slot = self._slots[engine_id]
            if slot.tier is EngineTier.GPU:
                return
            self._pins.check(slot.adapter.name, self.pinned_names().values(), "on this replica")
            await self._engine.pin_lora(engine_id)
            slot.tier = EngineTier.GPU
            self._metrics.loads.labels("gpu").inc()
            self._publish()

    async def unpin(self, engine_id: int) -> None:
        """vLLM has no unpin: remove the adapter and add it back, unpinned, to the CPU cache.
        vLLM would load a removed adapter back by itself for a running request, so this waits,
        holding up nothing, for a moment with no request in flight on it (on a hot adapter that
        can take long: callers run it as a task). Returns at once if it is not pinned."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._unpinnable(engine_id))
            slot = self._slots.get(engine_id)
            if slot is None or slot.tier is not EngineTier.GPU:
                return
            slot.draining = True  # set where leases were 0: no lease can be taken from here
        try:
            async with self._pinning:  # still counted as pinned until it leaves the GPU slot
                if self._slots.get(engine_id) is not slot:  # evicted meanwhile
                    return
                slot.tier = EngineTier.LOADING
                try:
                    await self._engine.remove_lora(engine_id)
                    await self._engine.add_lora(slot.adapter)
                except BaseException:
                    self._slots.pop(engine_id, None)  # on disk only; the next request loads it
                    raise
                slot.tier = EngineTier.CPU
                self._metrics.evictions.labels("gpu").inc()
        finally:
            slot.draining = False
            self._publish()
            async with self._changed:
                self._changed.notify_all()  # the loads waiting for it

    def _unpinnable(self, engine_id: int) -> bool:
        slot = self._slots.get(engine_id)
        return slot is None or slot.tier is not EngineTier.GPU or slot.leases == 0

    async def retire(self, engine_id: int) -> None:
        """Remove `engine_id` (CPU cache, GPU slot, pin) once no request holds it, however long
        that takes (callers run it as a task); from the call on it takes no new lease, and a
        `load` of it waits for the removal. Returns at once if it is not in the engine."""
        slot = self._slots.get(engine_id)
        if slot is None:
            return
        slot.retiring = True
        async with self._changed:
            await self._changed.wait_for(lambda: self._removable(engine_id, slot))
            if self._slots.get(engine_id) is slot:
                await self._remove(engine_id)
            self._changed.notify_all()

    def _removable(self, engine_id: int, slot: _Slot) -> bool:
        """`slot` is gone, or idle and neither being added nor being unpinned."""
        if self._slots.get(engine_id) is not slot:
            return True
        return slot.leases == 0 and slot.tier is not EngineTier.LOADING and not slot.draining

    async def evict(self, engine_id: int, drain_s: float) -> bool:
        """Remove from the engine once no request holds it (waiting up to `drain_s`)."""
        deadline = time.monotonic() + drain_s
        async with self._changed:
            while self.leases(engine_id) > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    return False
            if engine_id not in self._slots or not self._settled(self._slots[engine_id]):
                return False  # being added, or being unpinned (then evictable once it is done)
            await self._remove(engine_id)
            self._changed.notify_all()
            return True

    async def reconcile(self) -> tuple[set[int], set[int]]:
        """Compare with the engine's own list; drop what either side holds alone.

        Returns (ids the engine had that we did not, ids we had that the engine lost). Only ids
        loaded both before and after the engine answered count as lost: a load that ends while
        the engine answers is not in its list."""
        before = self.loaded_ids()
        actual = await self._engine.list_loras()
        extra, lost = actual - set(self._slots), (before & self.loaded_ids()) - actual
        for engine_id in extra:
            await self._engine.remove_lora(engine_id)
        for engine_id in lost:
            slot = self._slots.get(engine_id)  # the removals above await: it may be gone
            if slot is not None and slot.leases == 0:
                del self._slots[engine_id]
        self._publish()
        async with self._changed:
            self._changed.notify_all()  # a retirement waiting on a slot the engine lost
        return extra, lost
