"""Admin operations over the registry: register, list, get, pin, unpin, evict, delete, rollback,
quarantine and unquarantine.

Each operation that changes what a name means appends one event to the shared catalog log, so
every replica converges on it; tier moves (warm, pin, evict) act on this replica's engine and disk.
Nothing is registered until the adapter has been fetched, validated, hashed and published: a
failure at any step leaves the catalog and the caches as they were.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from dataclasses import dataclass
from typing import Any, Literal

from loraplex.adapters_registry.base import (
    AdapterConflict,
    AdapterInvalid,
    AdapterNotFound,
    AdapterUnavailable,
)
from loraplex.adapters_registry.catalog import Catalog, VersionRecord
from loraplex.adapters_registry.disk_cache import CacheError, digest_folder
from loraplex.adapters_registry.names import check_name, check_new_name
from loraplex.adapters_registry.registry import AdapterRegistry
from loraplex.adapters_registry.sources import fetch_source, publish_blobs
from loraplex.adapters_registry.store import StoreError
from loraplex.adapters_registry.validation import ADAPTER_FILES, validate_adapter

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


class ManagedRegistry(AdapterRegistry):
    """The registry the server holds: an `AdapterSource` plus the admin operations."""

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
            tier=self.tier_of(record),
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
        check_new_name(name, self.spec.name)
        if pinned and len(self._pins_besides(name)) >= self.tiers.max_pinned:
            raise AdapterConflict(
                f"cannot pin `{name}`: {self.tiers.max_pinned} adapters are pinned already "
                "(the limit is engine.max_loras - 1)",
                param="pinned",
            )
        tmp = self.cache.new_temp_dir()
        try:
            await asyncio.to_thread(fetch_source, source, tmp, self.settings)
            checked = await asyncio.to_thread(
                validate_adapter, tmp, self.spec, max_lora_rank=self.max_lora_rank,
                allowed_dtypes=set(self.settings.allowed_dtypes),
                max_weight_abs=self.settings.max_weight_abs,
            )  # fmt: skip
            version, files = await asyncio.to_thread(digest_folder, tmp, ADAPTER_FILES)
            await asyncio.to_thread(publish_blobs, self.store, tmp, files)
            await asyncio.to_thread(self.cache.install, version, tmp, files)
        except AdapterInvalid as e:
            self.metrics.validation_failures.labels(e.reason).inc()
            raise
        except (StoreError, CacheError) as e:
            raise AdapterUnavailable(f"registering `{name}` failed: {e}", param="source") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

        def plan() -> dict[str, Any] | None:
            known = self.catalog.versions(name).get(version)
            entry = self.catalog.entry(name)
            if known is None:
                record = VersionRecord(
                    name, version, self.catalog.next_engine_id(), checked.rank, files,
                    self.spec.name, source, time.time(),
                )  # fmt: skip
                # A new version of a pinned name inherits the pin (on every replica).
                return Catalog.register_event(record, bool(entry and entry.pinned))
            if entry is None or entry.version != version:
                return Catalog.event("move", name, version=version)
            return None

        await self._append(plan)
        if warm and not pinned:
            await self.warm(self.lookup(name))
        await self._reconcile()
        if pinned:
            try:
                return await self.set_pinned(name, True)
            except AdapterConflict as e:
                raise AdapterConflict(
                    f"`{name}` is registered (version {version}) but not pinned: {e.message}",
                    param="pinned",
                ) from e
        return self.info(name)

    def _pins_besides(self, name: str) -> set[int]:
        """Engine ids pinned on this replica other than `name`'s current version's, whose pin
        a new version takes over."""
        try:
            own = {self.lookup(name).engine_id}
        except AdapterNotFound:
            own = set()
        return self.tiers.pinned_ids() - own

    async def set_pinned(self, name: str, pinned: bool) -> AdapterInfo:
        """Pin (or unpin) `name` on every replica. Pinning a quarantined version is a 422."""
        record = self.lookup(check_name(name))
        if pinned and record.engine_id not in self.tiers.pinned_ids():
            await self._pin_record(record)  # fails here, before the catalog says "pinned"

        def plan() -> dict[str, Any] | None:
            entry = self.catalog.entry(name)
            if entry is None or entry.pinned == pinned:
                return None
            # The engine's limit held on this replica; the catalog's counts every replica's
            # pins (two replicas pinning at once would each keep its own pin, forever).
            others = [n for n in self.catalog.names() if n != name and self.catalog.is_pinned(n)]
            if pinned and len(others) >= self.tiers.max_pinned:
                raise AdapterConflict(
                    f"cannot pin `{name}`: {', '.join(others)} already pinned in the catalog "
                    f"(at most {self.tiers.max_pinned}: engine.max_loras - 1)",
                    param="pinned",
                )
            return Catalog.event("pin", name, pinned=pinned)

        try:
            await self._append(plan)
        finally:
            await self._reconcile()  # also drops this replica's pin where the catalog refused
        return self.info(name)

    async def evict(self, name: str, tier: EvictTier) -> AdapterInfo:
        """Drop the current version from `tier` and the tiers above it, on this replica.

        Pinned adapters refuse: the pin is the operator's word that it stays in a GPU slot."""
        record = self.lookup(check_name(name))
        if self.catalog.is_pinned(name):
            raise AdapterConflict(f"`{name}` is pinned; unpin it before evicting", param="tier")
        if self.tiers.tier(record.engine_id) is not None and not await self.tiers.evict(
            record.engine_id, self.settings.delete_drain_s
        ):
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

        def plan() -> dict[str, Any] | None:
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
            return Catalog.event("move", name, version=to, rollback=True)

        await self._append(plan)
        await self._reconcile()
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

        def plan() -> dict[str, Any] | None:
            if self.catalog.quarantine_of(name, record.version) is None:
                return None
            return Catalog.event("unquarantine", name, version=record.version)

        await self._append(plan)
        await self._reconcile()
        return self.info(name)

    async def delete(self, name: str) -> None:
        """Unregister `name` on every replica; its engine copies go once in-flight requests end."""
        record = self.lookup(check_name(name))
        versions = list(self.catalog.versions(name).values())

        def plan() -> dict[str, Any] | None:
            return Catalog.event("delete", name) if self.catalog.entry(name) else None

        await self._append(plan)
        for r in versions or [record]:
            if self.tiers.tier(r.engine_id) is not None:
                await self.tiers.evict(r.engine_id, self.settings.delete_drain_s)
