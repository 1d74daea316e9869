"""The registry's logic below the HTTP layer: moto S3, real disk cache, a small fake engine.

Two registries pointed at one bucket play two replicas; a registry rebuilt on the same cache
folder plays a restart.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from registry_builders import adapter_config, dense_tensors, write_adapter
from registry_fake_engine import FakeEngine
from registry_rig import Rig, metric

from loraplex.adapters_registry.base import (
    AdapterConflict,
    AdapterInvalid,
    AdapterNotFound,
    AdapterUnavailable,
)
from loraplex.adapters_registry.disk_cache import CacheError
from loraplex.adapters_registry.lifecycle import open_adapter_source
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.adapters_registry.store import ObjectExists

pytestmark = pytest.mark.anyio


async def test_register_lease_and_tiers(rig: Rig) -> None:
    engine = FakeEngine()
    reg = await rig.registry("a", engine)
    info = await reg.register("acme/bot", rig.source("bot"))
    assert info.tier == "disk" and info.rank == 4 and info.base_model == "tiny"
    async with reg.lease("acme/bot") as adapter:
        assert adapter.engine_id == info.engine_id and adapter.version == info.version
        assert (adapter.path / "adapter_model.safetensors").is_file()
        assert reg.info("acme/bot").in_flight == 1
    assert reg.info("acme/bot").tier == "cpu" and set(engine.loaded) == {info.engine_id}
    pinned = await reg.set_pinned("acme/bot", True)
    assert pinned.tier == "gpu" and engine.pinned == {info.engine_id}
    with pytest.raises(AdapterNotFound):
        async with reg.lease("acme/nope"):
            pass
    with pytest.raises(AdapterNotFound):  # malformed names look like unknown ones to clients
        async with reg.lease("../etc"):
            pass


async def test_new_version_new_engine_id_rollback_and_at_version(rig: Rig) -> None:
    reg = await rig.registry("a")
    v1 = await reg.register("bot", rig.source("bot-v1", seed=1))
    same = await reg.register("bot", rig.source("bot-v1", seed=1))
    assert same.version == v1.version and same.engine_id == v1.engine_id
    v2 = await reg.register("bot", rig.source("bot-v2", seed=2))
    assert v2.version != v1.version and v2.engine_id != v1.engine_id
    assert v2.previous_versions == [v1.version]
    async with reg.lease(f"bot@{v1.version[:12]}") as old:
        assert old.engine_id == v1.engine_id
    back = await reg.rollback("bot")
    assert back.version == v1.version and back.previous_versions == []
    with pytest.raises(Exception, match="no earlier version"):
        await reg.rollback("bot")


async def test_fifty_cold_requests_one_download_one_load(rig: Rig) -> None:
    a = await rig.registry("a")
    await a.register("bot", rig.source("bot"))
    engine = FakeEngine(load_delay_s=0.1)
    b = await rig.registry("b", engine)  # a replica with an empty disk cache

    async def request() -> int:
        async with b.lease("bot") as adapter:
            await asyncio.sleep(0.01)
            return adapter.engine_id

    ids = await asyncio.gather(*(request() for _ in range(50)))
    assert len(set(ids)) == 1 and engine.add_calls == 1
    assert metric(b, "loraplex_adapter_loads_total", tier="disk") == 1
    assert metric(b, "loraplex_adapter_cache_misses_total", tier="cpu") == 50


async def test_a_cold_request_counts_one_disk_miss_and_no_hit(rig: Rig) -> None:
    """The gateway's order: the files are prefetched, then loaded. The load finds on disk what
    the prefetch fetched, which is still the request's miss; a later load from disk is a hit."""
    a = await rig.registry("a")
    await a.register("bot", rig.source("bot"))
    b = await rig.registry("b")  # an empty disk cache
    await b.prefetch("bot")
    async with b.lease("bot"):
        pass
    assert metric(b, "loraplex_adapter_cache_misses_total", tier="disk") == 1
    assert metric(b, "loraplex_adapter_cache_hits_total", tier="disk") == 0
    await b.evict("bot", "cpu")
    await b.prefetch("bot")  # on disk: nothing to fetch
    async with b.lease("bot"):
        pass
    assert metric(b, "loraplex_adapter_cache_misses_total", tier="disk") == 1
    assert metric(b, "loraplex_adapter_cache_hits_total", tier="disk") == 1


async def test_replicas_see_each_others_registrations_and_deletions(rig: Rig) -> None:
    a_engine = FakeEngine()
    a, b = await rig.registry("a", a_engine), await rig.registry("b")
    await a.register("acme/one", rig.source("one"))
    await b.refresh()
    assert b.names() == ["acme/one"]
    await b.register("acme/two", rig.source("two", seed=3))
    async with a.lease("acme/one"):
        pass
    await b.delete("acme/one")
    await a.refresh()
    assert a.names() == ["acme/two"] and a_engine.loaded == {}
    with pytest.raises(AdapterNotFound):
        async with a.lease("acme/one"):
            pass
    ids = {a.info("acme/two").engine_id, b.info("acme/two").engine_id}
    assert len(ids) == 1


