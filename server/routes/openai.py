"""The OpenAI-compatible routes, and vLLM's /tokenize, /detokenize and /version: thin, all work
happens in `generation` and vLLM's serving objects. Every route needs the tenant's key.

Bodies are parsed by `request_body` (large ones in worker processes), not by FastAPI, which
would parse them on the event loop; the OpenAPI document still describes them.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from loraplex.adapters_registry.base import ErrorKind
from loraplex.server.deps import GatewayDep, app_resource
from loraplex.server.errors import ApiError
from loraplex.server.generation import complete, tokenization
from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from loraplex.server.tenancy.deps import TenantDep

router = APIRouter(prefix="/v1")
# vLLM serves these outside /v1; its clients call them there.
vllm_router = APIRouter()

M = TypeVar("M", bound=BaseModel)


class ClientClosedRequest(ApiError):
    """The client left before its body arrived: nobody reads the answer, the access log does."""

    kind = ErrorKind.CLIENT_CLOSED  # as generation records a client that left
    code = "client_closed_request"


def _json_body(model: type[M]) -> Any:
    """A dependency: the request's body as `model`. It depends on the tenant, so a request
    without a valid key is refused before its body is parsed."""

    async def parse(request: Request, gateway: GatewayDep, _: TenantDep) -> M:
        parser = app_resource(request, "body_parser")
        try:
            raw = await request.body()
        except ClientDisconnect as e:
            raise ClientClosedRequest("The client closed the connection.") from e
        return await parser.parse(
            raw,
            request.headers.get("content-type"),
            model,
            max_prompt_tokens=gateway.engine.max_model_len,
        )

    return Depends(parse)


def _inline_refs(schema: Any, defs: dict[str, Any]) -> Any:
    """`schema` with each `{"$ref": "#/$defs/X"}` replaced by X (the models are not recursive)."""
    if isinstance(schema, dict):
        if (ref := schema.get("$ref", "")).startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in schema.items() if k != "$defs"}
    if isinstance(schema, list):
        return [_inline_refs(v, defs) for v in schema]
    return schema


def _documented_body(model: type[BaseModel]) -> dict[str, Any]:
    """The route's OpenAPI `requestBody`, as FastAPI would have written it for `model`."""
    schema = model.model_json_schema()
    inlined = _inline_refs(schema, schema.get("$defs", {}))
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inlined}}}}


ChatBody = Annotated[ChatCompletionRequest, _json_body(ChatCompletionRequest)]
CompletionBody = Annotated[CompletionRequest, _json_body(CompletionRequest)]
TokenizeBody = Annotated[TokenizeRequest, _json_body(TokenizeRequest)]
DetokenizeBody = Annotated[DetokenizeRequest, _json_body(DetokenizeRequest)]


@router.post(
    "/chat/completions", response_model=None, openapi_extra=_documented_body(ChatCompletionRequest)
)
async def chat_completions(
    request: Request, gateway: GatewayDep, tenant: TenantDep, body: ChatBody
) -> Response:
    return await complete(request, gateway, body, tenant)


@router.post("/completions", response_model=None, openapi_extra=_documented_body(CompletionRequest))
async def completions(
    request: Request, gateway: GatewayDep, tenant: TenantDep, body: CompletionBody
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


@vllm_router.post("/tokenize", response_model=None, openapi_extra=_documented_body(TokenizeRequest))
async def tokenize(gateway: GatewayDep, tenant: TenantDep, body: TokenizeBody) -> Response:
    return await tokenization(gateway, body, tenant)


@vllm_router.post(
    "/detokenize", response_model=None, openapi_extra=_documented_body(DetokenizeRequest)
)
async def detokenize(gateway: GatewayDep, tenant: TenantDep, body: DetokenizeBody) -> Response:
    return await tokenization(gateway, body, tenant)


@vllm_router.get("/version")
async def version(_: TenantDep) -> dict[str, str]:
    import vllm

    return {"version": str(vllm.__version__)}
