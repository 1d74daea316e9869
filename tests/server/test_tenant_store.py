"""The tenant store on the adapter catalog's log, against moto's real S3 server on loopback.

Each `Replica` is what the server builds (`server/app.py`): a catalog and its sync on the shared
bucket, the tenant store on that sync, the tenant directory on the store; `poll` is the
registry's poll (`CatalogSync.refresh`). Its S3 store counts the requests it makes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from loraplex.adapters_registry import catalog_sync
from loraplex.adapters_registry.catalog import LOG_PREFIX, Catalog
from loraplex.adapters_registry.catalog_sync import CatalogSync
from loraplex.adapters_registry.events import PinSet, RecordsChanged
from loraplex.adapters_registry.local_store import LocalStore
from loraplex.adapters_registry.metrics import RegistryMetrics
from loraplex.adapters_registry.s3_store import S3Store
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.errors import TenantConflict, TenantStoreUnavailable, Unauthorized
from loraplex.server.tenancy.keys import HashedKey, new_key
from loraplex.server.tenancy.model import Tenant, TenantSource
from loraplex.server.tenancy.settings import Quotas, TenancySettings
from loraplex.server.tenancy.store import NAMESPACE, TenantStore
from tests.support.moto_s3 import moto_s3
from tests.support.s3_fault_proxy import FaultProxy

ADMIN = "admin-token-0123456789abcdef"
PREFIX = "shared"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_s3() as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint: str) -> str:
    name = f"tenants-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return name


class CountingS3Store(S3Store):
    """The S3 store, counting its GETs and its LISTs by prefix."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gets = 0
        self.lists: Counter[str] = Counter()

    def get_bytes(self, key: str) -> bytes:
        self.gets += 1
        return super().get_bytes(key)

    def list_keys(self, prefix: str, start_after: str = "", *, nested: bool = True) -> list[str]:
        self.lists[prefix] += 1
        return super().list_keys(prefix, start_after, nested=nested)


class Replica:
    def __init__(self, bucket: str, endpoint: str, **settings: Any) -> None:
        registry = RegistrySettings(s3_endpoint_url=endpoint, **settings)
        self.s3 = CountingS3Store(bucket, PREFIX, registry)
        self.sync = CatalogSync(Catalog(self.s3), RegistryMetrics(CollectorRegistry()))
        self.store = TenantStore(self.sync, "tenants/")
        self.directory = TenantDirectory(TenancySettings(), self.store, SecretStr(ADMIN))

    async def start(self) -> Replica:
        await self.sync.refresh()
        await self.directory.start()
        return self

    async def poll(self) -> None:
        await self.sync.refresh()


def bucket_bytes(bucket: str, endpoint: str) -> bytes:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", [])]
    return b"".join(s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys)


def logged_ops(replica: Replica) -> list[str]:
    store = replica.s3
    return [json.loads(store.get_bytes(k))["op"] for k in store.list_keys(LOG_PREFIX)]


def legacy_tenant(tenant_id: str, key: str) -> dict[str, Any]:
    """A record as the previous release's store wrote it."""
    tenant = Tenant(
        id=tenant_id, display_name=tenant_id, weight=2.0, quotas=Quotas(max_concurrent=3),
        source=TenantSource.STORE, keys=(HashedKey.of(key),), created_at=1.0,
    )  # fmt: skip
    return tenant.to_record()


def test_every_change_reaches_another_replica_at_its_next_poll(
    bucket: str, s3_endpoint: str
) -> None:
    async def run() -> None:
        a = await Replica(bucket, s3_endpoint).start()
        b = await Replica(bucket, s3_endpoint).start()
        assert a.directory.open_mode and b.directory.open_mode
        created, key = await a.directory.create("initech", "Initech", 3.0, Quotas())
        assert a.directory.authenticate(key).id == created.id == "initech"
        with pytest.raises(TenantConflict):
            await b.directory.create("initech", "", 1.0, Quotas())  # planned on the fresh log
        assert not b.directory.open_mode and b.directory.authenticate(key).weight == 3.0

        await a.directory.update("initech", weight=5.0, quotas=Quotas(requests_per_minute=60))
        assert b.directory.get("initech").weight == 3.0  # until b polls
        await b.poll()
        seen = b.directory.authenticate(key)
        assert (seen.weight, seen.quotas.requests_per_minute) == (5.0, 60)

        _, rotated = await a.directory.rotate_key("initech")
        _, kept = await a.directory.rotate_key("initech", keep_old=True)
        await b.poll()
        with pytest.raises(Unauthorized):
            b.directory.authenticate(key)
        assert b.directory.authenticate(rotated).id == b.directory.authenticate(kept).id

        _, other = await b.directory.create("hooli", "", 1.0, Quotas())
        await a.directory.delete("initech")
        await b.poll()
        with pytest.raises(Unauthorized):
            b.directory.authenticate(kept)
        assert [t.id for t in b.directory.tenants()] == ["hooli"]
        restarted = await Replica(bucket, s3_endpoint).start()
        assert restarted.directory.authenticate(other).id == "hooli"
        assert [t.id for t in restarted.directory.tenants()] == ["hooli"]
        stored = bucket_bytes(bucket, s3_endpoint)
        assert all(k.encode() not in stored for k in (key, rotated, kept, other))

    asyncio.run(run())