async def test_restart_keeps_registrations_without_downloading(rig: Rig) -> None:
    reg = await rig.registry("a")
    info = await reg.register("bot", rig.source("bot"))
    reg.cache.close()  # the process ends
    again = await rig.registry("a")  # same cache folder, same store: a restart
    async with again.lease("bot") as adapter:
        assert adapter.engine_id == info.engine_id
    assert metric(again, "loraplex_adapter_cache_hits_total", tier="disk") == 1
    assert metric(again, "loraplex_adapter_loads_total", tier="disk") == 0


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"rank": 64}, "rank"),
        ({"targets": ["q_proj", "wrong_proj"]}, "target_modules"),
        ({"use_dora": True}, "unsupported_feature"),
    ],
)
async def test_bad_adapter_changes_nothing(rig: Rig, config: dict, reason: str) -> None:
    reg = await rig.registry("a")
    await reg.register("good", rig.source("good"))
    before = (reg.store.list_keys(""), reg.cache.cached(), reg.catalog.last_seq)
    with pytest.raises(AdapterInvalid) as err:
        await reg.register("bad", rig.source("bad", seed=5, **config))
    assert err.value.reason == reason
    assert (reg.store.list_keys(""), reg.cache.cached(), reg.catalog.last_seq) == before
    assert metric(reg, "loraplex_adapter_validation_failures_total", reason=reason) == 1
    assert list((rig.tmp / "a" / "disk" / "tmp").iterdir()) == []


async def test_pickle_only_and_missing_sources(rig: Rig) -> None:
    reg = await rig.registry("a")
    rig.s3.put_object(Bucket=rig.bucket, Key="src/pkl/adapter_config.json", Body=b"{}")
    rig.s3.put_object(Bucket=rig.bucket, Key="src/pkl/adapter_model.bin", Body=b"\x80\x04")
    with pytest.raises(AdapterInvalid, match="pickle"):
        await reg.register("pkl", f"s3://{rig.bucket}/src/pkl/")
    with pytest.raises(AdapterInvalid, match=r"no adapter_config\.json"):
        await reg.register("empty", f"s3://{rig.bucket}/src/nothing-here/")
    with pytest.raises(AdapterInvalid, match=r"'\.\.'"):
        await reg.register("a/../b", rig.source("x"))
    assert reg.names() == []


async def test_reserved_and_base_model_names_are_refused_before_any_fetch(rig: Rig) -> None:
    reg = await rig.registry("a")
    before = (reg.store.list_keys(""), reg.cache.cached(), reg.catalog.last_seq)
    for reserved in ("base", "other", "none"):
        with pytest.raises(AdapterInvalid, match="reserved") as err:
            await reg.register(reserved, rig.source("any"))
        assert err.value.param == "name"
    with pytest.raises(AdapterConflict, match="base model's served name") as conflict:
        await reg.register("tiny", rig.source("any"))  # the rig's base model
    assert conflict.value.param == "name"
    assert (reg.store.list_keys(""), reg.cache.cached(), reg.catalog.last_seq) == before
    assert await reg.register("Base", rig.source("any"))  # names are case-sensitive


async def test_pin_unpin_evict_tiers(rig: Rig) -> None:
    engine = FakeEngine()
    reg = await rig.registry("a", engine)
    info = await reg.register("bot", rig.source("bot"), pinned=True)
    assert info.pinned and info.tier == "gpu" and engine.pinned == {info.engine_id}
    with pytest.raises(AdapterConflict, match="unpin it"):
        await reg.evict("bot", "cpu")
    unpinned = await reg.set_pinned("bot", False)
    assert not unpinned.pinned and unpinned.tier == "cpu" and engine.pinned == set()
    assert (await reg.evict("bot", "cpu")).tier == "disk" and engine.loaded == {}
    assert (await reg.evict("bot", "disk")).tier == "s3"
    async with reg.lease("bot") as adapter:  # back from the store on the next request
        assert (adapter.path / "adapter_model.safetensors").is_file()
    assert reg.info("bot").tier == "cpu"


async def test_register_pinned_pins_known_bytes_and_its_own_pin_is_no_conflict(rig: Rig) -> None:
    engine = FakeEngine()
    reg = await rig.registry("a", engine)  # max_loras 2: one pin
    old = await reg.register("bot", rig.source("bot", seed=1))
    await reg.register("bot", rig.source("bot-v2", seed=2))
    # Bytes the name had before: a move in the catalog, which used to drop the pin.
    back = await reg.register("bot", rig.source("bot", seed=1), pinned=True)
    assert back.version == old.version and back.pinned and engine.pinned == {old.engine_id}
    # At the limit, re-registering the pinned name pinned takes over its own pin.
    again = await reg.register("bot", rig.source("bot-v2", seed=2), pinned=True)
    assert again.pinned and again.tier == "gpu" and engine.pinned == {again.engine_id}
    with pytest.raises(AdapterConflict, match="pinned already"):
        await reg.register("second", rig.source("second", seed=3), pinned=True)
    assert "second" not in reg.names()


