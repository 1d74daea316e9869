"""Durable tenants: one record per tenant, kept in the adapter catalog's log.

Every replica pointing at the same bucket or directory sees the same tenants. A record holds key
hashes, never keys. A change to tenants appends one `RecordsChanged` event under the namespace
`tenants` to the catalog's log (`CatalogSync.append`: planned on the log's current state, planned
again when another replica wrote first), and the registry's poll, which reads the log's next
entry by key, brings it to every other replica: the tenants cost an idle replica no S3 request
of their own, however many there are, and a change arrives within the same poll interval as an
adapter's. A start reads them with the catalog (its snapshot, then the log after it).

Each record is checked against the admin API's bounds when read (`Tenant.from_record`): one out
of bounds, written by hand or before a bound existed, is skipped with an error log, once per
version of it, while the others load.

The previous release kept one object per tenant at `tenancy.store_prefix` (`tenants/<id>.json`,
a deleted one as `{"id": ..., "deleted": true}`). While the log has no tenants, a start imports
those objects into it in one event (`import_legacy`, once per store: the first replica to write
wins); afterwards they are never read again, and are left in place. Replicas of the previous
release neither see the log's tenants nor carry them in the catalog snapshots they write, so
tenants are changed once every replica runs this release.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from loraplex.adapters_registry.base import AdapterUnavailable
from loraplex.adapters_registry.catalog_sync import CatalogSync
from loraplex.adapters_registry.events import RecordsChanged
from loraplex.adapters_registry.store import ObjectMissing, ObjectStore, StoreError
from loraplex.server.tenancy.errors import TenantStoreUnavailable
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.settings import TENANT_ID_PATTERN

NAMESPACE = "tenants"

log = logging.getLogger(__name__)


class TenantStore:
    def __init__(self, sync: CatalogSync, legacy_prefix: str) -> None:
        self._sync = sync
        self._legacy_prefix = legacy_prefix
        self._records: Mapping[str, Any] | None = None
        self._tenants: dict[str, Tenant] = {}
        # Per tenant id: the record last read and what it gave (None: skipped), so that a change
        # checks only the records it changed, and a bad one is logged once.
        self._read: dict[str, tuple[object, Tenant | None]] = {}

    def tenants(self) -> dict[str, Tenant]:
        """Every tenant in the log as of the catalog's last refresh, by id. The same dict until
        the tenants change (a caller may tell a change by identity); never mutated."""
        records = self._sync.catalog.records(NAMESPACE) or {}
        if records is not self._records:
            self._records, self._tenants = records, self._read_all(records)
        return self._tenants

    def _read_all(self, records: Mapping[str, Any]) -> dict[str, Tenant]:
        read: dict[str, tuple[object, Tenant | None]] = {}
        for tenant_id, record in records.items():
            known = self._read.get(tenant_id)
            if known is not None and known[0] is record:
                read[tenant_id] = known
            else:
                read[tenant_id] = (record, _logged_tenant(tenant_id, record))
        self._read = read
        return {tenant_id: tenant for tenant_id, (_, tenant) in read.items() if tenant is not None}

    async def refresh(self) -> None:
        """Apply what the catalog's log gained since the last refresh (other replicas' changes).
        Raises StoreError."""
        await self._sync.refresh()

    async def put(self, plan: Callable[[], Tenant]) -> Tenant:
        """Store the tenant `plan()` builds from the log's current state (`tenants()` is fresh
        when it runs; it may run more than once). `plan` raises to refuse. Raises
        TenantStoreUnavailable."""
        planned: list[Tenant] = []

        def event() -> RecordsChanged:
            planned.append(plan())
            return RecordsChanged(name=NAMESPACE, changes={planned[-1].id: planned[-1].to_record()})

        await self._append(event)
        return planned[-1]

    async def delete(self, plan: Callable[[], str]) -> None:
        """Delete the tenant whose id `plan()` returns, decided as `put` decides."""
        await self._append(lambda: RecordsChanged(name=NAMESPACE, changes={plan(): None}))

    async def import_legacy(self) -> None:
        """Import the previous release's tenant objects, unless the log has tenants (see the
        module docstring). Raises StoreError, TenantStoreUnavailable."""
        if self._sync.catalog.records(NAMESPACE) is not None:
            return
        records = await asyncio.to_thread(self._read_legacy)
        if records is None:
            return

        written: list[bool] = []

        def plan() -> RecordsChanged | None:
            # None: another replica imported them first, or a tenant was written meanwhile.
            written.append(self._sync.catalog.records(NAMESPACE) is None)
            return RecordsChanged(name=NAMESPACE, changes=records) if written[-1] else None

        await self._append(plan)
        if written[-1]:
            source = f"{self._sync.store.uri.rstrip('/')}/{self._legacy_prefix}"
            log.info("imported %d tenants from %s into the catalog's log", len(records), source)

    def _read_legacy(self) -> dict[str, Any] | None:
        """The live tenants' records at the legacy prefix, each one checked; None if there is
        no object there at all."""
        store: ObjectStore = self._sync.store
        keys = store.list_keys(self._legacy_prefix, nested=False)
        keys = [k for k in keys if k.endswith(".json")]
        if not keys:
            return None
        records: dict[str, Any] = {}
        for key in keys:
            tenant_id = key[len(self._legacy_prefix) :].removesuffix(".json")
            try:
                record = json.loads(store.get_bytes(key))
                if isinstance(record, dict) and record.get("deleted"):
                    continue  # the previous release's tombstone
                tenant_of(tenant_id, record)
            except ObjectMissing:
                continue  # deleted between listing and reading
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                log.error("tenant record %s is invalid and is not imported: %s", key, e)
                continue
            records[tenant_id] = record
        return records

    async def _append(self, plan: Callable[[], RecordsChanged | None]) -> None:
        try:
            await self._sync.append(plan)
        except AdapterUnavailable as e:  # the write failed, or other writers kept winning
            raise TenantStoreUnavailable(f"Tenants could not be changed: {e.message}") from e
        except StoreError as e:  # the read of the log before planning failed
            raise TenantStoreUnavailable(
                f"Tenants could not be changed: reading {self._sync.store.uri} failed: {e}"
            ) from e


def tenant_of(tenant_id: str, record: object) -> Tenant:
    """The tenant `tenant_id` that `record` holds, held to the admin API's bounds. Raises
    ValueError, KeyError, TypeError or AttributeError."""
    if not isinstance(record, dict):
        raise TypeError(f"a tenant record is a JSON object, not {type(record).__name__}")
    if not re.fullmatch(TENANT_ID_PATTERN, tenant_id):
        raise ValueError(f"tenant id {tenant_id[:80]!r} does not match {TENANT_ID_PATTERN}")
    tenant = Tenant.from_record(record)
    if tenant.id != tenant_id:
        raise ValueError(f"the record's id {str(tenant.id)[:80]!r} is not {tenant_id!r}")
    return tenant


def _logged_tenant(tenant_id: str, record: object) -> Tenant | None:
    try:
        return tenant_of(tenant_id, record)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        # One bad record must not stop every other tenant from loading; its tenant stays out
        # until it is written again through the admin API.
        log.error("tenant record `%s` in the catalog's log is invalid and is skipped: %s",
                  tenant_id[:80], e)  # fmt: skip
        return None
