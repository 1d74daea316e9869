"""Pure logic of tenancy: keys, settings, namespaces, quotas, the tenant directory.

The directory's durable store here is the registry's real LocalStore on a temporary directory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr, ValidationError

from loraplex.adapters_registry.local_store import LocalStore
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.tenancy.admission import Admission
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.errors import QueueFull, RateLimited, TenantConflict, Unauthorized
from loraplex.server.tenancy.keys import HashedKey, lookup_id, new_key
from loraplex.server.tenancy.model import Tenant, TenantSource
from loraplex.server.tenancy.quotas import QuotaGate, TokenBucket
from loraplex.server.tenancy.record import RequestRecord
from loraplex.server.tenancy.service import Tenancy
from loraplex.server.tenancy.settings import Quotas, TenancySettings, TenantConfig
from loraplex.server.tenancy.store import TenantStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def settings(**kw: object) -> TenancySettings:
    return TenancySettings.model_validate(kw)


ACME_KEY = "acme-key-0123456789abcdef"
GLOBEX_KEY = "globex-key-0123456789abcdef"
ADMIN = "admin-token-0123456789abcdef"


def two_tenants(**kw: object) -> TenancySettings:
    return settings(
        tenants=[
            {"id": "acme", "api_keys": [ACME_KEY], "weight": 2},
            {"id": "globex", "api_keys": [GLOBEX_KEY]},
        ],
        **kw,
    )


# --- keys --------------------------------------------------------------------------------------
def test_hashed_key_matches_only_its_key_and_stores_no_plaintext() -> None:
    key = new_key()
    hashed = HashedKey.of(key)
    assert hashed.matches(key)
    assert not hashed.matches(key[:-1] + ("A" if key[-1] != "A" else "B"))
    assert key not in str(hashed.to_json())
    assert HashedKey.from_json(hashed.to_json()) == hashed


def test_same_key_hashed_twice_gets_different_salts() -> None:
    key = new_key()
    a, b = HashedKey.of(key), HashedKey.of(key)
    assert a.salt != b.salt and a.digest != b.digest
    assert a.lookup_id == b.lookup_id == lookup_id(key)


def test_new_keys_are_unique_and_long() -> None:
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(len(k) >= 40 and k.startswith("lpx-") for k in keys)


# --- settings ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tenant", "field"),
    [
        ({"id": "Acme"}, "id"),
        ({"id": "аcme"}, "id"),  # Cyrillic а
        ({"id": "a/b"}, "id"),
        ({"id": "acme", "api_keys": ["short"]}, "api_keys"),
        ({"id": "acme", "weight": 0}, "weight"),
        ({"id": "acme", "quotas": {"tokens_per_minute": -1}}, "tokens_per_minute"),
    ],
)
def test_bad_tenant_config_names_the_field(tenant: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        TenantConfig.model_validate(tenant)
    assert field in str(e.value)


def test_duplicate_ids_and_shared_keys_are_refused() -> None:
    with pytest.raises(ValidationError, match="duplicate tenant ids"):
        settings(tenants=[{"id": "a"}, {"id": "a"}])
    with pytest.raises(ValidationError, match="same api key"):
        settings(tenants=[{"id": "a", "api_keys": [ACME_KEY]}, {"id": "b", "api_keys": [ACME_KEY]}])


# --- namespaces --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        ("acme/bot", True),
        ("acme/bot@3f2a", True),
        ("shared-demo", True),
        ("globex/bot", False),
        ("globex/bot@3f2a", False),
        ("Acme/bot", False),
        ("ACME/bot", False),
        ("аcme/bot", False),  # Cyrillic а
        ("acme\u200b/bot", False),  # zero-width space
        ("acme/../globex/bot", False),
        ("acme/globex/bot", False),
        ("acme/..", False),
        ("acme/bοt", False),  # Greek ο in the adapter part
        ("acme/", False),
    ],
)
def test_tenant_may_use_only_its_namespace(name: str, allowed: bool) -> None:
    directory = TenantDirectory(two_tenants(), None, None)
    acme = directory.authenticate(ACME_KEY)
    assert acme.may_use(name) is allowed


def test_global_adapters_can_be_unshared() -> None:
    acme = TenantDirectory(two_tenants(), None, None).authenticate(ACME_KEY)
    assert not acme.may_use("shared-demo", share_global=False)


# --- quotas ------------------------------------------------------------------------------------
def test_token_bucket_refills_continuously_up_to_one_minute() -> None:
    clock = FakeClock()
    bucket = TokenBucket(60, clock)
    assert all(bucket.try_take() == 0.0 for _ in range(60))
    assert bucket.try_take() == pytest.approx(1.0)
    clock.now += 0.5
    assert bucket.try_take() == pytest.approx(0.5)
    clock.now += 3600
    assert all(bucket.try_take() == 0.0 for _ in range(60))
    assert bucket.try_take() > 0


def test_quota_gate_reasons_and_retry_after() -> None:
    clock = FakeClock()
    gate = QuotaGate(Quotas(max_concurrent=2, requests_per_minute=3, tokens_per_minute=600), clock)
    gate.admit()
    gate.admit()
    with pytest.raises(RateLimited) as e:
        gate.admit()
    assert e.value.reason == "max_concurrent" and e.value.headers["Retry-After"] == "1"
    gate.release(0)
    gate.admit()
    gate.release(0)
    gate.release(0)
    with pytest.raises(RateLimited) as e:
        gate.admit()
    assert e.value.reason == "requests_per_minute"
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
    assert e.value.headers["Retry-After"] == "20"  # 1 request per 20 s
    clock.now += 20
    gate.admit()
    gate.release(1200)  # 600 tokens of debt: 60 s to repay at 10 tokens/s
    with pytest.raises(RateLimited) as e:
        gate.admit()
    assert e.value.reason == "tokens_per_minute"
    assert int(e.value.headers["Retry-After"]) == 60


def test_changed_quotas_apply_without_losing_in_flight_count() -> None:
    admission = Admission(settings())
    directory = TenantDirectory(two_tenants(), None, None)
    acme = directory.authenticate(ACME_KEY)

    async def run() -> None:
        first = admission.enter(acme)
        tighter = acme.__class__(**{**acme.__dict__, "quotas": Quotas(max_concurrent=1)})
        with pytest.raises(RateLimited):
            admission.enter(tighter)
        first.close(0)
        admission.enter(tighter).close(0)

    asyncio.run(run())


def test_queue_full_refuses_without_counting_against_quota() -> None:
    clock = FakeClock()  # no refill during the test
    admission = Admission(settings(max_running=1, max_queued=1), clock)
    acme = TenantDirectory(two_tenants(), None, None).authenticate(ACME_KEY)
    acme = acme.__class__(**{**acme.__dict__, "quotas": Quotas(requests_per_minute=3)})

    async def run() -> None:
        running = admission.enter(acme)
        queued = admission.enter(acme)
        for _ in range(5):  # each refused for the queue, none for the request rate
            with pytest.raises(QueueFull) as e:
                admission.enter(acme)
            assert e.value.status == 503
        running.close(0)
        queued.close(0)
        admission.enter(acme).close(0)  # the third of the minute's three
        with pytest.raises(RateLimited):
            admission.enter(acme)

    asyncio.run(run())


def test_a_quota_edit_keeps_token_debt() -> None:
    clock = FakeClock()
    gate = QuotaGate(Quotas(tokens_per_minute=600), clock)
    gate.admit()
    gate.release(1200)  # 600 tokens of debt: a minute at 600 per minute
    gate.set_quotas(Quotas(tokens_per_minute=1200))
    with pytest.raises(RateLimited) as e:
        gate.admit()
    assert e.value.retry_after == pytest.approx(30.0)  # 600 of debt at 1,200 per minute


# --- directory ---------------------------------------------------------------------------------
def test_open_mode_without_keys_and_admin_token_never_a_tenant_key() -> None:
    directory = TenantDirectory(settings(), None, SecretStr(ADMIN))
    assert directory.open_mode
    assert "no API keys configured" in directory.describe_mode()
    assert directory.authenticate(None).source is TenantSource.DEFAULT
    assert directory.authenticate("anything").id == "default"
    with pytest.raises(Unauthorized):
        directory.authenticate(ADMIN)
    assert directory.is_admin(ADMIN)
    assert not directory.is_admin("admin-token-0123456789abcdeX")
    assert not directory.is_admin(None)


def test_authenticate_by_key() -> None:
    directory = TenantDirectory(two_tenants(), None, SecretStr(ADMIN))
    assert not directory.open_mode
    assert directory.authenticate(ACME_KEY).id == "acme"
    assert directory.authenticate(GLOBEX_KEY).id == "globex"
    for bad in (None, "", "wrong-key-0123456789", ACME_KEY.upper(), ACME_KEY + " ", ADMIN):
        with pytest.raises(Unauthorized):
            directory.authenticate(bad)
    assert not directory.is_admin(ACME_KEY)


def test_config_key_equal_to_admin_token_is_refused() -> None:
    with pytest.raises(ValueError, match="admin_token"):
        TenantDirectory(
            settings(tenants=[{"id": "acme", "api_keys": [ADMIN]}]), None, SecretStr(ADMIN)
        )


def test_stored_tenants_survive_a_restart_and_keys_rotate(tmp_path: Path) -> None:
    def directory() -> TenantDirectory:
        store = TenantStore(LocalStore(tmp_path), "tenants/")
        return TenantDirectory(two_tenants(), store, SecretStr(ADMIN))

    async def run() -> None:
        first = directory()
        await first.load()
        created, key = await first.create("initech", "Initech", 3.0, Quotas(max_concurrent=4))
        assert first.authenticate(key).id == created.id == "initech"
        assert key not in (tmp_path / "tenants" / "initech.json").read_text()
        with pytest.raises(TenantConflict):
            await first.create("initech", "", 1.0, Quotas())
        with pytest.raises(TenantConflict):
            await first.create("acme", "", 1.0, Quotas())
        with pytest.raises(TenantConflict):
            await first.update("acme", weight=5)

        second = directory()
        await second.load()
        restored = second.authenticate(key)
        assert (restored.weight, restored.quotas.max_concurrent) == (3.0, 4)

        _, new = await second.rotate_key("initech")
        with pytest.raises(Unauthorized):
            second.authenticate(key)
        assert second.authenticate(new).id == "initech"
        _, kept = await second.rotate_key("initech", keep_old=True)
        assert second.authenticate(new).id == second.authenticate(kept).id == "initech"

        await first.load()  # another replica follows the store
        with pytest.raises(Unauthorized):
            first.authenticate(key)
        assert first.authenticate(kept).id == "initech"

        await second.delete("initech")
        await first.load()
        with pytest.raises(Unauthorized):
            first.authenticate(kept)
        assert [t.id for t in first.tenants()] == ["acme", "globex"]

    asyncio.run(run())


class SlowStore(TenantStore):
    """Answers `load_all` with what the store held `delay_s` earlier, like a slow read."""

    delay_s = 0.0

    async def load_all(self) -> dict[str, Tenant]:
        stored = await super().load_all()
        await asyncio.sleep(self.delay_s)
        return stored


def test_a_poll_in_flight_never_brings_back_rotated_keys(tmp_path: Path) -> None:
    async def run() -> None:
        store = SlowStore(LocalStore(tmp_path), "tenants/")
        directory = TenantDirectory(settings(), store, SecretStr(ADMIN))
        _, old = await directory.create("initech", "", 1.0, Quotas())
        store.delay_s = 0.1
        poll = asyncio.create_task(directory.load())  # reads the store before the rotation
        await asyncio.sleep(0.01)
        store.delay_s = 0.0
        _, new = await directory.rotate_key("initech")
        await poll
        assert directory.authenticate(new).id == "initech"
        with pytest.raises(Unauthorized):
            directory.authenticate(old)

    asyncio.run(run())


def test_deleting_the_last_keyed_tenant_is_refused_not_open_mode(tmp_path: Path) -> None:
    async def run() -> None:
        directory = TenantDirectory(settings(), TenantStore(LocalStore(tmp_path), "t/"), None)
        assert directory.open_mode
        await directory.create("initech", "", 1.0, Quotas())
        with pytest.raises(TenantConflict, match="open mode"):
            await directory.delete("initech")
        assert not directory.open_mode
        _, key = await directory.create("hooli", "", 1.0, Quotas())
        await directory.delete("initech")
        assert directory.authenticate(key).id == "hooli" and not directory.open_mode

    asyncio.run(run())


def test_public_view_shows_no_secret() -> None:
    directory = TenantDirectory(two_tenants(), None, None)
    view = str(directory.get("acme").public_view())
    hashed = directory.get("acme").keys[0]
    assert ACME_KEY not in view and hashed.digest not in view and hashed.salt not in view
    assert hashed.key_id in view


# --- what a request is charged -----------------------------------------------------------------
def test_a_request_that_never_reached_the_engine_is_charged_no_tokens() -> None:
    """A cold adapter whose download fails after admission (503), or a client gone while
    queued: the engine processed none of the prompt, so neither the quota nor the token
    metrics count it. A request the engine took is charged its prompt and output."""
    config = settings(tenants=[{"id": "acme", "api_keys": [ACME_KEY],
                                "quotas": {"tokens_per_minute": 1000}}])  # fmt: skip
    metrics = GatewayMetrics(CollectorRegistry(), adapter_label_top_k=0)
    tenancy = Tenancy(config, TenantDirectory(config, None, None), metrics)
    acme = tenancy.authenticate(ACME_KEY, None)

    def finish(reached_engine: bool) -> None:
        record = RequestRecord("r", "POST", "/v1/completions", 0.0, tenant="acme", model="m")
        admitted = tenancy.admit(acme, record, model="m", adapter=None, prompt_tokens=1500,
                                 max_tokens=10)  # fmt: skip
        record.reached_engine, record.status = reached_engine, 503
        admitted.close()
        metrics.observe_request(record)

    def prompt_tokens() -> float:
        value = metrics.registry.get_sample_value(
            "loraplex_prompt_tokens_total", {"tenant": "acme"}
        )
        return value or 0.0

    async def run() -> None:
        for _ in range(3):
            finish(reached_engine=False)  # each admitted: no debt left behind
        assert prompt_tokens() == 0
        finish(reached_engine=True)
        assert prompt_tokens() == 1500
        with pytest.raises(RateLimited):  # 500 tokens of debt
            tenancy.admit(acme, None, model="m", adapter=None, prompt_tokens=1, max_tokens=1)

    asyncio.run(run())
