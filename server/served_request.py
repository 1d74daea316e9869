"""One HTTP request's way into the engine, under vLLM's serving objects.

vLLM's `OpenAIServingChat` / `OpenAIServingCompletion` render the request and call
`engine_client.generate` once per prompt (`vllm_serving.EngineView`); that call lands in
`ServedRequest.submit`, which runs the engine's own input checks at once (so a bad request fails
inside `create_*`, before any response byte) and hands back a stream that has not started.
Started (by the route before it sends a stream, or by vLLM's first read of a whole response's
stream), the request is admitted once for all its prompts (tenant quotas and the bounded fair
queue: 429/503) and a cold adapter's files are fetched to disk (503). Each stream then waits for
the request's fair turn, the request leases its adapter (after the turn: a queued request holds
no engine cache slot, so requests waiting their turn cannot hold every slot) and submits with
tenancy's priority and the leased adapter's `name@version`. A stream the engine guard fails
(non-finite logits) quarantines the adapter that caused it before the client hears of it.
`close` ends it all in order: engine requests aborted, lease released, queue slot freed and the
processed tokens charged.

Outputs are always requested as `DELTA`; a whole response's are merged into the one final output
vLLM's serving object expects (`RequestOutput.add`, as vLLM's own collector merges), so the
tenant's record sees every token when it comes (TTFT, inter-token latency).

The request travels to `EngineView.generate` as the current task's `CURRENT` context variable:
vLLM's serving objects call `generate` with their own arguments only.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncGenerator, Iterator, Mapping
from contextlib import AsyncExitStack, aclosing, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loraplex.adapters_registry.base import (
    AdapterError,
    AdapterNotFound,
    AdapterSource,
    ServableAdapter,
)
from loraplex.server.engine.finite_guard import AdapterOutputNotFinite, OutputNotFinite
from loraplex.server.errors import ModelNotFound, from_adapter_error
from loraplex.server.lora_activity import LoraActivity, Phase, RequestActivity
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.record import RequestRecord
from loraplex.server.tenancy.service import Admitted, Tenancy

if TYPE_CHECKING:
    from vllm import RequestOutput, SamplingParams

    from loraplex.server.engine.client import EngineClient

log = logging.getLogger(__name__)

CURRENT: ContextVar[ServedRequest | None] = ContextVar("loraplex_served_request", default=None)

# -inf (a token the sampler masked) is not JSON; OpenAI reports such tokens as -9999, and so does
# vLLM's response builder, which leaves NaN and +inf as they are.
MIN_LOGPROB = -9999.0


def _finite(value: float) -> float:
    if math.isnan(value):
        return MIN_LOGPROB
    return min(max(value, MIN_LOGPROB), 0.0)


def finite_logprobs(logprobs: Any) -> None:
    """Make every log-probability in vLLM's logprobs (a list of {token: Logprob} per position, or
    its FlatLogprobs) a finite number in [MIN_LOGPROB, 0], in place: NaN (logits poisoned by a
    broken adapter) says no more than a masked token, +inf no more than certainty. Neither is
    JSON: a whole response holding one was a 500, a stream carried the bare word NaN."""
    if logprobs is None:
        return
    flat = getattr(logprobs, "logprobs", None)
    if isinstance(flat, list):
        flat[:] = [_finite(v) for v in flat]
        return
    for position in logprobs:
        for logprob in (position or {}).values():
            logprob.logprob = _finite(logprob.logprob)


@contextmanager
def as_current(request: ServedRequest) -> Iterator[ServedRequest]:
    """`request` is the one `EngineView.generate` serves while the block runs."""
    token = CURRENT.set(request)
    try:
        yield request
    finally:
        CURRENT.reset(token)


@contextmanager
def as_client_errors(model: str) -> Iterator[None]:
    """The registry's errors as the client sees them: an adapter that does not exist (or was
    unregistered since the route checked it) is exactly "model not found"."""
    try:
        yield
    except AdapterNotFound as e:
        raise ModelNotFound(model) from e
    except AdapterError as e:
        raise from_adapter_error(e) from e


@dataclass(frozen=True)
class _Call:
    """One `generate` call of vLLM's serving object: one prompt."""

    prompt: Mapping[str, Any]
    params: SamplingParams
    request_id: str
    vllm_kwargs: dict[str, Any]
    whole: bool  # vLLM asked for the final output only


def _finite_outputs(output: RequestOutput) -> RequestOutput:
    finite_logprobs(output.prompt_logprobs)
    for completion in output.outputs:
        finite_logprobs(completion.logprobs)
    return output


