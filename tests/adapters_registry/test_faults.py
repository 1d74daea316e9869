"""S3 faults between a replica and the store: each ends in a retried success or a clear error,
never a corrupt cache file, and other adapters keep serving.

Replica A registers through a clean connection; replica B reads the weights through the fault
proxy with an empty disk cache, so every lease on B is a cold fetch through the faults.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from registry_rig import Rig, metric

from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.base import AdapterInvalid, AdapterUnavailable, ErrorKind
from tests.support.s3_fault_proxy import FaultProxy

pytestmark = pytest.mark.anyio


async def replica_behind_proxy(rig: Rig, proxy: FaultProxy) -> ManagedRegistry:
    a = await rig.registry("a")
    await a.register("acme/bot", rig.source("bot"))
    await a.register("acme/other", rig.source("other", seed=9))
    b = await rig.registry("b", endpoint=proxy.url)
    async with b.lease("acme/other"):  # warm before any fault is armed
        pass
    return b


def nothing_cached(rig: Rig, reg: ManagedRegistry, version: str) -> bool:
    return version not in reg.cache.cached() and not list((rig.tmp / "b/disk/tmp").iterdir())


@pytest.mark.parametrize(
    "arm",
    [
        pytest.param(lambda p: p.fail(2, 500, "InternalError"), id="500s"),
        pytest.param(lambda p: p.fail(2, 503, "SlowDown"), id="throttling"),
        pytest.param(lambda p: p.reset(1), id="reset-mid-body"),
        pytest.param(lambda p: p.corrupt(1), id="hash-mismatch-once"),
    ],
)
async def test_transient_faults_end_in_a_retried_success(
    rig: Rig, fault_proxy: FaultProxy, arm: object
) -> None:
    b = await replica_behind_proxy(rig, fault_proxy)
    hits_before = fault_proxy.hits
    arm(fault_proxy)  # type: ignore[operator]
    async with b.lease("acme/bot") as adapter:
        weights = adapter.path / "adapter_model.safetensors"
        source = rig.tmp / "src/bot/adapter_model.safetensors"
        assert weights.read_bytes() == source.read_bytes()
    assert fault_proxy.hits > hits_before + 2  # two blobs, plus at least one retry


@pytest.mark.parametrize(
    ("arm", "says"),
    [
        pytest.param(lambda p: p.fail(100, 500, "InternalError"), "InternalError", id="500s"),
        pytest.param(lambda p: p.corrupt(100), "hash", id="hash-mismatch"),
    ],
)
async def test_persistent_faults_are_a_clear_503_and_others_keep_serving(
    rig: Rig, fault_proxy: FaultProxy, arm: object, says: str
) -> None:
    b = await replica_behind_proxy(rig, fault_proxy)
    arm(fault_proxy)  # type: ignore[operator]
    with pytest.raises(AdapterUnavailable) as err:
        async with b.lease("acme/bot"):
            pass
    assert err.value.kind is ErrorKind.UNAVAILABLE and "`acme/bot`" in err.value.message
    assert says.lower() in err.value.message.lower()
    assert nothing_cached(rig, b, b.resolve("acme/bot").version)
    assert metric(b, "loraplex_adapter_load_failures_total", tier="disk") >= 1
    async with b.lease("acme/other") as other:  # warm adapters are unaffected
        assert other.name == "acme/other"
    fault_proxy.clear()
    async with b.lease("acme/bot"):  # and the failed one recovers once S3 does
        pass


async def test_slow_s3_does_not_block_the_event_loop(rig: Rig, fault_proxy: FaultProxy) -> None:
    """A cold fetch from a slow store runs in a thread: the loop keeps ticking and warm adapters
    keep being leased while it lasts (the real-engine ITL version is in tests/server)."""
    b = await replica_behind_proxy(rig, fault_proxy)
    size = (rig.tmp / "src/bot/adapter_model.safetensors").stat().st_size
    fault_proxy.slow(size / 2.0)  # the weights take about 2 s
    lags: list[float] = []
    warm_leases = 0

    async def cold() -> float:
        start = time.perf_counter()
        async with b.lease("acme/bot"):
            return time.perf_counter() - start

    task = asyncio.create_task(cold())
    while not task.done():
        tick = time.perf_counter()
        async with b.lease("acme/other"):
            warm_leases += 1
        await asyncio.sleep(0.01)
        lags.append(time.perf_counter() - tick)
    assert await task > 1.5
    assert max(lags) < 0.25, f"event loop stalled {max(lags):.3f}s during the download"
    assert warm_leases > 50


async def test_failing_source_at_registration_is_503_and_changes_nothing(
    rig: Rig, fault_proxy: FaultProxy
) -> None:
    reg = await rig.registry("a", endpoint=fault_proxy.url)
    source = rig.source("bot")
    before = reg.store.list_keys("")
    fault_proxy.match = "src/"
    fault_proxy.fail(100, 500, "InternalError")
    with pytest.raises(AdapterUnavailable) as err:
        await reg.register("bot", source)
    assert err.value.kind is ErrorKind.UNAVAILABLE and err.value.param == "source"
    assert "InternalError" in err.value.message
    assert reg.store.list_keys("") == before and reg.names() == []
    with pytest.raises(AdapterInvalid, match="no such bucket"):
        await reg.register("bot", "s3://no-such-bucket-here/x/")
