"""`/admin/v1/tenants`: create, list, read, change, rotate keys of, and delete tenants.

Admin token only. Weights and quotas are held to the bounds in `tenancy/settings.py` (a 400
names the field and the bound). A new key is in the response of `POST /tenants` and
`POST /tenants/{id}/keys` and nowhere else, ever: the server keeps only its salted hash.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel, Field

from loraplex.server.tenancy.deps import AdminDep, TenancyDep
from loraplex.server.tenancy.settings import TENANT_ID_PATTERN, Quotas, Weight

router = APIRouter(prefix="/admin/v1/tenants", tags=["admin"])


class CreateTenant(BaseModel):
    model_config = {"extra": "forbid"}

    id: str = Field(pattern=TENANT_ID_PATTERN)
    display_name: str = Field(default="", max_length=200)
    weight: Weight = 1.0
    quotas: Quotas = Field(default_factory=lambda: Quotas())


class UpdateTenant(BaseModel):
    model_config = {"extra": "forbid"}

    display_name: str | None = Field(default=None, max_length=200)
    weight: Weight | None = None
    quotas: Quotas | None = None


class RotateKey(BaseModel):
    model_config = {"extra": "forbid"}

    keep_old: bool = Field(default=False, description="Keep the old keys working (overlap).")


@router.get("")
async def list_tenants(_: AdminDep, tenancy: TenancyDep) -> dict[str, Any]:
    directory = tenancy.directory
    return {
        "object": "list",
        "open_mode": directory.open_mode,
        "data": [t.public_view() for t in directory.tenants()],
    }


@router.post("", status_code=201)
async def create_tenant(body: CreateTenant, _: AdminDep, tenancy: TenancyDep) -> dict[str, Any]:
    tenant, key = await tenancy.directory.create(
        body.id, body.display_name, body.weight, body.quotas
    )
    return {"tenant": tenant.public_view(), "api_key": key}


@router.get("/{tenant_id}")
async def get_tenant(tenant_id: str, _: AdminDep, tenancy: TenancyDep) -> dict[str, Any]:
    return tenancy.directory.get(tenant_id).public_view()


@router.patch("/{tenant_id}")
async def update_tenant(
    tenant_id: str, body: UpdateTenant, _: AdminDep, tenancy: TenancyDep
) -> dict[str, Any]:
    tenant = await tenancy.directory.update(
        tenant_id, display_name=body.display_name, weight=body.weight, quotas=body.quotas
    )
    return tenant.public_view()


@router.post("/{tenant_id}/keys", status_code=201)
async def rotate_key(
    tenant_id: str, body: RotateKey, _: AdminDep, tenancy: TenancyDep
) -> dict[str, Any]:
    tenant, key = await tenancy.directory.rotate_key(tenant_id, keep_old=body.keep_old)
    return {"tenant": tenant.public_view(), "api_key": key}


@router.delete("/{tenant_id}", status_code=204)
async def delete_tenant(tenant_id: str, _: AdminDep, tenancy: TenancyDep) -> Response:
    await tenancy.directory.delete(tenant_id)
    return Response(status_code=204)
