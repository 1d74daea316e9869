"""A tenant: who is calling, what it may use, how much of the server it may take.

Adapters belong to a tenant by namespace: `acme/support-bot` is `acme`'s. A tenant may use its own
namespace and the operator's shared adapters (names without a namespace); any other name is
answered exactly like a name that does not exist, so nothing about other tenants leaks.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter

from loraplex.server.tenancy.keys import HashedKey
from loraplex.server.tenancy.settings import DEFAULT_TENANT_ID, Quotas, Weight

# What may follow `tenant/`: ASCII, no second `/`, optionally `@version`. Anything else (path
# tricks, look-alike characters) is simply not the tenant's, hence "not found".
_ADAPTER_PART = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}(@[A-Za-z0-9._-]{1,128})?")
_WEIGHT = TypeAdapter(Weight)


class TenantSource(enum.Enum):
    """Where a tenant is defined; only STORE tenants can be changed through the admin API."""

    DEFAULT = "default"
    CONFIG = "config"
    STORE = "store"


@dataclass(frozen=True)
class Tenant:
    id: str
    display_name: str
    weight: float
    quotas: Quotas
    source: TenantSource
    keys: tuple[HashedKey, ...] = field(default=(), repr=False)
    created_at: float = 0.0

    @property
    def is_open_default(self) -> bool:
        return self.source is TenantSource.DEFAULT

    def may_use(self, adapter: str, *, share_global: bool = True) -> bool:
        """Whether this tenant may name `adapter` (an adapter name, not the base model)."""
        if self.is_open_default:
            return True
        namespace, slash, rest = adapter.partition("/")
        if not slash:
            return share_global and _ADAPTER_PART.fullmatch(adapter) is not None
        return (
            namespace == self.id and _ADAPTER_PART.fullmatch(rest) is not None and ".." not in rest
        )

    def public_view(self) -> dict[str, Any]:
        """What the admin API shows: never a key or its hash, only each key's short id."""
        return {
            "id": self.id,
            "display_name": self.display_name,
            "weight": self.weight,
            "quotas": self.quotas.model_dump(),
            "source": self.source.value,
            "key_ids": [k.key_id for k in self.keys],
            "created_at": self.created_at,
        }

    def to_record(self) -> dict[str, Any]:
        """The durable form (hashes, never keys)."""
        return {
            "id": self.id,
            "display_name": self.display_name,
            "weight": self.weight,
            "quotas": self.quotas.model_dump(),
            "keys": [k.to_json() for k in self.keys],
            "created_at": self.created_at,
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Tenant:
        """A stored tenant, its weight and quotas held to the bounds the admin API checks
        (raises ValueError: a record written by hand or before a bound existed)."""
        return cls(
            id=data["id"],
            display_name=data.get("display_name", ""),
            weight=_WEIGHT.validate_python(data.get("weight", 1.0)),
            quotas=Quotas.model_validate(data.get("quotas", {})),
            source=TenantSource.STORE,
            keys=tuple(HashedKey.from_json(k) for k in data.get("keys", [])),
            created_at=float(data.get("created_at", 0.0)),
        )


def open_default_tenant() -> Tenant:
    """The tenant every keyless request gets when no tenant has a key (the embedded default)."""
    return Tenant(
        id=DEFAULT_TENANT_ID,
        display_name="open default tenant",
        weight=1.0,
        quotas=Quotas(),
        source=TenantSource.DEFAULT,
    )
