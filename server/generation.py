"""One completion request from parsed body to response: the steps of the README's lifecycle.

resolve model -> lease adapter -> tokenize and check context -> admit (in-flight bound)
-> stream deltas from the engine -> whole JSON or SSE chunks. The engine request is aborted if the
client goes away (streaming: Starlette cancels the body iterator; whole responses: a watcher
cancels the collection when the client disconnects).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from loraplex.adapters_registry.base import AdapterNotFound, AdapterSource, ServableAdapter
from loraplex.server.access_log import record_of
from loraplex.server.engine.client import EngineClient
from loraplex.server.engine.sampling import to_sampling_params
from loraplex.server.errors import ApiError, EngineOverloaded, ModelNotFound
from loraplex.server.prompts import chat_prompt_ids, completion_prompt_ids, output_budget
from loraplex.server.protocol import ChatCompletionRequest, CompletionRequest
from loraplex.server.responses import (
    ChoiceState,
    ResponseMeta,
    chat_logprobs,
    chunk,
    finish_reason,
    text_logprobs,
    usage_chunk,
    whole_response,
)
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.service import Admitted, Tenancy


@dataclass
class InFlightLimit:
    """Bounds requests admitted to the engine; beyond it the server answers 503 at once."""

    limit: int
    current: int = 0

    def acquire(self) -> None:
        if self.current >= self.limit:
            raise EngineOverloaded(
                f"The server is overloaded ({self.limit} requests in flight); retry shortly.",
                headers={"Retry-After": "1"},
            )
        self.current += 1

    def release(self) -> None:
        self.current -= 1


@dataclass
class Gateway:
    """What a completion request needs: built once in the app's lifespan."""

    engine: EngineClient
    adapters: AdapterSource
    base_model: str
    in_flight: InFlightLimit
    tenancy: Tenancy


@dataclass
class Prepared:
    meta: ResponseMeta
    prompt_ids: list[int]
    max_tokens: int
    adapter: ServableAdapter | None
    admitted: Admitted = field(init=False)  # set by `complete` once tenancy admits the request


async def _prepare(
    gw: Gateway, body: ChatCompletionRequest | CompletionRequest, adapter: ServableAdapter | None
) -> Prepared:
    tokenizer = gw.engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        ids, kind, prefix = chat_prompt_ids(tokenizer, body), "chat", "chatcmpl-"
    else:
        ids, kind, prefix = completion_prompt_ids(tokenizer, body), "text", "cmpl-"
    max_tokens = output_budget(body, len(ids), gw.engine.max_model_len)
    meta = ResponseMeta(kind=kind, id=prefix + uuid.uuid4().hex, model=body.model)  # type: ignore[arg-type]
    return Prepared(meta, ids, max_tokens, adapter)


def _append_logprobs(
    gw: Gateway, body: Any, state: ChoiceState, token_ids: list[int], logprobs: Any
) -> Any:
    """This delta's logprobs in wire format, also accumulated into `state`."""
    if logprobs is None:
        return None
    tok = gw.engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        part: Any = chat_logprobs(tok, token_ids, logprobs, body.top_logprobs or 0)
        state.logprobs = (state.logprobs or []) + part
    else:
        part = text_logprobs(tok, token_ids, logprobs, body.logprobs or 0, len(state.text))
        if state.logprobs is None:
            state.logprobs = {k: [] for k in part}
        for k, v in part.items():
            state.logprobs[k].extend(v)
    return part


async def _deltas(
    gw: Gateway, body: Any, prep: Prepared, choices: dict[int, ChoiceState]
) -> AsyncIterator[tuple[ChoiceState, str, Any]]:
    """(choice, new text, new logprobs) for each delta of each choice, in engine order."""
    params = to_sampling_params(body, prep.max_tokens)
    stream = prep.admitted.generate(gw.engine, prep.prompt_ids, params, prep.adapter, prep.meta.id)
    async with aclosing(stream):
        async for output in stream:
            for out in output.outputs:
                state = choices.setdefault(out.index, ChoiceState(out.index))
                token_ids = list(out.token_ids)
                state.token_count += len(token_ids)
                logprobs = _append_logprobs(gw, body, state, token_ids, out.logprobs)
                state.text += out.text
                state.finish_reason = finish_reason(out.finish_reason)
                yield state, out.text, logprobs


async def _collect(gw: Gateway, body: Any, prep: Prepared) -> dict[str, Any]:
    choices: dict[int, ChoiceState] = {}
    async for _ in _deltas(gw, body, prep, choices):
        pass
    return whole_response(prep.meta, list(choices.values()), len(prep.prompt_ids))


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def _stream(
    gw: Gateway, body: Any, prep: Prepared, release: Callable[[], Awaitable[None]]
) -> AsyncIterator[bytes]:
    choices: dict[int, ChoiceState] = {}
    try:
        if prep.meta.kind == "chat":
            for i in range(body.n):
                yield _sse(chunk(prep.meta, i, "", None, role=True))
        try:
            async for state, text, logprobs in _deltas(gw, body, prep, choices):
                if text or logprobs or state.finish_reason:
                    yield _sse(chunk(prep.meta, state.index, text, state.finish_reason, logprobs))
        except ApiError as e:  # headers are sent: report the error in-band, as OpenAI does
            yield _sse({"error": {"message": e.message, "type": e.type, "code": e.code}})
            return
        if body.include_usage_in_stream:
            completion = sum(c.token_count for c in choices.values())
            yield _sse(usage_chunk(prep.meta, len(prep.prompt_ids), completion))
        yield b"data: [DONE]\n\n"
    finally:
        await release()


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect_unless_disconnected(
    request: Request, gw: Gateway, body: Any, prep: Prepared
) -> dict[str, Any] | None:
    """The whole response, or None if the client left first (its engine request is aborted)."""
    work = asyncio.ensure_future(_collect(gw, body, prep))
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    return work.result() if not work.cancelled() else None


async def complete(
    request: Request,
    gw: Gateway,
    body: ChatCompletionRequest | CompletionRequest,
    tenant: Tenant,
) -> JSONResponse | StreamingResponse:
    """Serve one chat or text completion, whole or streamed."""
    stack = AsyncExitStack()
    try:
        adapter = None
        if body.model != gw.base_model:
            if not tenant.may_use(body.model):  # another tenant's adapter: exactly "not found"
                raise ModelNotFound(body.model)
            try:
                adapter = await stack.enter_async_context(gw.adapters.lease(body.model))
            except AdapterNotFound as e:
                raise ModelNotFound(body.model) from e
        prep = await _prepare(gw, body, adapter)
        gw.in_flight.acquire()
        stack.callback(gw.in_flight.release)
        prep.admitted = gw.tenancy.admit(
            tenant,
            record_of(request),
            model=body.model,
            adapter=None if adapter is None else body.model,
            prompt_tokens=len(prep.prompt_ids),
            max_tokens=prep.max_tokens,
        )
        stack.callback(prep.admitted.close)
        if body.stream:
            # From here the stream owns the lease and the in-flight slot; it releases both.
            owned = stack.pop_all()
            return StreamingResponse(
                _stream(gw, body, prep, owned.aclose),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        result = await _collect_unless_disconnected(request, gw, body, prep)
        return JSONResponse(result if result is not None else {})
    finally:
        await stack.aclose()