@pytest.mark.parametrize("tenants", [3, 300])
def test_an_idle_poll_costs_one_get_however_many_tenants(
    bucket: str, s3_endpoint: str, tenants: int
) -> None:
    async def run() -> None:
        writer = await Replica(bucket, s3_endpoint).start()
        records = {f"t{i:04d}": legacy_tenant(f"t{i:04d}", new_key()) for i in range(tenants)}
        await writer.sync.append(lambda: RecordsChanged(name=NAMESPACE, changes=records))
        follower = await Replica(bucket, s3_endpoint).start()
        assert len(follower.directory.tenants()) == tenants
        assert follower.s3.lists["tenants/"] == 0  # the log has tenants: nothing to import
        follower.s3.gets, follower.s3.lists = 0, Counter()
        for _ in range(3):
            await follower.poll()
            assert len(follower.directory.tenants()) == tenants
        assert (follower.s3.gets, sum(follower.s3.lists.values())) == (3, 0)
        await writer.directory.update("t0001", weight=7.0)
        await follower.poll()  # the new entry, then the 404 of the next
        assert (follower.s3.gets, sum(follower.s3.lists.values())) == (5, 0)
        assert follower.directory.get("t0001").weight == 7.0

    asyncio.run(run())


def test_a_bad_record_is_skipped_once_with_an_error_and_the_others_load(
    bucket: str, s3_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A record written by hand, or before a bound existed, must neither poison the fair queue
    nor stop every other tenant from loading; it is logged once, not at every poll."""
    evil_key = new_key()

    async def run() -> None:
        a = await Replica(bucket, s3_endpoint).start()
        _, good = await a.directory.create("initech", "", 1.0, Quotas())
        bad = {
            "evil": {**legacy_tenant("evil", evil_key), "weight": 5e-324},
            "junk": ["not", "an", "object"],
            "alias": legacy_tenant("initech", evil_key),
            "Evil": legacy_tenant("Evil", evil_key),
        }
        await a.sync.append(lambda: RecordsChanged(name=NAMESPACE, changes=bad))
        b = await Replica(bucket, s3_endpoint).start()
        for replica in (a, b):
            assert replica.directory.authenticate(good).id == "initech"
            with pytest.raises(Unauthorized):
                replica.directory.authenticate(evil_key)
            assert [t.id for t in replica.directory.tenants()] == ["initech"]
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        await a.directory.create("hooli", "", 1.0, Quotas())
        await b.poll()
        assert [t.id for t in b.directory.tenants()] == ["hooli", "initech"]
        again = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert again == errors  # nothing logged again for the records that did not change

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    text = caplog.text
    assert "`evil` in the catalog's log is invalid" in text and "0.001" in text
    assert "`junk` in the catalog's log is invalid" in text and "JSON object" in text
    assert "`alias` in the catalog's log is invalid" in text and "'initech'" in text
    assert "`Evil` in the catalog's log is invalid" in text


def test_a_store_written_by_the_previous_release_is_imported_once(
    bucket: str, s3_endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    keys = {tid: new_key() for tid in ("acme", "globex", "gone")}
    legacy = S3Store(bucket, PREFIX, RegistrySettings(s3_endpoint_url=s3_endpoint))
    for tid, key in keys.items():
        legacy.put_bytes(f"tenants/{tid}.json", json.dumps(legacy_tenant(tid, key)).encode())
    legacy.put_bytes("tenants/gone.json", json.dumps({"id": "gone", "deleted": True}).encode())
    evil = {**legacy_tenant("evil", new_key()), "quotas": {"tokens_per_minute": 10**400}}
    legacy.put_bytes("tenants/evil.json", json.dumps(evil).encode())
    legacy.put_bytes("tenants/junk.json", b"[not json")

    async def run() -> None:
        first, second = Replica(bucket, s3_endpoint), Replica(bucket, s3_endpoint)
        await asyncio.gather(first.start(), second.start())  # both find no tenants in the log
        assert logged_ops(first) == ["records"]  # one import: the second planned it again
        later = await Replica(bucket, s3_endpoint).start()
        assert later.s3.lists["tenants/"] == 0
        for replica in (first, second, later):
            assert [t.id for t in replica.directory.tenants()] == ["acme", "globex"]
            acme = replica.directory.authenticate(keys["acme"])
            assert (acme.weight, acme.quotas.max_concurrent) == (2.0, 3)
            with pytest.raises(Unauthorized):
                replica.directory.authenticate(keys["gone"])
        legacy.put_bytes("tenants/late.json", json.dumps(legacy_tenant("late", new_key())).encode())
        assert [t.id for t in (await Replica(bucket, s3_endpoint).start()).directory.tenants()] == [
            "acme",
            "globex",
        ]

    with caplog.at_level(logging.INFO):
        asyncio.run(run())
    assert "tenant record tenants/evil.json is invalid and is not imported" in caplog.text
    assert "tenant record tenants/junk.json is invalid and is not imported" in caplog.text
    assert caplog.text.count("imported 2 tenants") == 1


def test_changes_from_two_replicas_never_undo_each_other_and_keep_a_key(
    bucket: str, s3_endpoint: str
) -> None:
    async def run() -> None:
        a = await Replica(bucket, s3_endpoint).start()
        b = await Replica(bucket, s3_endpoint).start()
        _, x_key = await a.directory.create("x", "", 1.0, Quotas())
        await a.directory.create("y", "", 1.0, Quotas())
        await b.poll()
        # b has not seen a's next two changes when it makes its own: each is planned again on
        # the log's state once a's write took its sequence number.
        await a.directory.update("y", weight=9.0)
        _, y_key = await b.directory.rotate_key("y")
        y = b.directory.get("y")
        assert (y.weight, len(y.keys)) == (9.0, 1)
        await a.directory.delete("x")
        with pytest.raises(TenantConflict, match="open mode"):
            await b.directory.delete("y")  # the last keyed tenant, once x's deletion is read
        await a.poll()
        assert a.directory.authenticate(y_key).weight == 9.0 and not a.directory.open_mode
        with pytest.raises(Unauthorized):
            a.directory.authenticate(x_key)

    asyncio.run(run())


def test_tenants_ride_snapshots_whoever_writes_them(
    bucket: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot written by a replica of the registry alone (no tenant directory) still carries
    the tenants, so a start from it knows every key."""
    monkeypatch.setattr(catalog_sync, "SNAPSHOT_EVERY", 4)

    async def run() -> None:
        a = await Replica(bucket, s3_endpoint).start()
        _, key = await a.directory.create("initech", "", 1.0, Quotas())
        adapters_only = catalog_sync.CatalogSync(
            Catalog(S3Store(bucket, PREFIX, RegistrySettings(s3_endpoint_url=s3_endpoint))),
            RegistryMetrics(CollectorRegistry()),
        )
        for _ in range(4):
            await adapters_only.append(lambda: PinSet(name="absent", pinned=True))
        started = await Replica(bucket, s3_endpoint).start()
        assert started.s3.gets == 2  # the snapshot at 4, then entry 5 (listed after it)
        assert started.directory.authenticate(key).id == "initech"

    asyncio.run(run())


def test_a_failing_store_is_503_and_changes_nothing(bucket: str, s3_endpoint: str) -> None:
    host, port = s3_endpoint.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port), match=LOG_PREFIX)

    async def run() -> None:
        a = await Replica(bucket, proxy.url, s3_max_attempts=2).start()
        await a.directory.create("hooli", "", 1.0, Quotas())  # past an empty log's listings
        proxy.fail(10, 503, "SlowDown")
        with pytest.raises(TenantStoreUnavailable) as refused:
            await a.directory.create("initech", "", 1.0, Quotas())
        assert refused.value.status == 503
        assert refused.value.message.startswith("Tenants could not be changed")
        proxy.clear()
        await a.poll()
        assert [t.id for t in a.directory.tenants()] == ["hooli"]

    try:
        asyncio.run(run())
    finally:
        proxy.close()


def test_the_local_store_keeps_tenants_in_its_log(tmp_path: Path) -> None:
    """The local store (registry.store unset) is the same log in a directory."""

    async def run() -> None:
        sync = CatalogSync(Catalog(LocalStore(tmp_path)), RegistryMetrics(CollectorRegistry()))
        directory = TenantDirectory(TenancySettings(), TenantStore(sync, "tenants/"), None)
        await sync.refresh()
        await directory.start()
        assert directory.open_mode
        _, key = await directory.create("initech", "", 1.0, Quotas())
        assert not directory.open_mode and directory.authenticate(key).id == "initech"
        assert not (tmp_path / "tenants").exists()

    asyncio.run(run())
