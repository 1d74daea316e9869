"""FastAPI dependencies as `Annotated` aliases: routes declare what they need, nothing more."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from loraplex.server.errors import EngineUnavailable
from loraplex.server.generation import Gateway


def app_resource(request: Request, name: str) -> Any:
    """A resource the app's lifespan put on `app.state`; 503 outside the lifespan (a request
    that reaches the app while it shuts down, or one served without the lifespan run)."""
    resource = getattr(request.app.state, name, None)
    if resource is None:
        raise EngineUnavailable(
            "The server is not serving (it is shutting down or has not started); retry shortly.",
            headers={"Retry-After": "5"},
        )
    return resource


def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = app_resource(request, "gateway")
    return gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
