"""Liveness (`/health`: is the engine alive) and readiness (`/ready`: can requests be served;
not while draining, server/drain.py, when `/health` stays 200).

The port opens only once the engine is up: uvicorn runs the app's lifespan, which starts the
engine, before it binds (as vLLM's own API server does). An orchestrator therefore needs a
startup allowance as long as the engine's start (the Dockerfile's HEALTHCHECK says how long), and
the app has no gateway only around the lifespan: then both answers are 503.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is None:  # outside the lifespan: nothing serves
        return JSONResponse({"status": "not_serving"}, status_code=503)
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
    if request.app.state.drain.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ready", "model": gateway.base_model})
