"""Who is who: tenants from the config file and the durable store, and the keys that name them.

`authenticate` maps a bearer key to its tenant. While no tenant anywhere has a key, the server is in
open mode: every request belongs to the open tenant `default` (the embedded default's single-user
setup). The admin token is never a tenant key, in either mode. Once keys exist, deleting the last
tenant that has one is refused: it would open /v1 to everyone without a word.

The stored tenants are the store's (`store.py`: the catalog's log, which the registry's poll
follows); the directory indexes them again whenever they changed. Each admin change is planned on
the log's current state and planned again if another replica wrote first, so it never undoes
another replica's change, and the last-key check holds across replicas: of two replicas deleting
the last two keyed tenants at once, the second is refused.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from pydantic import SecretStr

from loraplex.server.tenancy.errors import TenantConflict, TenantNotFound, Unauthorized
from loraplex.server.tenancy.keys import HashedKey, lookup_id, new_key, same_secret
from loraplex.server.tenancy.model import Tenant, TenantSource, open_default_tenant
from loraplex.server.tenancy.settings import Quotas, TenancySettings, TenantConfig
from loraplex.server.tenancy.store import TenantStore

log = logging.getLogger(__name__)


class TenantDirectory:
    def __init__(
        self,
        settings: TenancySettings,
        store: TenantStore | None,
        admin_token: SecretStr | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._admin_token = admin_token.get_secret_value() if admin_token else None
        self._store = store
        self._clock = clock
        self._config = {t.id: self._from_config(t) for t in settings.tenants}
        self._stored: dict[str, Tenant] = {}
        self._read_store = False  # whether the store's tenants were indexed yet
        self._by_lookup: dict[str, list[tuple[HashedKey, str]]] = {}
        self._default = open_default_tenant()
        self._reindex()

    def _from_config(self, t: TenantConfig) -> Tenant:
        for i, key in enumerate(t.api_keys):
            if self._admin_token and same_secret(key.get_secret_value(), self._admin_token):
                raise ValueError(
                    f"tenancy.tenants[{t.id}].api_keys[{i}] equals http.admin_token; "
                    "a tenant key cannot be the admin token"
                )
        return Tenant(
            id=t.id,
            display_name=t.display_name or t.id,
            weight=t.weight,
            quotas=t.quotas,
            source=TenantSource.CONFIG,
            keys=tuple(HashedKey.of(k.get_secret_value()) for k in t.api_keys),
        )

    def _fresh(self) -> None:
        """Index the store's tenants again if they changed since the last look."""
        if self._store is None or (stored := self._store.tenants()) is self._stored:
            return
        for tid in sorted(stored.keys() & self._config.keys()):
            log.warning("tenant %s is in both the config file and the store; config wins", tid)
        was_open = self._read_store and not self._by_lookup
        self._stored, self._read_store = stored, True
        self._reindex()
        if was_open and self._by_lookup:
            log.warning("tenancy: the first API key exists; open mode is off, /v1 needs keys")

    def _merged(self) -> dict[str, Tenant]:
        return {**self._stored, **self._config}

    def _reindex(self) -> None:
        index: dict[str, list[tuple[HashedKey, str]]] = {}
        for tenant in self._merged().values():
            for key in tenant.keys:
                index.setdefault(key.lookup_id, []).append((key, tenant.id))
        self._by_lookup = index

    @property
    def open_mode(self) -> bool:
        self._fresh()
        return not self._by_lookup

    def tenants(self) -> list[Tenant]:
        """Configured and stored tenants (config wins on an id clash), sorted by id."""
        self._fresh()
        merged = self._merged()
        return [merged[i] for i in sorted(merged)]

    def describe_mode(self) -> str:
        if self.open_mode:
            return (
                "tenancy: no API keys configured; every request is served as the open tenant "
                f"`{self._default.id}` without authentication"
            )
        return f"tenancy: {len(self.tenants())} tenants, API keys required on /v1"

    async def start(self) -> None:
        """Bring the previous release's stored tenants into the store, once per store
        (`TenantStore.import_legacy`), and say which mode the server is in."""
        if self._store is not None:
            await self._store.import_legacy()
        log.info(self.describe_mode())

    @property
    def admin_enabled(self) -> bool:
        return self._admin_token is not None

    def is_admin(self, bearer: str | None) -> bool:
        return bool(bearer and self._admin_token and same_secret(bearer, self._admin_token))

    def authenticate(self, bearer: str | None) -> Tenant:
        """The tenant a /v1 request belongs to; raises Unauthorized (401)."""
        if self.is_admin(bearer):
            raise Unauthorized("The admin token cannot be used as an API key.")
        if self.open_mode:
            return self._default
        if not bearer:
            raise Unauthorized("Missing API key: send `Authorization: Bearer <key>`.")
        for key, tenant_id in self._by_lookup.get(lookup_id(bearer), ()):
            if key.matches(bearer):
                tenant = self._config.get(tenant_id) or self._stored.get(tenant_id)
                if tenant is not None:
                    return tenant
        raise Unauthorized("Incorrect API key provided.")

    def get(self, tenant_id: str) -> Tenant:
        self._fresh()
        tenant = self._config.get(tenant_id) or self._stored.get(tenant_id)
        if tenant is None:
            raise TenantNotFound(f"No tenant `{tenant_id}`.", param="id")
        return tenant

    def _stored_only(self, tenant_id: str) -> Tenant:
        """The stored tenant `tenant_id` as of the store's current state (raises 409 for a
        config-file tenant, 404 for none)."""
        self._fresh()
        if tenant_id in self._config:
            raise TenantConflict(
                f"Tenant `{tenant_id}` is defined in the config file; change it there.", param="id"
            )
        tenant = self._stored.get(tenant_id)
        if tenant is None:
            raise TenantNotFound(f"No tenant `{tenant_id}`.", param="id")
        return tenant

    def _writable(self) -> TenantStore:
        if self._store is None:
            raise RuntimeError("this tenant directory has no store to change tenants in")
        return self._store

    async def create(
        self, tenant_id: str, display_name: str, weight: float, quotas: Quotas
    ) -> tuple[Tenant, str]:
        """A new stored tenant and its first key (returned once, kept only as a hash)."""
        key = new_key()

        def plan() -> Tenant:
            self._fresh()
            if tenant_id in self._config or tenant_id in self._stored:
                raise TenantConflict(f"Tenant `{tenant_id}` already exists.", param="id")
            return Tenant(
                id=tenant_id,
                display_name=display_name or tenant_id,
                weight=weight,
                quotas=quotas,
                source=TenantSource.STORE,
                keys=(HashedKey.of(key),),
                created_at=self._clock(),
            )

        return await self._writable().put(plan), key

    async def update(
        self,
        tenant_id: str,
        *,
        display_name: str | None = None,
        weight: float | None = None,
        quotas: Quotas | None = None,
    ) -> Tenant:
        def plan() -> Tenant:
            old = self._stored_only(tenant_id)
            return replace(
                old,
                display_name=old.display_name if display_name is None else display_name,
                weight=old.weight if weight is None else weight,
                quotas=old.quotas if quotas is None else quotas,
            )

        return await self._writable().put(plan)

    async def rotate_key(self, tenant_id: str, *, keep_old: bool = False) -> tuple[Tenant, str]:
        """A new key for the tenant; the old ones stop working unless `keep_old`."""
        key = new_key()
        hashed = HashedKey.of(key)

        def plan() -> Tenant:
            old = self._stored_only(tenant_id)
            return replace(old, keys=(*old.keys, hashed) if keep_old else (hashed,))

        return await self._writable().put(plan), key

    async def delete(self, tenant_id: str) -> None:
        def plan() -> str:
            tenant = self._stored_only(tenant_id)
            if tenant.keys and not any(t.keys for t in self.tenants() if t.id != tenant_id):
                raise TenantConflict(
                    f"Deleting `{tenant_id}` would leave no API key anywhere and turn open mode "
                    "on: every /v1 request would be served without authentication. Create "
                    "another tenant first.",
                    param="id",
                )
            return tenant_id

        await self._writable().delete(plan)
