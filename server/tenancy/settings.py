"""Configuration of tenants, quotas and fair dispatch: the `tenancy` section of the settings.

Tenants defined here are fixed for the life of the process; tenants created through
`/admin/v1/tenants` live in the adapter catalog's durable log (`store.py`). Keys written in the
config file are `SecretStr`s (masked in reprs, logs and config errors); the tenant directory
matches requests against their hashes, while the loaded settings keep the plain keys in memory
for the life of the process, as the file keeps them on disk.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator

# Lower-case ASCII only, so `Acme` and a Cyrillic `аcme` can never alias the tenant `acme`.
TENANT_ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
DEFAULT_TENANT_ID = "default"
TenantId = Annotated[str, Field(pattern=TENANT_ID_PATTERN)]
GroupName = Annotated[str, Field(pattern=TENANT_ID_PATTERN)]

# Weights are relative shares: 1:10^6 between the lightest and the heaviest tenant is beyond any
# tiering, and keeps the fair queue's arithmetic (finish tags of cost / weight, the weighted
# division of slots) far inside float64's 2^-52 relative precision. Beside weight 1, a weight of
# 1e-17 vanished from a sum (1.0 + 1e-17 == 1.0) and the slot division divided by zero.
MIN_WEIGHT = 0.001
MAX_WEIGHT = 1000.0
Weight = Annotated[float, Field(ge=MIN_WEIGHT, le=MAX_WEIGHT, allow_inf_nan=False)]

# Quota bounds: far above what a whole fleet serves one tenant (an H200 decodes on the order of
# 10^4-10^5 tokens/s, a few million tokens a minute), and below 2^53, so the float64 token
# buckets count every unit exactly. 10**400 tokens a minute overflowed the bucket's float.
MAX_CONCURRENT_LIMIT = 1_000_000
MAX_REQUESTS_PER_MINUTE = 100_000_000
MAX_TOKENS_PER_MINUTE = 10_000_000_000

QUOTA_STORE_SCHEMES = ("redis", "rediss", "unix")


class Quotas(BaseModel):
    """Per-tenant limits; 0 means unlimited. Exceeding one answers 429 with Retry-After.

    A request with `n` choices counts as `n` requests (sequences) against `max_concurrent` and
    `requests_per_minute`, and reserves prompt + n x max_tokens against `tokens_per_minute` at
    admission; what it did not use is given back when it ends.
    """

    model_config = {"extra": "forbid"}  # a misspelt key is an error, not a default

    max_concurrent: int = Field(
        default=0,
        ge=0,
        le=MAX_CONCURRENT_LIMIT,
        description="Sequences of the tenant in flight at once (a request counts its `n`).",
    )
    requests_per_minute: int = Field(
        default=0,
        ge=0,
        le=MAX_REQUESTS_PER_MINUTE,
        description="Sequences admitted per minute (a request counts its `n`).",
    )
    tokens_per_minute: int = Field(
        default=0,
        ge=0,
        le=MAX_TOKENS_PER_MINUTE,
        description="Prompt plus generated tokens per minute: prompt + n x max_tokens reserved "
        "at admission, the unused part given back at the end.",
    )

    @property
    def limited(self) -> bool:
        """Whether any limit is set."""
        return bool(self.max_concurrent or self.requests_per_minute or self.tokens_per_minute)


class TenantConfig(BaseModel):
    """A tenant as written in the config file."""

    model_config = {"extra": "forbid"}

    id: str = Field(pattern=TENANT_ID_PATTERN, description="Stable id; the adapter namespace.")
    display_name: str = Field(default="", max_length=200)
    api_keys: list[SecretStr] = Field(default_factory=list, description="Plain keys (hashed).")
    weight: Weight = Field(default=1.0, description="Fair-share weight.")
    quotas: Quotas = Field(default_factory=lambda: Quotas())

    @field_validator("api_keys")
    @classmethod
    def _keys_long_enough(cls, keys: list[SecretStr]) -> list[SecretStr]:
        for i, key in enumerate(keys):
            if len(key.get_secret_value()) < 16:
                raise ValueError(f"api_keys[{i}] must be at least 16 characters")
        return keys


class TenancySettings(BaseModel):
    model_config = {"extra": "forbid"}  # a misspelt key is an error, not a default
    tenants: list[TenantConfig] = Field(
        default_factory=list,
        description="Tenants from the config file. With none (and none in the store), one open "
        "tenant `default` serves every request without a key.",
    )
    store_prefix: str = Field(
        default="tenants/",
        description="Where the previous release kept one record per tenant in the adapter "
        "catalog's object store (`<prefix><id>.json`); a start imports them into the catalog's "
        "log while it holds no tenants.",
    )
    # Bounds: no engine batches more than a few thousand sequences (vLLM's max_num_seqs is 256
    # to 1,024 on GPUs), and a million waiting requests is more than one process should hold.
    max_running: int = Field(
        default=16,
        ge=1,
        le=65_536,
        description="Sequences dispatched to the engine at once (a request counts its `n`); the "
        "rest wait in fair queues. Small values keep a flooding tenant's batch from slowing "
        "everyone's prefill. A request with more choices than this is refused (400).",
    )
    max_queued: int = Field(
        default=256,
        ge=0,
        le=1_000_000,
        description="Requests waiting across all tenants; one more answers 503.",
    )
    # The window is also how far back a tenant's peak load reaches, and the peak + 1 is what is
    # reserved for it. On the CPU fairness bench (B Poisson at 0.25 req/s beside an 8x flood,
    # 300 s) a 10 s window let B's bursts outgrow its reservation: 9 of 91 of B's requests waited
    # 0.45-1.3 s for a slot, p90 TTFT 1.61x alone. With 60 s: queue p90 1 ms, 1.36x, for A's
    # throughput going from 34.6 to 31.3 output tok/s.
    active_window_s: float = Field(
        default=60.0,
        gt=0.0,
        le=86_400.0,  # a day: past that a tenant's reservation outlives any burst it describes
        description="A tenant seen within this many seconds keeps its share of `max_running` "
        "reserved (its peak load in the window, plus one), so its next request need not wait "
        "behind another tenant's backlog.",
    )
    engine_priority: bool = Field(
        default=True,
        description="Give the engine each request's priority: 0 for a tenant whose requests fit "
        "its share, 1 + its requests in the engine for one backlogged beside other tenants. A "
        "light tenant's prefill is then scheduled first, and a backlogged tenant's prefills are "
        "paced (engine.paced_prefill_tokens). False: vLLM's first come, first served.",
    )
    share_prefix_cache: dict[GroupName, list[TenantId]] = Field(
        default_factory=dict,
        description="Groups of tenants that share vLLM's prefix cache, `{group: [tenant ids]}` "
        "(tenants of the config file or the store). Every other tenant's requests carry a cache "
        "salt of their own, so a prompt that matches another tenant's never reuses its cached "
        "blocks, whose quicker first token would tell that the other tenant sent it.",
    )
    quota_store: SecretStr | None = Field(
        default=None,
        description="redis://[:password@]host:port/db (or rediss://, unix://path): every replica "
        "keeps each tenant's quotas (both rates and max_concurrent) in this Redis, so the limits "
        "hold across the fleet. Unset: each process counts its own quotas, and N replicas grant "
        "up to N times each limit. A secret: the URL may carry a password.",
    )
    quota_store_failure: Literal["open", "closed"] = Field(
        default="open",
        description="While the quota store is unreachable: `open` admits on this replica's own "
        "quotas (as without a store: each replica enforces the full limits), `closed` refuses "
        "every request 503 with Retry-After.",
    )
    # A script's round trip on loopback is ~0.1 ms and a few ms across a data centre; 0.25 s is
    # far above both and still below a person's notice, and is the most one request waits on a
    # hung Redis (the others are decided without it until the next probe, a second later).
    quota_store_timeout_s: float = Field(
        default=0.25,
        ge=0.005,
        le=5.0,
        description="Seconds one call to the quota store may take, connecting included; slower "
        "counts as unreachable.",
    )
    adapter_label_top_k: int = Field(
        default=20,
        ge=0,
        le=1000,
        description="Adapters that get their own metrics label (the first K seen); others are "
        "`other`. 0 removes the adapter label from every metric.",
    )

    @field_validator("store_prefix")
    @classmethod
    def _prefix_shape(cls, prefix: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_./-]*/", prefix) or ".." in prefix:
            raise ValueError("store_prefix must be a relative path ending in '/' without '..'")
        return prefix

    @field_validator("quota_store")
    @classmethod
    def _quota_store_url(cls, url: SecretStr | None) -> SecretStr | None:
        if url is None:
            return None
        parts = urlsplit(url.get_secret_value())
        if parts.scheme not in QUOTA_STORE_SCHEMES:
            raise ValueError(
                f"quota_store must be a URL of scheme {', '.join(QUOTA_STORE_SCHEMES)}"
            )
        parts.port  # noqa: B018 - raises ValueError naming a port that is not a number
        if parts.scheme != "unix" and not parts.hostname:
            raise ValueError("quota_store must name a host: redis://host:6379/0")
        if parts.scheme == "unix" and not parts.path:
            raise ValueError("quota_store must name a socket path: unix:///run/redis.sock")
        return url

    @field_validator("share_prefix_cache")
    @classmethod
    def _groups_apart(cls, groups: dict[str, list[str]]) -> dict[str, list[str]]:
        group_of: dict[str, str] = {}
        for name, members in groups.items():
            if len(set(members)) < 2:
                raise ValueError(f"group {name!r} must name at least two tenants to share with")
            for tenant_id in members:
                other = group_of.setdefault(tenant_id, name)
                if other != name:
                    raise ValueError(
                        f"tenant {tenant_id!r} is in groups {other!r} and {name!r}; a tenant "
                        "shares its prefix cache with one group at most"
                    )
        return groups

    @model_validator(mode="after")
    def _unique(self) -> TenancySettings:
        ids = [t.id for t in self.tenants]
        dup_ids = sorted({i for i in ids if ids.count(i) > 1})
        if dup_ids:
            raise ValueError(f"tenancy.tenants: duplicate tenant ids {dup_ids}")
        keys = [k.get_secret_value() for t in self.tenants for k in t.api_keys]
        if len(keys) != len(set(keys)):
            raise ValueError("tenancy.tenants: the same api key is given to two tenants")
        return self
