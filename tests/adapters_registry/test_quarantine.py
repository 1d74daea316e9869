"""Quarantine: a version taken out of service on every replica through the real catalog (moto
S3), out of the engine once its in-flight leases end, back by an admin's word or a new version.
The engine is the small fake; the catalog, stores and disk cache are the real ones."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest
from registry_fake_engine import FakeEngine
from registry_rig import Rig, metric

from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.base import AdapterConflict, AdapterQuarantined, ErrorKind
from loraplex.adapters_registry.catalog import VersionHealth
from tests.support.s3_fault_proxy import FaultProxy

pytestmark = pytest.mark.anyio


async def settled(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Whether `condition` holds within `timeout_s`, the background removals given their turn."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return condition()


async def refused(reg: ManagedRegistry, model: str) -> AdapterQuarantined:
    with pytest.raises(AdapterQuarantined) as err:
        reg.resolve(model)
    with pytest.raises(AdapterQuarantined):
        await reg.prefetch(model)
    with pytest.raises(AdapterQuarantined):
        async with reg.lease(model):
            pass
    return err.value


async def test_quarantine_refuses_new_requests_and_unloads_once_in_flight_ones_end(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    engine, other_engine = FakeEngine(), FakeEngine()
    a = await rig.registry("a", engine)
    info = await a.register("acme/bot", rig.source("bot"), pinned=True)
    b = await rig.registry("b", other_engine)  # another replica, which has it loaded too
    async with b.lease("acme/bot"):
        pass
    assert engine.pinned == {info.engine_id} and info.engine_id in other_engine.loaded

    with caplog.at_level(logging.WARNING, "loraplex.adapters_registry.quarantine"):
        async with a.lease("acme/bot") as held:  # the guard's own request holds a lease
            await a.quarantine("acme/bot", info.version, "non-finite logits\nin request r-1")
            error = await refused(a, "acme/bot")
            assert info.engine_id in engine.loaded  # in-flight leases finish first
            assert held.engine_id == info.engine_id
    assert error.kind is ErrorKind.UNPROCESSABLE and error.code == "adapter_quarantined"
    assert error.param == "model"
    assert "`acme/bot` is quarantined" in error.message
    assert "non-finite logits in request r-1" in error.message  # one line
    assert await settled(lambda: info.engine_id not in engine.loaded)
    assert engine.pinned == set()
    lines = [r.getMessage() for r in caplog.records if "quarantined:" in r.getMessage()]
    assert lines == [
        f"adapter acme/bot version {info.version} (engine id {info.engine_id}) quarantined: "
        "non-finite logits in request r-1"
    ]

    shown = a.info("acme/bot")
    assert shown.health == VersionHealth.QUARANTINED.value == "quarantined"
    assert shown.quarantine_reason == "non-finite logits in request r-1"
    assert shown.pinned and shown.tier == "disk"  # the name's pin waits for the quarantine
    assert metric(a, "loraplex_adapter_quarantines_total") == 1
    assert metric(a, "loraplex_adapters_quarantined") == 1

    await b.refresh()  # the other replica's poll
    await refused(b, "acme/bot")
    assert await settled(lambda: info.engine_id not in other_engine.loaded)
    assert metric(b, "loraplex_adapters_quarantined") == 1
    assert metric(b, "loraplex_adapter_quarantines_total") == 0  # a's, not b's

    await a.refresh()  # the poll's reconcile does not pin it back
    assert engine.loaded == {} and engine.pinned == set()


async def test_quarantine_is_idempotent_and_ignores_unknown_versions(rig: Rig) -> None:
    reg = await rig.registry("a")
    info = await reg.register("bot", rig.source("bot"))
    await reg.quarantine("bot", info.version, "first")
    seq = reg.catalog.last_seq
    await reg.quarantine("bot", info.version, "second")
    assert reg.catalog.last_seq == seq
    assert reg.info("bot").quarantine_reason == "first"
    assert metric(reg, "loraplex_adapter_quarantines_total") == 1
    await reg.quarantine("bot", "f" * 64, "no such version")  # nothing to do, nothing raised
    await reg.quarantine("nobody", info.version, "no such name")
    assert reg.catalog.last_seq == seq
    long = await rig.registry("b")
    other = await long.register("long", rig.source("long", seed=3))
    await long.quarantine("long", other.version, "x" * 5000)
    reason = long.info("long").quarantine_reason
    assert reason is not None and len(reason) == 200 and reason.endswith("...")


async def test_unquarantine_new_version_and_rollback(rig: Rig) -> None:
    engine = FakeEngine()
    reg = await rig.registry("a", engine)
    v1 = await reg.register("bot", rig.source("bot-v1", seed=1), pinned=True)
    await reg.quarantine("bot", v1.version, "bad")
    assert await settled(lambda: engine.pinned == set())

    cleared = await reg.set_quarantined("bot", False)
    assert cleared.health == "healthy" and cleared.quarantine_reason is None
    assert cleared.tier == "gpu" and engine.pinned == {v1.engine_id}  # its pin is back
    async with reg.lease("bot"):
        pass
    assert (await reg.set_quarantined("bot", False)).health == "healthy"  # idempotent

    await reg.set_quarantined("bot", True, reason="admin says so")
    v2 = await reg.register("bot", rig.source("bot-v2", seed=2))  # new bytes: healthy
    assert v2.health == "healthy"
    async with reg.lease("bot") as adapter:
        assert adapter.version == v2.version
    await refused(reg, f"bot@{v1.version[:12]}")  # the old version stays quarantined
    with pytest.raises(AdapterConflict, match="quarantined") as err:
        await reg.rollback("bot")
    assert err.value.param == "version"
    # Registering the quarantined bytes again names them again, quarantine and all.
    again = await reg.register("bot", rig.source("bot-v1", seed=1))
    assert again.version == v1.version and again.health == "quarantined"
    await refused(reg, "bot")


async def test_a_quarantine_during_a_cold_load_refuses_the_waiting_request(rig: Rig) -> None:
    engine = FakeEngine(load_delay_s=0.3)
    reg = await rig.registry("a", engine)
    info = await reg.register("bot", rig.source("bot"))

    async def request() -> None:
        async with reg.lease("bot"):
            pass

    waiting = asyncio.create_task(request())
    await asyncio.sleep(0.1)  # inside the engine's load
    await reg.quarantine("bot", info.version, "bad")
    with pytest.raises(AdapterQuarantined):
        await waiting
    assert await settled(lambda: info.engine_id not in engine.loaded)
    assert reg.tiers.loaded_ids() == set()


async def test_a_quarantine_the_store_cannot_record_holds_here_and_lands_at_the_next_poll(
    rig: Rig, s3_endpoint: str
) -> None:
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port), match="catalog")
    try:
        a = await rig.registry("a")
        info = await a.register("bot", rig.source("bot"))
        b = await rig.registry("b", endpoint=proxy.url)
        proxy.fail(1000, 503, "SlowDown")  # every catalog read from b fails
        await b.quarantine("bot", info.version, "non-finite logits")  # no exception
        await refused(b, "bot")
        await a.refresh()
        assert a.info("bot").health == "healthy"  # not in the catalog yet
        proxy.clear()
        await b.refresh()  # the next poll writes it
        await a.refresh()
        await refused(a, "bot")
        assert a.info("bot").quarantine_reason == "non-finite logits"
        assert metric(b, "loraplex_adapter_quarantines_total") == 1
    finally:
        proxy.close()


async def test_quarantine_survives_a_restart_through_the_snapshot(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraplex.adapters_registry import catalog_sync

    monkeypatch.setattr(catalog_sync, "SNAPSHOT_EVERY", 2)  # the quarantine is in a snapshot
    reg = await rig.registry("a")
    info = await reg.register("bot", rig.source("bot"))
    await reg.quarantine("bot", info.version, "bad")
    assert reg.catalog.last_seq == 2 and reg.store.list_keys("catalog/snapshot/")
    for key in reg.store.list_keys("catalog/log/"):  # only the snapshot tells
        rig.s3.delete_object(Bucket=rig.bucket, Key=f"registry/{key}")
    reg.cache.close()
    again = await rig.registry("a")
    await refused(again, "bot")
    assert again.info("bot").quarantine_reason == "bad"
