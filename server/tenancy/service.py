"""Tenancy as the gateway sees it: one object built in the lifespan, used by every /v1 request.

Per request, in order: `authenticate` (401), then the route checks `tenant.may_use(model)` (404
exactly like an unknown model), then `admit` (400 for a request no wait can admit, 429 quota, 503
queue full or shared quota store unreachable, before any response byte; it reserves the
request's n sequences and its prompt + n x max_tokens tokens, in Redis when
`tenancy.quota_store` is set), then `Admitted.turn` waits for the fair engine slot inside the
response (the gateway leases the adapter only then), and `Admitted.generate` streams the
engine's outputs under the tenant's prefix-cache salt, counting tokens into the request's record.
Closing frees the slots and settles the tenant's token quota with the tokens the engine
processed, giving back the rest of the reservation (all of it for a request that failed or left
before the engine).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, cast

from loraplex.server.metrics import GatewayMetrics
from loraplex.server.tenancy.admission import Admission, Entry
from loraplex.server.tenancy.cache_salt import CacheSalts
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.errors import (
    QueueFull,
    QuotaStoreUnavailable,
    RateLimited,
    RequestTooLarge,
    Unauthorized,
)
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.quota_store import SharedQuotas
from loraplex.server.tenancy.quotas import Demand
from loraplex.server.tenancy.record import RequestRecord
from loraplex.server.tenancy.redis_quotas import RedisQuotas
from loraplex.server.tenancy.settings import TenancySettings

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams

    from loraplex.adapters_registry.base import ServableAdapter
    from loraplex.server.engine.client import EngineClient

log = logging.getLogger(__name__)


class Admitted:
    """One admitted request's engine access. `close` exactly once (idempotent) at the end."""

    def __init__(self, entry: Entry, record: RequestRecord | None, cache_salt: str) -> None:
        self._entry = entry
        self._record = record
        self._cache_salt = cache_salt
        self._granted = False

    async def turn(self) -> None:
        """Wait for the fair engine slot (at once if already granted). Cancelled while waiting
        (client gone), the request leaves the queue and never reaches the engine."""
        if self._granted:
            return
        queued_s = await self._entry.wait()
        self._granted = True
        if self._record is not None:
            self._record.queued_s = queued_s

    async def generate(
        self,
        engine: EngineClient,
        prompt_token_ids: list[int] | Mapping[str, Any],
        params: SamplingParams,
        adapter: ServableAdapter | None,
        request_id: str,
        **vllm_kwargs: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Wait for the fair engine slot (`turn`), then stream the engine's outputs (prefix
        cache salted per tenant or sharing group)."""
        await self.turn()
        record = self._record
        if record is not None:
            record.reached_engine = True
        stream = engine.generate(
            prompt_token_ids,
            params,
            adapter,
            request_id,
            priority=self._entry.engine_priority,
            cache_salt=self._cache_salt,
            **vllm_kwargs,
        )
        # The engine's generator aborts its request when closed: close it when we are closed.
        async with aclosing(cast("AsyncGenerator[RequestOutput, None]", stream)) as it:
            async for output in it:
                if record is not None:
                    now = time.monotonic()
                    for out in output.outputs:
                        record.on_tokens(len(out.token_ids), now, out.index)
                yield output

    async def close(self) -> None:
        record = self._record
        await self._entry.close(record.processed_tokens if record is not None else 0)


class Tenancy:
    def __init__(
        self, settings: TenancySettings, directory: TenantDirectory, metrics: GatewayMetrics
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.metrics = metrics
        self.shared_quotas: SharedQuotas | None = None
        if settings.quota_store is not None:
            store = RedisQuotas(
                settings.quota_store.get_secret_value(), settings.quota_store_timeout_s
            )
            self.shared_quotas = SharedQuotas(store, settings.quota_store_failure, metrics)
        self.admission = Admission(settings, shared=self.shared_quotas)
        self.cache_salts = CacheSalts(settings.share_prefix_cache)

    def queue_snapshot(self) -> dict[str, tuple[int, int]]:
        """`{tenant: (queued, running)}` for the queue gauges."""
        d = self.admission.dispatcher
        return {t: (d.queued(t), d.running(t)) for t in d.tenant_ids()}

    def authenticate(self, bearer: str | None, record: RequestRecord | None) -> Tenant:
        try:
            tenant = self.directory.authenticate(bearer)
        except Unauthorized:
            self.metrics.observe_rejection("unknown", "unauthorized")
            raise
        if record is not None:
            record.tenant = tenant.id
        return tenant

    async def admit(
        self,
        tenant: Tenant,
        record: RequestRecord | None,
        *,
        model: str,
        adapter: str | None,
        prompt_tokens: int,
        max_tokens: int,
        n: int = 1,
    ) -> Admitted:
        """Admit one request of `n` choices (raises RequestTooLarge 400 / RateLimited 429 /
        QueueFull or QuotaStoreUnavailable 503): it reserves n sequences and prompt +
        n x max_tokens tokens."""
        if record is not None:
            record.model, record.adapter, record.prompt_tokens = model, adapter, prompt_tokens
        try:
            entry = await self.admission.enter(tenant, Demand(prompt_tokens, n, max_tokens))
        except (RequestTooLarge, RateLimited, QueueFull, QuotaStoreUnavailable) as e:
            self.metrics.observe_rejection(tenant.id, e.reason)
            raise
        return Admitted(entry, record, self.cache_salts.of(tenant.id))

    @contextlib.asynccontextmanager
    async def sharing_quotas(self) -> AsyncIterator[None]:
        """Keep the shared quota store's leases and connections for the server's life (nothing
        to do without `tenancy.quota_store`)."""
        if self.shared_quotas is None:
            yield
            return
        log.info(
            "tenant quotas are shared through %s (quota_store_failure=%s)",
            self.shared_quotas.store.address, self.settings.quota_store_failure,
        )  # fmt: skip
        async with self.shared_quotas.running():
            yield
