"""The OpenAI-compatible routes: thin, all work happens in `generation.complete`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from loraplex.server.deps import GatewayDep
from loraplex.server.generation import complete
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.tenancy.deps import TenantDep

router = APIRouter(prefix="/v1")


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    request: Request, body: ChatCompletionRequest, gateway: GatewayDep, tenant: TenantDep
) -> Response:
    return await complete(request, gateway, body, tenant)


@router.post("/completions", response_model=None)
async def completions(
    request: Request, body: CompletionRequest, gateway: GatewayDep, tenant: TenantDep
) -> Response:
    return await complete(request, gateway, body, tenant)


@router.get("/models")
async def list_models(gateway: GatewayDep, tenant: TenantDep) -> dict[str, Any]:
    def model(name: str, parent: str | None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": gateway.created,
                "owned_by": "loraplex", "parent": parent}  # fmt: skip

    adapters = [
        model(name, gateway.base_model) for name in gateway.adapters.names() if tenant.may_use(name)
    ]
    return {"object": "list", "data": [model(gateway.base_model, None), *adapters]}
