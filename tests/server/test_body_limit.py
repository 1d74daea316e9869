"""The request body cap, on a small Starlette app that echoes what it received (pure ASGI logic;
the live server's 413 is in test_openai_api.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from loraplex.server.body_limit import BodyLimitMiddleware

pytestmark = pytest.mark.anyio
LIMIT = 1024
TIMEOUT_S = 5.0


def _echo_app() -> tuple[Starlette, list[bytes]]:
    seen: list[bytes] = []

    async def echo(request: Request) -> Response:
        seen.append(await request.body())
        return Response(seen[-1])

    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    app.add_middleware(BodyLimitMiddleware, max_bytes=LIMIT, timeout_s=TIMEOUT_S)
    return app, seen


async def _chunks(total: int, size: int = 100) -> AsyncIterator[bytes]:
    """A body sent in chunks with no Content-Length (chunked transfer encoding)."""
    for start in range(0, total, size):
        yield b"x" * min(size, total - start)


async def _post(app: Starlette, content: bytes | AsyncIterator[bytes]) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/echo", content=content)


@pytest.mark.parametrize("total", [0, 1, LIMIT])
async def test_a_body_within_the_cap_reaches_the_app_unchanged(total: int) -> None:
    app, seen = _echo_app()
    body = bytes(range(256)) * (total // 256) + b"y" * (total % 256)
    reply = await _post(app, body)
    assert reply.status_code == 200 and reply.content == body and seen == [body]


async def test_a_chunked_body_within_the_cap_is_reassembled() -> None:
    app, seen = _echo_app()
    reply = await _post(app, _chunks(LIMIT))
    assert reply.status_code == 200 and seen == [b"x" * LIMIT]


async def test_a_declared_length_over_the_cap_is_413_naming_the_setting() -> None:
    app, seen = _echo_app()
    reply = await _post(app, b"x" * (LIMIT + 1))
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert f"is {LIMIT + 1} bytes" in error["message"]
    assert (
        f"limit is {LIMIT} bytes" in error["message"] and "http.max_body_bytes" in error["message"]
    )
    assert seen == []  # the app never ran


async def test_a_chunked_body_is_refused_once_it_passes_the_cap() -> None:
    app, seen = _echo_app()
    reply = await _post(app, _chunks(10 * LIMIT))
    assert reply.status_code == 413
    assert f"passed {LIMIT} bytes" in reply.json()["error"]["message"]
    assert seen == []
