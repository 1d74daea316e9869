"""FastAPI dependencies as `Annotated` aliases: routes declare what they need, nothing more."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from loraplex.server.errors import EngineUnavailable
from loraplex.server.generation import Gateway


def get_gateway(request: Request) -> Gateway:
    gateway: Gateway | None = getattr(request.app.state, "gateway", None)
    if gateway is None:
        raise EngineUnavailable(
            "The server is starting; retry shortly.", headers={"Retry-After": "5"}
        )
    return gateway


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
