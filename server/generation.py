"""One completion request from parsed body to response: the steps of the README's lifecycle.

check access and that the adapter exists -> tokenize, check context, build sampling params
(every 400 before any work) -> admit (tenant quotas, bounded fair queue) -> fetch a cold
adapter's files to disk -> wait for the fair engine slot -> lease the adapter (load it into the
engine's CPU cache and hold it there) and stream deltas -> whole JSON or SSE chunks.

The lease comes after the queue wait: a queued request that held a lease would keep its adapter
in the engine's CPU cache, and once the requests holding the engine slots all wait for a cache
slot, nobody moves again (two engine slots, two cache slots: two running requests for a cold
adapter wait on two queued ones for cached adapters, which wait for the engine slots). The fetch
comes before the wait: it holds no cache slot, and its errors are still a status before any
stream byte. (The queue grants a free engine slot at admission, so a request may hold one during
its adapter's download, as it did before.)

The engine request is aborted if the client goes away. Streaming: `_ClosingStream` closes the
body iterator whatever ends the response (Starlette cancels it on disconnect but never closes a
generator parked at a `yield`), so engine request, lease and queue slot are released in order.
Whole responses: a watcher cancels the collection when the client disconnects.

A request whose logits stop being finite fails alone (the engine guard, engine/finite_guard.py),
and an adapter that made them so is quarantined before its client hears of it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import AsyncExitStack, aclosing, contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from loraplex.adapters_registry.base import (
    AdapterError,
    AdapterNotFound,
    AdapterSource,
    ServableAdapter,
)
from loraplex.server.access_log import record_of
from loraplex.server.drain import Drain, ShuttingDown
from loraplex.server.engine.client import EngineClient, as_invalid_request
from loraplex.server.engine.finite_guard import AdapterOutputNotFinite, OutputNotFinite
from loraplex.server.engine.sampling import to_sampling_params
from loraplex.server.errors import (
    ApiError,
    ModelNotFound,
    error_event,
    from_adapter_error,
    internal_error,
)
from loraplex.server.json_pieces import json_response
from loraplex.server.lora_activity import LoraActivity, Phase, RequestActivity
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

if TYPE_CHECKING:
    from vllm import SamplingParams

log = logging.getLogger(__name__)

# nginx's code for "client closed request": what the access log records for a client that left.
CLIENT_CLOSED_REQUEST = 499


@dataclass
class Gateway:
    """What a completion request needs: built once in the app's lifespan."""

    engine: EngineClient
    adapters: AdapterSource
    base_model: str
    tenancy: Tenancy
    # Templating and tokenizing (prompts.py says why off the event loop); the lifespan passes
    # one sized by http.prompt_threads and shuts it down.
    prompt_threads: Executor = field(default_factory=lambda: ThreadPoolExecutor(1))
    # Where each admitted request stands, for the endpoint picker's gauges (picker_metrics.py).
    activity: LoraActivity = field(default_factory=LoraActivity)
    # The SIGTERM drain (drain.py): it may cut a request still running at its end.
    drain: Drain = field(default_factory=lambda: Drain(0.0))
    created: int = field(default_factory=lambda: int(time.time()))  # for /v1/models


@dataclass
class Prepared:
    meta: ResponseMeta
    prompt_ids: list[int]
    params: SamplingParams
    admitted: Admitted = field(init=False)  # set by `complete` once tenancy admits the request
    activity: RequestActivity = field(init=False)  # set with `admitted`


