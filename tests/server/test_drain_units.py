"""The drain's state machine (server/drain.py) on a minimal ASGI app: the gate, the wait and the
cut. The drain of a real server on SIGTERM: test_fleet_replica.py."""

from __future__ import annotations

import asyncio
import time

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from loraplex.server.drain import RETRY_AFTER_S, Drain, DrainGate


def gated_app(drain: Drain, release: asyncio.Event) -> DrainGate:
    async def slow(request: Request) -> PlainTextResponse:
        await release.wait()
        return PlainTextResponse("done")

    async def ready(request: Request) -> JSONResponse:
        return JSONResponse({}, status_code=503 if drain.draining else 200)

    routes = [Route("/v1/slow", slow), Route("/ready", ready), Route("/metrics", ready)]
    return DrainGate(Starlette(routes=routes), drain)


def test_new_requests_get_503_with_retry_after_while_probes_and_metrics_still_answer() -> None:
    async def run() -> None:
        drain, release = Drain(10.0), asyncio.Event()
        transport = httpx.ASGITransport(app=gated_app(drain, release))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            in_flight = asyncio.ensure_future(client.get("/v1/slow"))
            await asyncio.sleep(0.05)
            drain.begin()
            r = await client.get("/v1/slow")
            assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
            assert r.json()["error"]["code"] == "shutting_down"
            assert (await client.get("/ready")).status_code == 503  # answered, not gated
            assert (await client.get("/metrics")).status_code == 503
            waiting = asyncio.ensure_future(drain.run())
            await asyncio.sleep(0.1)
            assert not waiting.done()  # the request in flight holds the drain
            release.set()
            assert (await in_flight).text == "done"
            await asyncio.wait_for(waiting, 5)

    asyncio.run(run())


def test_the_cut_cancels_what_still_runs_at_drain_s_and_says_so() -> None:
    """At drain_s the cuttable tasks are cancelled; each can tell the drain's cut from another
    cancellation (was_cut), and one that registers after the cut is cancelled at once."""

    async def run() -> None:
        drain = Drain(0.2)
        outcomes: list[str] = []

        async def request(cuttable: bool) -> None:
            with drain.request():
                try:
                    if cuttable:
                        with drain.cuttable():
                            await asyncio.sleep(30)
                    else:
                        await asyncio.sleep(30)
                except asyncio.CancelledError:
                    if not drain.was_cut():
                        raise
                    outcomes.append("cut")
                    await asyncio.sleep(0)  # no longer cancelling: it may finish its response
                    outcomes.append("answered")

        cut = asyncio.ensure_future(request(cuttable=True))
        other = asyncio.ensure_future(request(cuttable=False))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        draining = asyncio.ensure_future(drain.run())
        await asyncio.sleep(0.4)
        assert outcomes == ["cut", "answered"] and cut.done() and not cut.cancelled()
        other.cancel()  # e.g. its client left: not the drain's
        await asyncio.wait_for(draining, 6)
        assert other.cancelled()
        assert 0.2 <= time.monotonic() - started < 1.0

        async def late() -> None:
            with drain.cuttable():
                await asyncio.sleep(30)

        late_task = asyncio.ensure_future(late())
        await asyncio.sleep(0.05)
        assert late_task.cancelled() and drain.was_cut(late_task)

    asyncio.run(run())


def test_a_whole_response_cut_by_the_drain_is_shutting_down_not_client_disconnected() -> None:
    """vLLM's whole-response generators catch the cancellation and return their own 400 "Client
    disconnected" (chat and completion serving alike); the cut must still answer 503."""
    from types import SimpleNamespace

    from loraplex.server.drain import ShuttingDown
    from loraplex.server.generation import _whole_unless_disconnected
    from loraplex.server.protocol import ChatCompletionRequest

    class ErrorResponse:  # vLLM's shape, as loraplex.server.vllm_errors.answered reads it
        def __init__(self, message: str) -> None:
            self.error = SimpleNamespace(message=message, param=None, code=400)

    class Chat:
        async def create_chat_completion(self, request: object, raw: object) -> object:
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                return ErrorResponse("Client disconnected")
            return "whole response"

    class StillConnected:
        async def receive(self) -> dict[str, str]:
            await asyncio.sleep(30)
            return {"type": "http.disconnect"}

    async def run() -> None:
        drain = Drain(0.1)
        gw = SimpleNamespace(drain=drain, serving=SimpleNamespace(chat=Chat()))
        body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
        with drain.request():
            answer = asyncio.ensure_future(
                _whole_unless_disconnected(StillConnected(), gw, body)  # type: ignore[arg-type]
            )
            await asyncio.sleep(0.05)
            drain.begin()
            drain.cut()
            try:
                await asyncio.wait_for(answer, 5)
            except ShuttingDown:
                return
        raise AssertionError(f"the cut request answered {answer!r} instead of ShuttingDown")

    asyncio.run(run())
