"""The fleet bench's tenants: seeding them, the changes a writer makes, and how a replica sees them.

Each replica (`bench.registry.fleet_replica`) follows the tenants as the server does
(`following_tenants`: this tree's tenant directory on the registry's catalog). The tenants are
seeded one record per tenant at `tenants/<id>.json` (`seed_tenants`), as the tenancy store kept
them before they moved into the catalog's log: followers of a tree from before read them there,
and this tree's first replica (the tenant writer, started first) imports them into the log. A
writer replica makes change k through the admin API's calls (`change_tenant`), and
every follower reports when it sees change k (`tenant_change_seen`). Five changes per probe
tenant `probe-<k // 5>`, in this order: create it, set its weight, set its quotas, add a key,
delete it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.store import ObjectStore
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.keys import HashedKey, new_key
from loraplex.server.tenancy.model import Tenant, TenantSource
from loraplex.server.tenancy.settings import Quotas, TenancySettings
from loraplex.server.tenancy.store import TenantStore

LEGACY_PREFIX = "tenants/"
CHANGES_PER_PROBE = 5
PROBE_WEIGHT = 2.0
PROBE_REQUESTS_PER_MINUTE = 600
SEED_WRITERS = 16


def seed_tenants(store: ObjectStore, count: int) -> None:
    """`count` keyed tenants `tenant-<i>`, one record each at `tenants/<id>.json`."""

    def write(i: int) -> None:
        tenant = Tenant(
            id=f"tenant-{i:05d}", display_name=f"Tenant {i}", weight=1.0,
            quotas=Quotas(requests_per_minute=1_000), source=TenantSource.STORE,
            keys=(HashedKey.of(new_key()),), created_at=0.0,
        )  # fmt: skip
        data = json.dumps(tenant.to_record(), sort_keys=True).encode()
        store.put_bytes(f"{LEGACY_PREFIX}{tenant.id}.json", data)

    with ThreadPoolExecutor(SEED_WRITERS) as pool:
        list(pool.map(write, range(count)))


@contextlib.asynccontextmanager
async def following_tenants(registry: ManagedRegistry) -> AsyncIterator[TenantDirectory]:
    """This tree's tenant directory on the registry's catalog, as the server's lifespan builds
    it (`server/app.py`), with no tenants in a config file and no admin token. The registry's
    poll brings other replicas' changes."""
    settings = TenancySettings()
    directory = TenantDirectory(settings, TenantStore(registry.sync, settings.store_prefix), None)
    await directory.start()
    yield directory


def probe_tenant(k: int) -> str:
    return f"probe-{k // CHANGES_PER_PROBE:04d}"


async def change_tenant(directory: TenantDirectory, k: int) -> None:
    """Change k (see the module docstring), through the calls `/admin/v1/tenants` makes."""
    tenant_id = probe_tenant(k)
    match k % CHANGES_PER_PROBE:
        case 0:
            await directory.create(tenant_id, "", 1.0, Quotas())
        case 1:
            await directory.update(tenant_id, weight=PROBE_WEIGHT)
        case 2:
            await directory.update(
                tenant_id, quotas=Quotas(requests_per_minute=PROBE_REQUESTS_PER_MINUTE)
            )
        case 3:
            await directory.rotate_key(tenant_id, keep_old=True)
        case _:
            await directory.delete(tenant_id)


def tenant_change_seen(directory: TenantDirectory, k: int) -> bool:
    """Whether this replica's directory shows change k (given that it showed change k - 1)."""
    tenant_id = probe_tenant(k)
    tenant = next((t for t in directory.tenants() if t.id == tenant_id), None)
    match k % CHANGES_PER_PROBE:
        case 0:
            return tenant is not None
        case 1:
            return tenant is not None and tenant.weight == PROBE_WEIGHT
        case 2:
            return (
                tenant is not None
                and tenant.quotas.requests_per_minute == PROBE_REQUESTS_PER_MINUTE
            )
        case 3:
            return tenant is not None and len(tenant.keys) == 2
        case _:
            return tenant is None