async def test_a_rollback_whose_write_response_is_lost_applies_once(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    reg = await rig.registry("a")
    v1, v2, v3 = [await reg.register("bot", rig.source(f"b{i}", seed=i)) for i in (1, 2, 3)]
    put = reg.store.put_bytes

    def landed_but_lost(key: str, data: bytes, *, if_absent: bool = False) -> None:
        put(key, data, if_absent=if_absent)
        if key.startswith("catalog/log/"):  # botocore's retry then finds the key taken (412)
            raise ObjectExists(key)

    monkeypatch.setattr(reg.store, "put_bytes", landed_but_lost)
    # Re-planning on a "lost race" to itself rolled back twice, from v3 to v1.
    assert (await reg.rollback("bot")).version == v2.version != v1.version
    assert v3.version not in reg.info("bot").previous_versions


async def test_an_adapter_the_disk_cache_cannot_hold_is_fetched_once_not_retried(
    rig: Rig,
) -> None:
    reg = await rig.registry("a")
    await reg.register("bot", rig.source("bot"))
    await reg.evict("bot", "disk")
    reg.cache.capacity_bytes = 10  # smaller than any adapter: no retry can change that
    with pytest.raises(AdapterUnavailable, match="exceeds the disk cache"):
        async with reg.lease("bot"):
            pass
    assert metric(reg, "loraplex_adapter_load_failures_total", tier="disk") == 1


async def test_unpin_whose_files_left_the_disk_answers_and_the_next_request_reloads(
    rig: Rig,
) -> None:
    engine = FakeEngine()
    reg = await rig.registry("a", engine)
    info = await reg.register("bot", rig.source("bot"), pinned=True)
    shutil.rmtree(reg.cache.path(info.version))  # e.g. an operator cleaned the disk
    unpinned = await reg.set_pinned("bot", False)  # vLLM cannot add it back: no files
    assert not unpinned.pinned and engine.pinned == set() and info.engine_id not in engine.loaded
    async with reg.lease("bot") as adapter:  # fetched again from the store, loaded
        assert (adapter.path / "adapter_model.safetensors").is_file()
    assert reg.info("bot").tier == "cpu"


async def test_unpinning_a_busy_adapter_answers_and_ends_when_it_goes_idle(rig: Rig) -> None:
    engine = FakeEngine()
    reg = await rig.registry("a", engine)
    info = await reg.register("bot", rig.source("bot"), pinned=True)
    async with reg.lease("bot"):  # a request in flight
        unpinned = await reg.set_pinned("bot", False)  # answers after UNPIN_SETTLE_S at most
        assert not unpinned.pinned and engine.pinned == {info.engine_id}
        pinned = await reg.set_pinned("bot", True)  # pinned again: the pending unpin is off
        assert pinned.pinned
    await asyncio.sleep(0.1)
    assert engine.pinned == {info.engine_id} and reg.info("bot").tier == "gpu"
    async with reg.lease("bot"):
        await reg.set_pinned("bot", False)
    await asyncio.sleep(0.1)  # the request ended: removed and added back, unpinned
    assert engine.pinned == set() and reg.info("bot").tier == "cpu"


async def test_pin_replicates_to_other_replicas(rig: Rig) -> None:
    a, b_engine = await rig.registry("a"), FakeEngine()
    b = await rig.registry("b", b_engine)
    info = await a.register("bot", rig.source("bot"))
    await a.set_pinned("bot", True)
    await b.refresh()
    assert b.info("bot").tier == "gpu" and b_engine.pinned == {info.engine_id}
    await a.set_pinned("bot", False)
    await b.refresh()
    assert b.info("bot").tier == "cpu" and b_engine.pinned == set()


async def test_open_adapter_source_seeds_and_polls(rig: Rig, tmp_path: Path) -> None:
    seeds = tmp_path / "seeds"
    write_adapter(seeds / "seeded", adapter_config(), dense_tensors(seed=21))
    # Folders a name cannot take (reserved, the base model's) are skipped, not a failed start.
    write_adapter(seeds / "other", adapter_config(), dense_tensors(seed=22))
    write_adapter(seeds / "tiny", adapter_config(), dense_tensors(seed=23))
    settings = RegistrySettings(
        store=f"s3://{rig.bucket}/registry", s3_endpoint_url=rig.endpoint, poll_interval_s=0.2
    )
    other = await rig.registry("other")
    async with open_adapter_source(
        settings, FakeEngine(), model_dir=rig.model, base_model_name="tiny", max_lora_rank=16,
        max_loras=2, max_cpu_loras=3, cache_root=tmp_path / "served", seed_dir=seeds,
        metrics_registry=CollectorRegistry(),
    ) as served:  # fmt: skip
        assert served.names() == ["seeded"]
        await other.register("late", rig.source("late"))
        deadline = time.monotonic() + 5
        while "late" not in served.names():  # the poll loop, not an explicit refresh
            assert time.monotonic() < deadline, "replica did not converge"
            await asyncio.sleep(0.05)


async def test_pin_follows_the_name_to_a_new_version(rig: Rig) -> None:
    engine = FakeEngine()
    reg = await rig.registry("a", engine)  # max_loras=2: one pin at most
    v1 = await reg.register("bot", rig.source("v1", seed=1), pinned=True)
    v2 = await reg.register("bot", rig.source("v2", seed=2))
    assert v2.pinned and v2.tier == "gpu" and engine.pinned == {v2.engine_id}
    assert v1.engine_id not in engine.pinned


async def test_a_rollback_planned_on_stale_state_to_a_deleted_version_is_refused(
    rig: Rig,
) -> None:
    a, b = await rig.registry("a"), await rig.registry("b")
    v1 = (await a.register("x", rig.source("x1", seed=1))).version
    await a.register("x", rig.source("x2", seed=2))
    await b.refresh()
    await a.delete("x")
    v3 = (await a.register("x", rig.source("x3", seed=3))).version
    # b has not polled since: it still knows x@v1, which the deletion removed.
    with pytest.raises(AdapterNotFound) as err:
        await b.rollback("x", v1)
    assert err.value.param == "version"
    for reg in (a, b, await rig.registry("c")):
        await reg.refresh()
        assert reg.info("x").version == v3 and [i.name for i in reg.list()] == ["x"]


async def test_pins_on_two_replicas_at_once_are_held_to_the_catalogs_limit(rig: Rig) -> None:
    a_engine, b_engine = FakeEngine(), FakeEngine()
    a, b = await rig.registry("a", a_engine), await rig.registry("b", b_engine)  # one pin each
    await a.register("x", rig.source("x", seed=1))
    await a.register("y", rig.source("y", seed=2))
    await b.refresh()
    await a.set_pinned("x", True)
    # b has not polled: its engine has room, so only the catalog can refuse.
    with pytest.raises(AdapterConflict, match="x already pinned in the catalog") as err:
        await b.set_pinned("y", True)
    assert err.value.param == "pinned"
    x_id = b.resolve("x").engine_id
    assert not b.info("y").pinned and b.info("x").pinned and b_engine.pinned == {x_id}
    await a.refresh()
    assert a_engine.pinned == {x_id} and not a.info("y").pinned


async def test_a_local_source_whose_files_link_out_of_it_registers(
    rig: Rig, tmp_path: Path
) -> None:
    """A Hugging Face hub snapshot: each file a link to ../../blobs/<hash>."""
    rig.source("linked")
    files = rig.tmp / "src" / "linked"  # the folder rig.source wrote
    snapshot = tmp_path / "hub" / "snapshots" / "rev"
    (tmp_path / "hub" / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in files.iterdir():
        blob = tmp_path / "hub" / "blobs" / f.name
        shutil.copyfile(f, blob)
        (snapshot / f.name).symlink_to(Path("../..") / "blobs" / f.name)
    reg = await rig.registry("a")
    info = await reg.register("linked", str(snapshot))
    assert info.version and reg.names() == ["linked"]


async def test_the_disk_cache_keeps_a_version_from_its_fetch_to_its_load(rig: Rig) -> None:
    """Another download making room right after x's fetch must not evict x before its load."""
    reg = await rig.registry("a")
    x = reg.resolve((await reg.register("x", rig.source("x", seed=1))).name)
    y = reg.resolve((await reg.register("y", rig.source("y", seed=2))).name)
    for version in (x.version, y.version):
        reg.cache.evict(version)
    reg.cache.capacity_bytes = int(x.size_bytes * 1.5)  # room for one adapter
    fetch_x = reg.residency._on_disk

    async def fetch_then_another_download(record: Any) -> bool:
        fetched = await fetch_x(record)
        get = lambda e, dest: reg.store.download(f"blobs/sha256/{e.sha256}", dest)  # noqa: E731
        with pytest.raises(CacheError, match="full of adapters in use"):  # x is, from now on
            await asyncio.to_thread(reg.cache.fetch, y.version, y.files, get)
        return fetched

    reg.residency._on_disk = fetch_then_another_download  # type: ignore[method-assign]
    async with reg.lease("x") as adapter:
        assert adapter.path.exists()
