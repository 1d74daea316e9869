"""The registry the server holds: the gateway's `AdapterSource` and the admin operations (register,
list, get, pin, unpin, evict, delete, rollback, quarantine and unquarantine).

The operations are composed from the source's parts. Each one that changes what a name means plans
one event on the fresh catalog and appends it (`CatalogSync.append`), so every replica converges on
it, then moves this replica's engine to the result (`AdapterRegistry.reconcile`); tier moves (warm,
pin, evict) act on this replica's residency. Registration appends nothing until the version is
fetched, validated, hashed and published (`registration`).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal

from loraplex.adapters_registry.base import (
    AdapterConflict,
    AdapterNotFound,
    ServableAdapter,
)
from loraplex.adapters_registry.events import (
    Deleted,
    Event,
    Moved,
    PinSet,
    Registered,
    Unquarantined,
)
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.names import check_name, check_new_name
from loraplex.adapters_registry.pins import PinLimit
from loraplex.adapters_registry.records import VersionRecord
from loraplex.adapters_registry.registration import Registrar
from loraplex.adapters_registry.registry import AdapterRegistry

EvictTier = Literal["cpu", "disk"]


@dataclass(frozen=True)
class AdapterInfo:
    """What the admin API shows for one name."""

    name: str
    version: str
    engine_id: int
    rank: int
    size_bytes: int
    base_model: str
    source: str
    created_at: float
    # The fastest tier holding it on this replica: "gpu" | "cpu" | "disk" | "s3" (or "store" for
    # a local-directory store).
    tier: str
    pinned: bool
    last_used: float | None
    in_flight: int
    previous_versions: list[str]
    health: str  # VersionHealth's value: "healthy" | "quarantined"
    quarantine_reason: str | None


@dataclass(eq=False)
class ManagedRegistry:
    source: AdapterRegistry
    registrar: Registrar
    pins: PinLimit
    metrics: RegistryMetrics

    def __post_init__(self) -> None:
        # The parts the operations compose, shared with `source` (the start-up sweep, the
        # benchmarks and tests read them too).
        source = self.source
        self.settings = source.settings
        self.sync, self.catalog, self.store = source.sync, source.catalog, source.sync.store
        self.residency, self.quarantines = source.residency, source.quarantines
        self.tiers, self.cache = source.residency.tiers, source.residency.cache

    # ---- the gateway's AdapterSource, and following the catalog: the source's ----

    def names(self) -> list[str]:
        return self.source.names()

    def resolve(self, model: str) -> VersionRecord:
        return self.source.resolve(model)

    def lookup(self, model: str) -> VersionRecord:
        return self.source.lookup(model)

    async def prefetch(self, name: str) -> None:
        await self.source.prefetch(name)

    def lease(self, name: str) -> AbstractAsyncContextManager[ServableAdapter]:
        return self.source.lease(name)

    async def quarantine(self, name: str, version: str, reason: str) -> None:
        await self.source.quarantine(name, version, reason)

    async def refresh(self) -> None:
        await self.source.refresh()

    async def poll_forever(self) -> None:
        await self.source.poll_forever()

    def stop_background(self) -> None:
        self.source.stop_background()

    # ---- admin operations ----

    def info(self, name: str) -> AdapterInfo:
        check_name(name)
        record = self.lookup(name)
        entry = self.catalog.entry(name)
        assert entry is not None  # lookup() raised otherwise
        quarantine = self.quarantines.of(record)
        return AdapterInfo(
            name=name,
            version=record.version,
            engine_id=record.engine_id,
            rank=record.rank,
            size_bytes=record.size_bytes,
            base_model=record.base_model,
            source=record.source,
            created_at=record.created_at,
            tier=self.residency.tier_of(record),
            pinned=entry.pinned,
            last_used=self.tiers.last_used(record.engine_id),
            in_flight=self.tiers.leases(record.engine_id),
            previous_versions=list(entry.history),
            health=self.quarantines.health(record).value,
            quarantine_reason=quarantine.reason if quarantine else None,
        )

    def list(self) -> list[AdapterInfo]:
        return [self.info(name) for name in self.catalog.names()]

    async def register(
        self, name: str, source: str, *, warm: bool = False, pinned: bool = False
    ) -> AdapterInfo:
        """Fetch, validate, publish and register `source` as the current version of `name`;
        with `pinned`, then pin it (`set_pinned`: on the engine first, then in the catalog).
        A pin refused then (another pin took the last slot meanwhile) is a 409 that says the
        registration stands."""
        check_new_name(name, self.registrar.spec.name)
        if pinned:  # before any fetch
            self.pins.check(name, self._pinned_besides(name), "on this replica")
        prepared = await self.registrar.prepare(name, source)

        def plan() -> Event | None:
            known = self.catalog.versions(name).get(prepared.version)
            entry = self.catalog.entry(name)
            if known is None:
                record = VersionRecord(
                    name, prepared.version, self.catalog.next_engine_id(), prepared.rank,
                    prepared.files, self.registrar.spec.name, source, time.time(),
                )  # fmt: skip
                # A new version of a pinned name inherits the pin (on every replica).
                return Registered(name=name, record=record, pinned=bool(entry and entry.pinned))
            if entry is None or entry.version != prepared.version:
                return Moved(name=name, version=prepared.version)
            return None

        await self.sync.append(plan)
        if warm and not pinned:
            await self.residency.warm(self.lookup(name))
        await self.source.reconcile()
        if pinned:
            try:
                return await self.set_pinned(name, True)
            except AdapterConflict as e:
                raise AdapterConflict(
                    f"`{name}` is registered (version {prepared.version}) but not pinned: "
                    f"{e.message}",
                    param="pinned",
                ) from e
        return self.info(name)

    def _pinned_besides(self, name: str) -> tuple[str, ...]:
        """Names pinned on this replica other than `name`'s current version, whose pin a new
        version takes over."""
        try:
            own = self.lookup(name).engine_id
        except AdapterNotFound:
            own = None
        return tuple(held for id_, held in self.tiers.pinned_names().items() if id_ != own)

    async def set_pinned(self, name: str, pinned: bool) -> AdapterInfo:
        """Pin (or unpin) `name` on every replica. Pinning a quarantined version is a 422."""
        record = self.lookup(check_name(name))
        if pinned and record.engine_id not in self.tiers.pinned_ids():
            await self.residency.pin(record)  # fails here, before the catalog says "pinned"

        def plan() -> Event | None:
            entry = self.catalog.entry(name)
            if entry is None or entry.pinned == pinned:
                return None
            if pinned:  # the catalog counts every replica's pins
                catalog = self.catalog
                others = [n for n in catalog.names() if n != name and catalog.is_pinned(n)]
                self.pins.check(name, others, "in the catalog")
            return PinSet(name=name, pinned=pinned)

        try:
            await self.sync.append(plan)
        finally:
            await self.source.reconcile()  # also drops this replica's pin where the catalog refused
        return self.info(name)

    async def evict(self, name: str, tier: EvictTier) -> AdapterInfo:
        """Drop the current version from `tier` and the tiers above it, on this replica.

        Pinned adapters refuse: the pin is the operator's word that it stays in a GPU slot."""
        record = self.lookup(check_name(name))
        if self.catalog.is_pinned(name):
            raise AdapterConflict(f"`{name}` is pinned; unpin it before evicting", param="tier")
        if not await self.residency.unload(record, self.settings.delete_drain_s):
            raise AdapterConflict(
                f"`{name}` still has requests in flight after {self.settings.delete_drain_s}s",
                param="tier",
            )
        if tier == "disk":
            await asyncio.to_thread(self.cache.evict, record.version)
        return self.info(name)

    async def rollback(self, name: str, version: str | None = None) -> AdapterInfo:
        """Point `name` back at its previous version (or at `version`, one it had before).
        A quarantined target is a 409: unquarantine it first."""
        check_name(name)
        target = self.lookup(f"{name}@{version}").version if version else None

        def plan() -> Event | None:
            entry = self.catalog.entry(name)
            if entry is None:
                self.lookup(name)  # raises AdapterNotFound
                return None
            to = target or (entry.history[-1] if entry.history else None)
            if to is None:
                raise AdapterConflict(f"`{name}` has no earlier version to roll back to")
            record = self.catalog.versions(name).get(to)
            if record is None:  # deleted on another replica meanwhile
                raise AdapterNotFound(f"The model `{name}@{to}` does not exist.", param="version")
            quarantine = self.quarantines.of(record)
            if quarantine is not None:
                raise AdapterConflict(
                    f"cannot roll `{name}` back to version {to}: it is quarantined "
                    f"({quarantine.reason}); unquarantine it first",
                    param="version",
                )
            if to == entry.version:
                return None
            return Moved(name=name, version=to, rollback=True)

        await self.sync.append(plan)
        await self.source.reconcile()
        return self.info(name)

    async def set_quarantined(
        self, name: str, quarantined: bool, *, version: str | None = None, reason: str = ""
    ) -> AdapterInfo:
        """Quarantine (`AdapterSource.quarantine`) or clear the quarantine of `name`'s current
        version, or of `version`, on every replica. Idempotent. A cleared version serves again
        (and takes its name's pin back) at once here, on other replicas at their next poll."""
        check_name(name)
        record = self.lookup(f"{name}@{version}" if version else name)
        if quarantined:
            await self.quarantine(name, record.version, reason)
            return self.info(name)
        self.quarantines.forget(name, record.version)  # not to be written at the next poll

        def plan() -> Event | None:
            if self.catalog.quarantine_of(name, record.version) is None:
                return None
            return Unquarantined(name=name, version=record.version)

        await self.sync.append(plan)
        await self.source.reconcile()
        return self.info(name)

    async def delete(self, name: str) -> None:
        """Unregister `name` on every replica; its engine copies go once in-flight requests end."""
        record = self.lookup(check_name(name))
        versions = list(self.catalog.versions(name).values())

        def plan() -> Event | None:
            return Deleted(name=name) if self.catalog.entry(name) else None

        await self.sync.append(plan)
        for r in versions or [record]:
            await self.residency.unload(r, self.settings.delete_drain_s)
