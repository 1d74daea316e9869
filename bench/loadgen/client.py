"""Sends the workload: one official `openai` async client per tenant, streaming every request.

Each request is a `/v1/completions` stream with random prompt token ids (exact prompt length),
`ignore_eos` (exact output length) and `stream_options.include_usage` (the server's token count).
Times are `time.perf_counter()` seconds from just before the request is sent.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import openai

from bench.loadgen.workload import TenantLoad, Workload


@dataclass
class Sample:
    tenant: str
    adapter: str | None
    sent_at: float
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    status: int = 200
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times: list[float] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        if len(self.chunk_times) < 2 or self.completion_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)

    @property
    def output_tokens_per_s(self) -> float | None:
        """Output tokens over send-to-last-token time (the server's definition too)."""
        if not self.chunk_times:
            return None
        return self.completion_tokens / self.chunk_times[-1]

    def inter_token_latencies(self) -> list[float]:
        """Gaps between streamed chunks, spread over the tokens each chunk carried (~1)."""
        if len(self.chunk_times) < 2:
            return []
        per_chunk = max(1.0, (self.completion_tokens - 1) / (len(self.chunk_times) - 1))
        return [(b - a) / per_chunk for a, b in itertools.pairwise(self.chunk_times)]


async def send_one(
    client: openai.AsyncOpenAI,
    tenant: TenantLoad,
    model: str,
    adapter: str | None,
    prompt: list[int],
) -> Sample:
    sample = Sample(tenant.name, adapter, sent_at=time.perf_counter())
    t0 = sample.sent_at
    try:
        stream = await client.completions.create(
            model=adapter or model,
            prompt=prompt,
            max_tokens=tenant.output_len,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            extra_headers={"x-request-id": sample.request_id},
        )
        async for chunk in stream:
            now = time.perf_counter() - t0
            if chunk.choices:
                sample.chunk_times.append(now)
                if sample.ttft_s is None:
                    sample.ttft_s = now
            if chunk.usage is not None:
                sample.prompt_tokens = chunk.usage.prompt_tokens
                sample.completion_tokens = chunk.usage.completion_tokens
    except openai.APIStatusError as e:
        sample.status, sample.error = e.status_code, type(e).__name__
    except openai.APIError as e:
        sample.status, sample.error = 0, type(e).__name__
    sample.e2e_s = time.perf_counter() - t0
    return sample


class TenantSender:
    """One tenant's client, prompt source and adapter rotation."""

    def __init__(self, workload: Workload, tenant: TenantLoad, model: str) -> None:
        self.tenant = tenant
        self.model = model
        self._workload = workload
        self._rng = random.Random(f"{workload.seed}-{tenant.name}")
        self._adapters = itertools.cycle(tenant.adapters or [None])
        self.client = openai.AsyncOpenAI(
            base_url=workload.base_url.rstrip("/") + "/v1",
            api_key=tenant.key(),
            max_retries=0,
            timeout=600.0,
        )

    def _prompt(self) -> list[int]:
        low, high = self._workload.vocab_low, self._workload.vocab_high
        return [self._rng.randrange(low, high) for _ in range(self.tenant.prompt_len)]

    async def send(self) -> Sample:
        return await send_one(
            self.client, self.tenant, self.model, next(self._adapters), self._prompt()
        )

    async def warm_up(self) -> None:
        for _ in range(self._workload.warmup_requests):
            await self.send()

    async def run(self, deadline: float) -> list[Sample]:
        """Send until the deadline (or `num_requests`); returns the measured samples."""
        await asyncio.sleep(self.tenant.start_after_s)
        n = self.tenant.num_requests
        budget = itertools.count() if n is None else iter(range(n))
        if self.tenant.concurrency is not None:
            return await self._closed_loop(self.tenant.concurrency, budget, deadline)
        assert self.tenant.rate is not None
        return await self._poisson(self.tenant.rate, budget, deadline)

    async def _closed_loop(
        self, users: int, budget: Iterator[int], deadline: float
    ) -> list[Sample]:
        samples: list[Sample] = []

        async def user() -> None:
            while time.perf_counter() < deadline and next(budget, None) is not None:
                samples.append(await self.send())

        await asyncio.gather(*(user() for _ in range(users)))
        return samples

    async def _poisson(self, rate: float, budget: Iterator[int], deadline: float) -> list[Sample]:
        tasks: list[asyncio.Task[Sample]] = []
        next_at = time.perf_counter()
        while next_at < deadline and next(budget, None) is not None:
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(self.send()))
            next_at += self._rng.expovariate(rate)
        drain = max(0.0, deadline + self._workload.drain_s - time.perf_counter())
        done, pending = await asyncio.wait(tasks, timeout=drain) if tasks else (set(), set())
        for task in pending:  # still queued or streaming: the client gives up on them
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        abandoned = [Sample(self.tenant.name, None, 0.0, status=0, error="abandoned")] * len(
            pending
        )
        return [t.result() for t in tasks if t in done] + abandoned


async def base_model_name(workload: Workload) -> str:
    if workload.model is not None:
        return workload.model
    async with openai.AsyncOpenAI(
        base_url=workload.base_url.rstrip("/") + "/v1", api_key=workload.tenants[0].key()
    ) as probe:
        return (await probe.models.list()).data[0].id


async def run_workload(workload: Workload) -> tuple[list[Sample], float]:
    """Warm every tenant up, then run them all at once; returns samples and measured seconds."""
    model = await base_model_name(workload)
    senders = [TenantSender(workload, t, model) for t in workload.tenants]
    try:
        await asyncio.gather(*(s.warm_up() for s in senders))
        start = time.perf_counter()
        deadline = start + workload.duration_s
        per_tenant = await asyncio.gather(*(s.run(deadline) for s in senders))
        return [x for samples in per_tenant for x in samples], time.perf_counter() - start
    finally:
        for sender in senders:
            await sender.client.close()
