"""FastAPI dependencies: `TenantDep` for /v1 routes, `AdminDep` for /admin/v1 routes."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from loraplex.server.access_log import record_of
from loraplex.server.deps import app_resource
from loraplex.server.errors import NotFound
from loraplex.server.tenancy.errors import Unauthorized
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.service import Tenancy


def bearer_of(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def get_tenancy(request: Request) -> Tenancy:
    tenancy: Tenancy = app_resource(request, "tenancy")
    return tenancy


TenancyDep = Annotated[Tenancy, Depends(get_tenancy)]


def current_tenant(request: Request, tenancy: TenancyDep) -> Tenant:
    """The calling tenant (401 for no key, a wrong key, or the admin token)."""
    return tenancy.authenticate(bearer_of(request), record_of(request))


def require_admin(request: Request, tenancy: TenancyDep) -> None:
    """Only the admin token passes (401 otherwise: tenant keys included); unset: 404."""
    if not tenancy.directory.admin_enabled:
        raise NotFound("The admin API is disabled: set http.admin_token to enable it.")
    if not tenancy.directory.is_admin(bearer_of(request)):
        raise Unauthorized("The admin API needs the admin token (http.admin_token).")


TenantDep = Annotated[Tenant, Depends(current_tenant)]
AdminDep = Annotated[None, Depends(require_admin)]
