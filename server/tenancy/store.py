"""Durable tenants: one JSON record per tenant in the adapter catalog's object store.

Records sit under `tenancy.store_prefix` (`tenants/<id>.json`) beside the catalog, so every replica
pointing at the same bucket or directory sees the same tenants. A record holds key hashes, never
keys. The store has no delete, so a deleted tenant's record becomes a tombstone
(`{"id": ..., "deleted": true}`), which also tells other replicas to drop it.
"""

from __future__ import annotations

import asyncio
import json
import logging

from loraplex.adapters_registry.store import ObjectMissing, ObjectStore
from loraplex.server.tenancy.model import Tenant

log = logging.getLogger(__name__)


class TenantStore:
    def __init__(self, store: ObjectStore, prefix: str) -> None:
        self._store = store
        self._prefix = prefix

    def _key(self, tenant_id: str) -> str:
        return f"{self._prefix}{tenant_id}.json"

    async def load_all(self) -> dict[str, Tenant]:
        """Every live tenant in the store (tombstones skipped). Blocking I/O runs in a thread."""
        return await asyncio.to_thread(self._load_all)

    def _load_all(self) -> dict[str, Tenant]:
        tenants: dict[str, Tenant] = {}
        for key in self._store.list_keys(self._prefix):
            if not key.endswith(".json"):
                continue
            try:
                data = self._store.get_bytes(key)
            except ObjectMissing:
                continue  # deleted between listing and reading
            try:
                tenant = _live_tenant(json.loads(data))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                # One bad record (written by hand, or before a bound existed) must not stop
                # every other tenant from loading; its tenant stays out until it is fixed.
                log.error("tenant record %s is invalid and is skipped: %s", key, e)
                continue
            if tenant is not None:
                tenants[tenant.id] = tenant
        return tenants

    async def save(self, tenant: Tenant) -> None:
        data = json.dumps(tenant.to_record(), sort_keys=True).encode()
        await asyncio.to_thread(self._store.put_bytes, self._key(tenant.id), data)

    async def delete(self, tenant_id: str) -> None:
        data = json.dumps({"id": tenant_id, "deleted": True}).encode()
        await asyncio.to_thread(self._store.put_bytes, self._key(tenant_id), data)


def _live_tenant(record: dict[str, object]) -> Tenant | None:
    """The record's tenant, None for a tombstone; raises ValueError, KeyError or TypeError."""
    return None if record.get("deleted") else Tenant.from_record(record)
