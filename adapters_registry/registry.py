"""The gateway's `AdapterSource`: the catalog's answer for a name, and its version held here.

Composed of the catalog kept in step with the shared log (`catalog_sync`), this replica's disk and
engine residency (`residency`) and the quarantines (`quarantine`). A poll loop applies what other
replicas appended, records this replica's quarantines the catalog lacks, and reconciles the
engine with the result (and with the engine's own list of loaded adapters).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from loraplex.adapters_registry.base import (
    AdapterError,
    AdapterInvalid,
    AdapterNotFound,
    ServableAdapter,
)
from loraplex.adapters_registry.catalog import Catalog
from loraplex.adapters_registry.catalog_sync import CatalogSync
from loraplex.adapters_registry.names import parse_ref
from loraplex.adapters_registry.quarantine import Quarantines, one_line
from loraplex.adapters_registry.records import VersionRecord
from loraplex.adapters_registry.residency import Residency
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.store import StoreError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class AdapterRegistry:
    settings: RegistrySettings
    sync: CatalogSync
    residency: Residency
    quarantines: Quarantines

    @property
    def catalog(self) -> Catalog:
        return self.sync.catalog

    # ---- AdapterSource ----

    def names(self) -> list[str]:
        return self.catalog.names()

    def resolve(self, model: str) -> VersionRecord:
        """The version `model` (`name` or `name@version`) names, if it may serve: raises
        AdapterNotFound, AdapterQuarantined."""
        record = self.lookup(model)
        self.quarantines.check(record, model)
        return record

    def lookup(self, model: str) -> VersionRecord:
        """The version `model` names, quarantined or not (admin); AdapterNotFound otherwise."""
        try:
            ref = parse_ref(model)
        except AdapterInvalid as e:
            raise AdapterNotFound(f"The model `{model}` does not exist.", param="model") from e
        return self.catalog.resolve(ref)

    async def prefetch(self, name: str) -> None:
        """Put `name`'s files on local disk (fetched once however many ask), taking no slot of
        the engine's cache. Raises AdapterNotFound, AdapterQuarantined, AdapterUnavailable."""
        await self.residency.prefetch(self.resolve(name))

    def lease(self, name: str) -> AbstractAsyncContextManager[ServableAdapter]:
        """Hold `name`'s version in the engine for one request (`AdapterSource.lease`); raises
        AdapterNotFound or AdapterQuarantined at once, AdapterUnavailable or AdapterNotApplied
        from its load."""
        return self.residency.lease(self.resolve(name), name)

    async def quarantine(self, name: str, version: str, reason: str) -> None:
        """See `AdapterSource.quarantine`: refused here at once, out of the engine once idle,
        then recorded in the catalog (retried at each poll if the store fails)."""
        reason = one_line(reason)
        record = self.catalog.versions(name).get(version)
        if record is None:
            log.warning("quarantine of adapter %s version %s ignored: no such version (%s)",
                        name, version, reason)  # fmt: skip
            return
        self.quarantines.add(record, reason)
        self.residency.retire(record.engine_id)
        await self._record_quarantines()

    async def _record_quarantines(self) -> None:
        """Write this replica's quarantines the catalog lacks; one that fails stays for the
        next poll. Never raises (the guard's call must not fail its caller)."""
        for name, version in self.quarantines.unrecorded():
            try:
                await self.sync.append(functools.partial(self.quarantines.event, name, version))
            except (AdapterError, StoreError) as e:
                log.warning("quarantine of adapter %s version %s holds on this replica; the "
                            "catalog write failed and is retried at the next poll: %s",
                            name, version, e)  # fmt: skip
                return
            self.quarantines.forget(name, version)

    # ---- following the catalog ----

    async def refresh(self) -> None:
        """Apply what the log gained since the last refresh, then reconcile the engine tiers
        with the catalog and with the engine's own list of loaded adapters."""
        await self.sync.refresh()
        await self._record_quarantines()
        extra, lost = await self.residency.tiers.reconcile()
        if extra or lost:
            log.warning("engine tiers disagreed: removed unknown ids %s, forgot lost ids %s",
                        sorted(extra), sorted(lost))  # fmt: skip
        await self.reconcile()

    async def reconcile(self) -> None:
        """Move the engine to what the catalog says: versions no name reaches and quarantined
        ones leave it; pinned names' versions are pinned (a quarantined version's pin waits for
        the quarantine to clear), the others unpinned."""
        await self.residency.drop_unreachable(self.catalog.live_engine_ids())
        quarantined = self.quarantines.engine_ids()
        pinned = {
            record.engine_id: record
            for record in self.catalog.pinned_records()
            if record.engine_id not in quarantined
        }
        await self.residency.match_catalog(quarantined, pinned)

    async def poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.poll_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("registry poll of %s failed; retrying", self.sync.store.uri)

    def stop_background(self) -> None:
        """Cancel the unpins and removals still waiting for their adapter to go idle (at
        shutdown)."""
        self.residency.stop()