def _prompt_ids(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> list[int]:
    tokenizer, max_model_len = gw.engine.tokenizer, gw.engine.max_model_len
    if isinstance(body, ChatCompletionRequest):
        return chat_prompt_ids(tokenizer, body, max_model_len)
    return completion_prompt_ids(tokenizer, body, max_model_len)


async def _prepare(gw: Gateway, body: ChatCompletionRequest | CompletionRequest) -> Prepared:
    """Everything that can be refused with a 400, done before any queueing or adapter loading."""
    loop = asyncio.get_running_loop()
    ids = await loop.run_in_executor(gw.prompt_threads, _prompt_ids, gw, body)
    if isinstance(body, ChatCompletionRequest):
        kind, prefix = "chat", "chatcmpl-"
    else:
        kind, prefix = "text", "cmpl-"
    max_tokens = output_budget(body, len(ids), gw.engine.max_model_len)
    try:
        params = to_sampling_params(body, max_tokens)
    except Exception as e:
        if (invalid := as_invalid_request(e)) is not None:
            raise invalid from e
        raise
    meta = ResponseMeta(kind=kind, id=prefix + uuid.uuid4().hex, model=body.model)  # type: ignore[arg-type]
    return Prepared(meta, ids, params)


def _append_logprobs(
    gw: Gateway, body: Any, state: ChoiceState, token_ids: list[int], logprobs: Any
) -> Any:
    """This delta's logprobs in wire format, also accumulated into `state`."""
    if logprobs is None:
        return None
    tok = gw.engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        part: Any = chat_logprobs(tok, token_ids, logprobs, body.top_logprobs or 0)
        if state.logprobs is None:
            state.logprobs = []
        state.logprobs.extend(part)  # not `+`: a copy per token made it quadratic
    else:
        part = text_logprobs(tok, token_ids, logprobs, body.logprobs or 0, len(state.text))
        if state.logprobs is None:
            state.logprobs = {k: [] for k in part}
        for k, v in part.items():
            state.logprobs[k].extend(v)
    return part


async def _deltas(
    gw: Gateway, body: Any, prep: Prepared, choices: dict[int, ChoiceState]
) -> AsyncGenerator[tuple[ChoiceState, str, Any], None]:
    """(choice, new text, new logprobs) for each delta of each choice, in engine order: once the
    fair engine slot is granted, under a lease of the adapter (the module docstring says why in
    this order)."""
    await prep.admitted.turn()
    async with AsyncExitStack() as stack:
        adapter = None
        if body.model != gw.base_model:
            adapter = await _lease(stack, gw, body.model)
        prep.activity.enter(Phase.ENGINE)
        stream = prep.admitted.generate(
            gw.engine, prep.prompt_ids, prep.params, adapter, prep.meta.id
        )
        async with aclosing(stream), aclosing(_choice_deltas(gw, body, stream, choices)) as it:
            try:
                async for delta in it:
                    prep.activity.enter(Phase.RUNNING)
                    yield delta
            except OutputNotFinite as e:  # the engine guard failed it (engine/finite_guard.py)
                reason = f"{e.reason} in request {prep.meta.id}"
                log.error("%s: %s", body.model, reason)
                if isinstance(e, AdapterOutputNotFinite):  # its values are the fault
                    await gw.adapters.quarantine(e.adapter.name, e.adapter.version, reason)
                raise


async def _lease(stack: AsyncExitStack, gw: Gateway, model: str) -> ServableAdapter:
    """The adapter, held until `stack` closes."""
    with _as_client_errors(model):
        return await stack.enter_async_context(gw.adapters.lease(model))


@contextmanager
def _as_client_errors(model: str) -> Iterator[None]:
    """The registry's errors in the block as the client sees them: an adapter that does not
    exist (or was unregistered since `complete` checked it) is exactly "model not found"."""
    try:
        yield
    except AdapterNotFound as e:
        raise ModelNotFound(model) from e
    except AdapterError as e:
        raise from_adapter_error(e) from e


async def _choice_deltas(
    gw: Gateway, body: Any, stream: AsyncIterator[Any], choices: dict[int, ChoiceState]
) -> AsyncGenerator[tuple[ChoiceState, str, Any], None]:
    """The engine's outputs as per-choice deltas, accumulated into `choices`."""
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
    async with aclosing(_deltas(gw, body, prep, choices)) as deltas:
        async for _ in deltas:
            pass
    return whole_response(prep.meta, list(choices.values()), len(prep.prompt_ids))


def _sse(payload: dict[str, Any]) -> bytes:
    # allow_nan=False: a NaN would be written as the bare word NaN, which is not JSON (responses
    # keep logprobs finite; anything else raises and ends the stream with an error event).
    return f"data: {json.dumps(payload, separators=(',', ':'), allow_nan=False)}\n\n".encode()


async def _stream(request: Request, gw: Gateway, body: Any, prep: Prepared) -> AsyncIterator[bytes]:
    choices: dict[int, ChoiceState] = {}
    # Chat streams open with the assistant's role, sent with the first token rather than at once:
    # clients time TTFT from the first chunk.
    announced = prep.meta.kind != "chat"
    record = record_of(request)
    ended = False  # the stream's last event went out: [DONE] or an error
    try:
        try:
            with gw.drain.cuttable():
                async with aclosing(_deltas(gw, body, prep, choices)) as deltas:
                    async for state, text, logprobs in deltas:
                        if not announced:
                            announced = True
                            for i in range(body.n):
                                yield _sse(chunk(prep.meta, i, "", None, role=True))
                        if text or logprobs or state.finish_reason:
                            yield _sse(
                                chunk(prep.meta, state.index, text, state.finish_reason, logprobs)
                            )
        except (Exception, asyncio.CancelledError) as e:
            # Headers are sent: report the error in-band, as OpenAI does.
            if isinstance(e, asyncio.CancelledError):
                if not gw.drain.was_cut():
                    raise  # the client left: nobody reads an event
                e = ShuttingDown()
            if not isinstance(e, ApiError):  # what a whole response answers with a 500
                log.exception("stream %s failed", record.request_id if record else "?")
                e = internal_error()
            if record is not None:
                record.error_type = e.code
            yield error_event(e).encode()
            ended = True
            return
        if body.include_usage_in_stream:
            completion = sum(c.token_count for c in choices.values())
            yield _sse(usage_chunk(prep.meta, len(prep.prompt_ids), completion))
        yield b"data: [DONE]\n\n"
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


async def _collect_unless_disconnected(
    request: Request, gw: Gateway, body: Any, prep: Prepared
) -> dict[str, Any] | None:
    """The whole response, or None if the client left first (its engine request is aborted).
    Raises ShuttingDown if the drain cut it."""
    work = asyncio.ensure_future(_collect(gw, body, prep))
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        with gw.drain.cuttable(work):
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
    if work.cancelled() and gw.drain.was_cut(work):
        raise ShuttingDown()
    return work.result() if not work.cancelled() else None


async def complete(
    request: Request,
    gw: Gateway,
    body: ChatCompletionRequest | CompletionRequest,
    tenant: Tenant,
) -> Response:
    """Serve one chat or text completion, whole or streamed."""
    is_adapter = body.model != gw.base_model
    if is_adapter:
        if not tenant.may_use(body.model):  # another tenant's: exactly "not found"
            raise ModelNotFound(body.model)
        with _as_client_errors(body.model):  # before admission: no adapter, no quota spent
            gw.adapters.resolve(body.model)
    prep = await _prepare(gw, body)
    stack = AsyncExitStack()
    try:
        # Quotas and the queue bound come before the lease, so a refused request never fetches
        # or loads an adapter (which could evict other tenants' adapters from the engine).
        prep.admitted = await gw.tenancy.admit(
            tenant,
            record_of(request),
            model=body.model,
            adapter=body.model if is_adapter else None,
            prompt_tokens=len(prep.prompt_ids),
            max_tokens=prep.params.max_tokens or 0,
            n=prep.params.n,
        )
        stack.push_async_callback(prep.admitted.close)
        prep.activity = stack.enter_context(
            gw.activity.track(body.model if is_adapter else None, prep.params.n)
        )
        if is_adapter:
            with _as_client_errors(body.model):
                await gw.adapters.prefetch(body.model)
        if body.stream:
            # From here the response owns the queue slot (and the lease it takes); it releases
            # both.
            return _ClosingStream(_stream(request, gw, body, prep), stack.pop_all())
        result = await _collect_unless_disconnected(request, gw, body, prep)
        if result is None:  # the client left; nobody reads this, the access log does
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return json_response(result)
    finally:
        await stack.aclose()