class ServedRequest:
    def __init__(
        self,
        engine: EngineClient,
        adapters: AdapterSource,
        tenancy: Tenancy,
        tenant: Tenant,
        record: RequestRecord | None,
        model: str,
        adapter: str | None,
        activity: LoraActivity | None = None,
    ) -> None:
        self._engine = engine
        self._adapters = adapters
        self._tenancy = tenancy
        self._tenant = tenant
        self._record = record
        self.model = model
        self.adapter = adapter
        # Where the request stands, for the endpoint picker's gauges (lora_activity.py).
        self._activity = activity or LoraActivity()
        self._phase: RequestActivity | None = None
        # The request fields named by errors about the prompt and the constrained decoding.
        self.prompt_field = "messages"
        self.constrained_by: str | None = None
        self._calls: list[_Call] = []
        self._streams: list[AsyncGenerator[RequestOutput, None]] = []
        self._admitted: Admitted | None = None
        self._started = False
        self._start_lock = asyncio.Lock()
        self._turn_lock = asyncio.Lock()
        self._lease_lock = asyncio.Lock()
        self._leased: ServableAdapter | None = None
        self._held = AsyncExitStack()
        # The first error raised underneath a stream (lease, engine), for the route to answer
        # with in place of vLLM's rendering of it.
        self.failure: Exception | None = None

    # --- called by vLLM's serving object, through EngineView.generate ---------------------
    def submit(
        self,
        prompt: Mapping[str, Any],
        params: SamplingParams,
        request_id: str,
        vllm_kwargs: dict[str, Any],
    ) -> AsyncGenerator[RequestOutput, None]:
        """Record one prompt (already checked as the engine would check it) and return its
        stream, not started."""
        from vllm.sampling_params import RequestOutputKind

        whole = params.output_kind == RequestOutputKind.FINAL_ONLY
        params.output_kind = RequestOutputKind.DELTA
        call = _Call(prompt, params, request_id, vllm_kwargs, whole)
        self._calls.append(call)
        stream = self._stream(call)
        self._streams.append(stream)
        return stream

    # --- the request's life ---------------------------------------------------------------
    async def start(self) -> None:
        """Admit the request with all its prompts and fetch a cold adapter's files; once.
        Raises tenancy's refusals (RequestTooLarge 400, RateLimited 429, QueueFull 503) or the
        registry's errors (404, 503)."""
        async with self._start_lock:
            if self._started:
                return
            if self._admitted is None:
                # One reservation for all the prompts: their sequences, each of up to the
                # largest max_tokens (the unused part is given back at the end).
                self._admitted = await self._tenancy.admit(
                    self._tenant,
                    self._record,
                    model=self.model,
                    adapter=self.adapter,
                    prompt_tokens=sum(len(c.prompt["prompt_token_ids"]) for c in self._calls),
                    max_tokens=max((c.params.max_tokens or 0) for c in self._calls),
                    n=sum(c.params.n for c in self._calls),
                )
                self._phase = self._held.enter_context(
                    self._activity.track(self.adapter, sum(c.params.n for c in self._calls))
                )
            if self.adapter is not None:
                with as_client_errors(self.adapter):
                    await self._adapters.prefetch(self.adapter)
            self._started = True

    async def _turn(self) -> Admitted:
        await self.start()
        assert self._admitted is not None
        async with self._turn_lock:
            await self._admitted.turn()
        return self._admitted

    async def _lease(self) -> ServableAdapter | None:
        """The adapter, leased once for the request and held until `close`."""
        if self.adapter is None:
            return None
        async with self._lease_lock:
            if self._leased is None:
                with as_client_errors(self.adapter):
                    lease = self._adapters.lease(self.adapter)
                    self._leased = await self._held.enter_async_context(lease)
            return self._leased

    async def _stream(self, call: _Call) -> AsyncGenerator[RequestOutput, None]:
        try:
            admitted = await self._turn()
            adapter = await self._lease()
            assert self._phase is not None  # set with the admission
            self._phase.enter(Phase.ENGINE)
            outputs = admitted.generate(
                self._engine, call.prompt, call.params, adapter, call.request_id,
                **call.vllm_kwargs,
            )  # fmt: skip
            async with aclosing(outputs) as it:
                if not call.whole:
                    async for output in it:
                        self._phase.enter(Phase.RUNNING)
                        yield _finite_outputs(output)
                    return
                merged = None
                async for output in it:
                    self._phase.enter(Phase.RUNNING)
                    output = _finite_outputs(output)
                    if merged is None:
                        merged = output
                    else:
                        merged.add(output, aggregate=True)
                if merged is not None:
                    merged.outputs.sort(key=lambda o: o.index)
                    yield merged
        except OutputNotFinite as e:  # the engine guard failed it (engine/finite_guard.py)
            reason = f"{e.reason} in request {call.request_id}"
            log.error("%s: %s", self.model, reason)
            if isinstance(e, AdapterOutputNotFinite):  # its values are the fault
                await self._adapters.quarantine(e.adapter.name, e.adapter.version, reason)
            self._fail(e)
            raise
        except Exception as e:
            self._fail(e)
            raise

    def _fail(self, error: Exception) -> None:
        if self.failure is None:
            self.failure = error

    async def close(self) -> None:
        """Abort what still runs in the engine, release the lease, free the queue slot and
        charge the processed tokens. Idempotent."""
        try:
            for stream in self._streams:
                try:
                    await stream.aclose()
                except RuntimeError:  # a stream still being read in another task ends there
                    log.warning("stream of %s was still running at close", self.model)
            self._streams.clear()
            await self._held.aclose()
        finally:
            if self._admitted is not None:
                await self._admitted.close()
