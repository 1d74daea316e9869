"""Liveness (`/health`: is the engine alive) and readiness (`/ready`: can requests be served)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None:  # still starting: alive, not ready
        return JSONResponse({"status": "starting"})
    if not gateway.engine.healthy:
        return JSONResponse({"status": "engine_dead"}, status_code=503)
    return JSONResponse(
        {
            "status": "ok",
            "engine": {"unfinished_requests": gateway.engine.unfinished_requests()},
            "dispatcher": gateway.tenancy.admission.dispatcher.totals(),
        }
    )


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None or not gateway.engine.healthy:
        return JSONResponse({"status": "not_ready"}, status_code=503)
    return JSONResponse({"status": "ready", "model": gateway.base_model})
