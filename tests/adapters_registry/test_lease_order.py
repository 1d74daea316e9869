"""The gateway leases a request's adapter only once the request has its fair engine slot.

Real: `ServedRequest` (what vLLM's serving objects reach the engine through: admission, the fair
turn, the lease), tenancy's admission and fair queue, `EngineClient`, the registry (moto S3, disk
cache, tiers). Fake: vLLM's generate (three delta outputs, slow enough to overlap) and LoRA
control, as in the registry's other tests; this is a test of the order of the steps.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from registry_fake_engine import FakeEngine
from registry_rig import Rig
from vllm import SamplingParams
from vllm.sampling_params import RequestOutputKind

from loraplex.server.engine.client import EngineClient
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.served_request import ServedRequest
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.service import Tenancy
from loraplex.server.tenancy.settings import TenancySettings
from tests.support.fake_engine_outputs import Tokenizer, output

pytestmark = pytest.mark.anyio
STEP_S = 0.1  # between a fake request's outputs


class SlowGenerate:
    """AsyncLLM's generate and abort as `EngineClient` calls them: three outputs, STEP_S apart."""

    errored = False

    def __init__(self, fill: int) -> None:
        self.running = 0
        self.filled = asyncio.Event()  # set once `fill` requests generate at once
        self._fill = fill

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> Any:
        self.running += 1
        if self.running >= self._fill:
            self.filled.set()
        try:
            for i in range(3):
                await asyncio.sleep(STEP_S)
                yield output(last=i == 2)
        finally:
            self.running -= 1

    async def abort(self, request_id: str) -> None:
        pass


async def serve(served: ServedRequest) -> int:
    """One request as the route and vLLM's serving object drive it: one prompt submitted,
    the request started, its stream read to the end, the request closed; its token count."""
    params = SamplingParams(max_tokens=3, output_kind=RequestOutputKind.DELTA)
    stream = served.submit({"prompt_token_ids": [1, 2, 3]}, params, "rid", {})
    tokens = 0
    try:
        await served.start()
        async for output in stream:
            tokens += len(output.outputs[0].token_ids)
    finally:
        await served.close()
    return tokens


async def test_queued_requests_hold_no_adapter_so_cold_adapters_cannot_deadlock(rig: Rig) -> None:
    # The rig's registry has 3 CPU cache slots; the engine gets 3 slots too. Three requests fill
    # both with a0..a2; then three for the cold a3 queue, then one more each for a0..a2. Leasing
    # at admission, the queued a0..a2 requests held the three cache slots while the a3 requests,
    # granted the engine slots first, waited for a cache slot: nothing moved again.
    registry = await rig.registry("cache", FakeEngine())
    for i in range(4):
        await registry.register(f"a{i}", rig.source(f"a{i}", seed=i))
    engine = SlowGenerate(fill=3)
    settings = TenancySettings(max_running=3, max_queued=100)
    directory = TenantDirectory(settings, None, None)
    tenancy = Tenancy(settings, directory, GatewayMetrics(CollectorRegistry(), 0))
    client = EngineClient(engine, Tokenizer(), 2048)  # type: ignore[arg-type]
    tenant = directory.authenticate(None)

    def request(model: str) -> asyncio.Task:
        served = ServedRequest(client, registry, tenancy, tenant, None, model, model)
        return asyncio.create_task(serve(served))

    # The first request imports vLLM (sampling params): 10-14 s on a busy 2-core machine, which
    # is not the wait under test.
    await asyncio.to_thread(importlib.import_module, "vllm.sampling_params")
    first = [request(f"a{i}") for i in range(3)]
    await asyncio.wait_for(engine.filled.wait(), 10)  # all three loaded and generating
    cold = [request("a3") for _ in range(3)]
    await asyncio.sleep(STEP_S / 4)
    again = [request(f"a{i}") for i in range(3)]
    done, pending = await asyncio.wait(first + cold + again, timeout=15)
    for task in pending:
        task.cancel()
    assert not pending, f"{len(pending)} of 9 requests never finished"
    assert all(t.result() == 3 for t in done)
