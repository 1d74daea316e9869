"""Admin REST for adapters under /admin/v1/adapters, behind the admin token.

    POST   /admin/v1/adapters                    register {name, source, warm?, pinned?} -> 201
    GET    /admin/v1/adapters                    list
    GET    /admin/v1/adapters/{name}             get (names may hold one '/': tenant/adapter)
    DELETE /admin/v1/adapters/{name}             unregister (in-flight requests finish first)
    POST   /admin/v1/adapters/{name}/pin         keep in a GPU slot (also /unpin)
    POST   /admin/v1/adapters/{name}/evict       {tier: cpu|disk} drop from that tier and above
    POST   /admin/v1/adapters/{name}/rollback    {version?} back to the previous (or a given) one
    POST   /admin/v1/adapters/{name}/quarantine  {reason, version?} out of service, every replica
    POST   /admin/v1/adapters/{name}/unquarantine {version?} serving again (default: current)

Registry errors (`AdapterError`) become the OpenAI error envelope in the app's one handler.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field

from loraplex.adapters_registry.admin import AdapterInfo, EvictTier, ManagedRegistry
from loraplex.adapters_registry.quarantine import MAX_REASON_CHARS
from loraplex.server.deps import app_resource
from loraplex.server.tenancy.deps import AdminDep


def _registry(request: Request, _: AdminDep) -> ManagedRegistry:
    """The registry, for the admin token only (the same check as /admin/v1/tenants)."""
    registry: ManagedRegistry = app_resource(request, "adapter_registry")
    return registry


RegistryDep = Annotated[ManagedRegistry, Depends(_registry)]
router = APIRouter(prefix="/admin/v1/adapters", tags=["admin"])


class RegisterRequest(BaseModel):
    model_config = {"extra": "forbid"}  # `{"pin": true}` is an error, not an unpinned adapter

    name: str = Field(description="Adapter name, `adapter` or `tenant/adapter`.")
    source: str = Field(
        max_length=4096,
        description="s3://bucket/prefix/, hf://org/name[@revision][/folder] or a local directory.",
    )  # PATH_MAX is 4096; S3 keys are at most 1024 bytes
    warm: bool = Field(default=False, description="Load it into the engine's CPU cache now.")
    pinned: bool = Field(default=False, description="Keep it in a GPU slot.")


class EvictRequest(BaseModel):
    model_config = {"extra": "forbid"}

    tier: EvictTier = Field(description="cpu: drop from the engine; disk: also from local disk.")


class RollbackRequest(BaseModel):
    model_config = {"extra": "forbid"}

    version: str | None = Field(default=None, description="Version (or prefix); default previous.")


class QuarantineRequest(BaseModel):
    model_config = {"extra": "forbid"}

    reason: str = Field(
        min_length=1, max_length=MAX_REASON_CHARS, description="Why, shown to its requests."
    )
    version: str | None = Field(default=None, description="Version (or prefix); default current.")


class UnquarantineRequest(BaseModel):
    model_config = {"extra": "forbid"}

    version: str | None = Field(default=None, description="Version (or prefix); default current.")


def _out(info: AdapterInfo) -> dict[str, Any]:
    return {"object": "adapter", **asdict(info)}


@router.post("", status_code=201)
async def register(body: RegisterRequest, registry: RegistryDep) -> dict[str, Any]:
    info = await registry.register(body.name, body.source, warm=body.warm, pinned=body.pinned)
    return _out(info)


@router.get("")
async def list_adapters(registry: RegistryDep) -> dict[str, Any]:
    return {"object": "list", "data": [_out(i) for i in registry.list()]}


@router.post("/{name:path}/pin")
async def pin(name: str, registry: RegistryDep) -> dict[str, Any]:
    return _out(await registry.set_pinned(name, True))


@router.post("/{name:path}/unpin")
async def unpin(name: str, registry: RegistryDep) -> dict[str, Any]:
    return _out(await registry.set_pinned(name, False))


@router.post("/{name:path}/evict")
async def evict(name: str, body: EvictRequest, registry: RegistryDep) -> dict[str, Any]:
    return _out(await registry.evict(name, body.tier))


@router.post("/{name:path}/rollback")
async def rollback(
    name: str, registry: RegistryDep, body: RollbackRequest | None = None
) -> dict[str, Any]:
    return _out(await registry.rollback(name, body.version if body else None))


@router.post("/{name:path}/quarantine")
async def quarantine(name: str, body: QuarantineRequest, registry: RegistryDep) -> dict[str, Any]:
    info = await registry.set_quarantined(name, True, version=body.version, reason=body.reason)
    return _out(info)


@router.post("/{name:path}/unquarantine")
async def unquarantine(
    name: str, registry: RegistryDep, body: UnquarantineRequest | None = None
) -> dict[str, Any]:
    version = body.version if body else None
    return _out(await registry.set_quarantined(name, False, version=version))


@router.get("/{name:path}")
async def get_adapter(name: str, registry: RegistryDep) -> dict[str, Any]:
    return _out(registry.info(name))


@router.delete("/{name:path}")
async def delete(name: str, registry: RegistryDep) -> dict[str, Any]:
    await registry.delete(name)
    return {"object": "adapter.deleted", "name": name, "deleted": True}
