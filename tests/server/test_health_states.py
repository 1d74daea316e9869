"""What the app answers outside its lifespan (no gateway: before the engine is up or after it
went down), over ASGI without running the lifespan; the live answers are in test_openai_api.py
and test_engine_death.py."""

from __future__ import annotations

import httpx
import pytest

from loraplex.server.app import create_app
from loraplex.server.settings import load_settings

pytestmark = pytest.mark.anyio


async def _get_and_post() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
    transport = httpx.ASGITransport(app=create_app(load_settings()))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return (
            await client.get("/health"),
            await client.get("/ready"),
            await client.post("/v1/completions", json={"model": "m", "prompt": "hi"}),
        )


async def test_without_a_gateway_liveness_readiness_and_requests_are_all_503() -> None:
    health, ready, completion = await _get_and_post()
    assert (health.status_code, health.json()) == (503, {"status": "not_serving"})
    assert (ready.status_code, ready.json()) == (503, {"status": "not_ready"})
    assert completion.status_code == 503 and completion.headers["retry-after"] == "5"
    error = completion.json()["error"]
    assert error["code"] == "engine_unavailable" and "not serving" in error["message"]
