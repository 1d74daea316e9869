"""Pure logic of tenancy: keys, settings, namespaces, quotas, the tenant directory.

The directory's durable store, on the catalog's log in S3: tests/server/test_tenant_store.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr, ValidationError
from vllm import SamplingParams

from loraplex.server.engine.client import EngineClient
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.routes.admin_tenants import CreateTenant, UpdateTenant
from loraplex.server.tenancy.admission import Admission
from loraplex.server.tenancy.cache_salt import CacheSalts
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.errors import (
    QueueFull,
    RateLimited,
    RequestTooLarge,
    Unauthorized,
)
from loraplex.server.tenancy.keys import HashedKey, lookup_id, new_key
from loraplex.server.tenancy.model import Tenant, TenantSource
from loraplex.server.tenancy.quotas import Demand, QuotaGate, Reservation, TokenBucket
from loraplex.server.tenancy.record import RequestRecord
from loraplex.server.tenancy.service import Tenancy
from loraplex.server.tenancy.settings import Quotas, TenancySettings, TenantConfig
from tests.support.fake_engine_outputs import Tokenizer, output


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


# Issue 45, finding 2: a weight of 5e-324 or 1e-17 turned every later completion into a 500, and
# quotas of 10**400 overflowed the token bucket. Each enters through the config file, the admin
# API or a stored record, and each is held to the same bounds there.
OUT_OF_BOUNDS = [
    ({"weight": 5e-324}, "weight", "greater than or equal to 0.001"),
    ({"weight": 1e-17}, "weight", "greater than or equal to 0.001"),
    ({"weight": float("nan")}, "weight", "finite number"),
    ({"weight": float("inf")}, "weight", "finite number"),
    ({"weight": 1000.5}, "weight", "less than or equal to 1000"),
    ({"quotas": {"tokens_per_minute": 10**400}}, "tokens_per_minute", "10000000000"),
    ({"quotas": {"requests_per_minute": 10**9}}, "requests_per_minute", "100000000"),
    ({"quotas": {"max_concurrent": 10**7}}, "max_concurrent", "1000000"),
]


@pytest.mark.parametrize(("tenant", "field", "bound"), OUT_OF_BOUNDS)
def test_tenant_weight_and_quotas_are_bounded_where_they_enter(
    tenant: dict[str, object], field: str, bound: str
) -> None:
    for model, body in ((TenantConfig, {"id": "acme", **tenant}),
                        (CreateTenant, {"id": "acme", **tenant}),
                        (UpdateTenant, tenant)):  # fmt: skip
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        assert field in str(e.value) and bound in str(e.value), model
    with pytest.raises(ValueError, match=bound):
        Tenant.from_record({"id": "acme", **tenant})


def test_bounds_admit_what_a_deployment_needs() -> None:
    quotas = {"tokens_per_minute": 10**10, "requests_per_minute": 10**8, "max_concurrent": 10**6}
    config = TenantConfig.model_validate({"id": "acme", "weight": 0.001, "quotas": quotas})
    assert TenantConfig.model_validate({"id": "b", "weight": 1000}).weight == 1000
    assert config.quotas.tokens_per_minute == 10**10


@pytest.mark.parametrize(
    ("tenancy", "field"),
    [
        ({"max_running": 65_537}, "max_running"),
        ({"max_queued": 1_000_001}, "max_queued"),
        ({"active_window_s": float("inf")}, "active_window_s"),
        ({"active_window_s": float("nan")}, "active_window_s"),
        ({"share_prefix_cache": {"p": ["acme"]}}, "at least two tenants"),
        ({"share_prefix_cache": {"p": ["a", "b"], "q": ["b", "c"]}}, "groups 'p' and 'q'"),
        ({"share_prefix_cache": {"p": ["a", "B"]}}, "share_prefix_cache.p.1"),
    ],
)
def test_tenancy_settings_are_bounded(tenancy: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as e:
        settings(**tenancy)
    assert field in str(e.value)


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
ONE = Demand(prompt_tokens=1)  # a one-token request of one sequence


def try_take(bucket: TokenBucket) -> float:
    """Take one unit if it is there (0.0), else the wait, as admission does: check, then take."""
    wait = bucket.wait_for(1)
    if not wait:
        bucket.charge(1)
    return wait


NOTHING = Demand(prompt_tokens=0)  # a request that reserves no tokens, one sequence


def admit(gate: QuotaGate, demand: Demand = NOTHING) -> Reservation:
    reservation = gate.check(demand)
    gate.take(reservation)
    return reservation


def test_token_bucket_refills_continuously_up_to_one_minute() -> None:
    clock = FakeClock()
    bucket = TokenBucket(60, clock)
    assert all(try_take(bucket) == 0.0 for _ in range(60))
    assert try_take(bucket) == pytest.approx(1.0)
    clock.now += 0.5
    assert try_take(bucket) == pytest.approx(0.5)
    clock.now += 3600
    assert all(try_take(bucket) == 0.0 for _ in range(60))
    assert try_take(bucket) > 0


def test_quota_gate_reasons_and_retry_after() -> None:
    clock = FakeClock()
    gate = QuotaGate(Quotas(max_concurrent=2, requests_per_minute=3, tokens_per_minute=600), clock)
    first, second = admit(gate), admit(gate)
    with pytest.raises(RateLimited) as e:
        admit(gate)
    assert e.value.reason == "max_concurrent" and e.value.headers["Retry-After"] == "1"
    gate.release(first, 0)
    third = admit(gate)
    gate.release(second, 0)
    gate.release(third, 0)
    with pytest.raises(RateLimited) as e:
        admit(gate)
    assert e.value.reason == "requests_per_minute"
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
    assert e.value.headers["Retry-After"] == "20"  # 1 request per 20 s
    clock.now += 20
    # Used beyond its reservation (0 here): 600 tokens of debt, 60 s to repay at 10 tokens/s.
    gate.release(admit(gate), 1200)
    with pytest.raises(RateLimited) as e:
        admit(gate)
    assert e.value.reason == "tokens_per_minute"
    assert int(e.value.headers["Retry-After"]) == 60


def test_changed_quotas_apply_without_losing_in_flight_count() -> None:
    admission = Admission(settings())
    directory = TenantDirectory(two_tenants(), None, None)
    acme = directory.authenticate(ACME_KEY)

    async def run() -> None:
        first = await admission.enter(acme, ONE)
        tighter = acme.__class__(**{**acme.__dict__, "quotas": Quotas(max_concurrent=1)})
        with pytest.raises(RateLimited):
            await admission.enter(tighter, ONE)
        await first.close(0)
        await (await admission.enter(tighter, ONE)).close(0)

    asyncio.run(run())


def test_queue_full_refuses_without_counting_against_quota() -> None:
    clock = FakeClock()  # no refill during the test
    admission = Admission(settings(max_running=1, max_queued=1), clock)
    acme = TenantDirectory(two_tenants(), None, None).authenticate(ACME_KEY)
    acme = acme.__class__(**{**acme.__dict__, "quotas": Quotas(requests_per_minute=3)})

    async def run() -> None:
        running = await admission.enter(acme, ONE)
        queued = await admission.enter(acme, ONE)
        for _ in range(5):  # each refused for the queue, none for the request rate
            with pytest.raises(QueueFull) as e:
                await admission.enter(acme, ONE)
            assert e.value.status == 503
        await running.close(0)
        await queued.close(0)
        await (await admission.enter(acme, ONE)).close(0)  # the third of the minute's three
        with pytest.raises(RateLimited):
            await admission.enter(acme, ONE)

    asyncio.run(run())


def test_a_quota_edit_keeps_token_debt() -> None:
    clock = FakeClock()
    gate = QuotaGate(Quotas(tokens_per_minute=600), clock)
    gate.release(admit(gate), 1200)  # 600 tokens of debt: a minute at 600 per minute
    gate.set_quotas(Quotas(tokens_per_minute=1200))
    with pytest.raises(RateLimited) as e:
        admit(gate)
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
    metrics count it (its whole reservation comes back). A request the engine took is charged
    its prompt and output."""
    # 2,000 a minute (was 1,000): the 1,510 tokens each request reserves up front must fit.
    config = settings(tenants=[{"id": "acme", "api_keys": [ACME_KEY],
                                "quotas": {"tokens_per_minute": 2000}}])  # fmt: skip
    metrics = GatewayMetrics(CollectorRegistry(), adapter_label_top_k=0)
    tenancy = Tenancy(config, TenantDirectory(config, None, None), metrics)
    acme = tenancy.authenticate(ACME_KEY, None)

    async def finish(reached_engine: bool) -> None:
        record = RequestRecord("r", "POST", "/v1/completions", 0.0, tenant="acme", model="m")
        admitted = await tenancy.admit(acme, record, model="m", adapter=None, prompt_tokens=1500,
                                 max_tokens=10)  # fmt: skip
        record.reached_engine, record.status = reached_engine, 503
        await admitted.close()
        metrics.observe_request(record)

    def prompt_tokens() -> float:
        value = metrics.registry.get_sample_value(
            "loraplex_prompt_tokens_total", {"tenant": "acme"}
        )
        return value or 0.0

    async def run() -> None:
        for _ in range(3):
            await finish(reached_engine=False)  # each admitted: no debt left behind
        assert prompt_tokens() == 0
        await finish(reached_engine=True)
        assert prompt_tokens() == 1500
        with pytest.raises(RateLimited):  # 500 tokens left of 2,000: 601 do not fit
            await tenancy.admit(
                acme, None, model="m", adapter=None, prompt_tokens=1, max_tokens=600
            )

    asyncio.run(run())


# Issue 45, finding 5: `n` and max_tokens are paid for up front.
def test_tokens_are_reserved_up_front_and_the_unused_part_comes_back() -> None:
    """At 200 tokens a minute one request of n=16 was served 6,431 tokens before any 429: tokens
    were charged only at the end. Now admission reserves prompt + n x max_tokens."""
    clock = FakeClock()  # no refill during the test
    gate = QuotaGate(Quotas(tokens_per_minute=200), clock)
    first = admit(gate, Demand(10, n=2, max_tokens=50))  # 110 reserved, 90 left
    with pytest.raises(RateLimited) as e:
        admit(gate, Demand(10, n=1, max_tokens=81))  # 91 do not fit
    assert e.value.reason == "tokens_per_minute" and "91 tokens" in e.value.message
    second = admit(gate, Demand(10, n=1, max_tokens=80))  # 90 do
    gate.release(first, 30)  # used 30 of its 110: 80 come back
    gate.release(second, 90)
    third = admit(gate, Demand(10, n=1, max_tokens=70))  # the 80 given back
    with pytest.raises(RateLimited):
        admit(gate, Demand(1))
    gate.release(third, 0)  # never reached the engine: all of it comes back
    admit(gate, Demand(10, n=1, max_tokens=70))


def test_a_tenant_is_never_served_more_than_its_quota() -> None:
    """A greedy tenant at 600 tokens a minute sends requests of n=4 that use every token they
    may, retrying after each 429's Retry-After, for ten minutes: it is served at most the
    bucket's minute plus ten minutes of refill."""
    clock = FakeClock()
    gate = QuotaGate(Quotas(tokens_per_minute=600), clock)
    start, served = clock.now, 0
    while clock.now - start < 600:
        demand = Demand(20, n=4, max_tokens=45)  # 200 tokens
        try:
            reservation = admit(gate, demand)
        except RateLimited as e:
            clock.now += e.retry_after
            continue
        served += demand.tokens
        clock.now += 1.0
        gate.release(reservation, demand.tokens)
    assert 600 * 10 <= served <= 600 + 600 * 10


@pytest.mark.parametrize(
    ("quotas", "demand", "param", "reason"),
    [
        ({"tokens_per_minute": 200}, Demand(10, n=16, max_tokens=400), "max_tokens",
         "tokens_per_minute"),
        ({"tokens_per_minute": 200}, Demand(300, n=1, max_tokens=1), None, "tokens_per_minute"),
        ({"max_concurrent": 4}, Demand(1, n=5), "n", "max_concurrent"),
        ({"requests_per_minute": 8}, Demand(1, n=9), "n", "requests_per_minute"),
    ],
)  # fmt: skip
def test_a_request_no_wait_can_admit_is_400_naming_the_bound(
    quotas: dict[str, int], demand: Demand, param: str | None, reason: str
) -> None:
    gate = QuotaGate(Quotas.model_validate(quotas), FakeClock())
    with pytest.raises(RequestTooLarge) as e:
        gate.check(demand)
    limit = next(iter(quotas.values()))
    assert (e.value.status, e.value.code, e.value.param) == (400, "request_too_large", param)
    assert e.value.reason == reason and f"{reason} ({limit})" in e.value.message
    assert "Retry-After" not in e.value.headers


def test_n_counts_against_concurrency_and_the_request_rate() -> None:
    clock = FakeClock()
    gate = QuotaGate(Quotas(max_concurrent=4, requests_per_minute=8), clock)
    wide = admit(gate, Demand(1, n=4))
    with pytest.raises(RateLimited) as e:
        admit(gate, Demand(1))
    assert e.value.reason == "max_concurrent"
    gate.release(wide, 4)
    admit(gate, Demand(1, n=4))  # 8 sequences this minute
    with pytest.raises(RateLimited) as e:
        admit(gate, Demand(1))
    assert e.value.reason == "max_concurrent"  # 4 still in flight
    gate.in_flight = 0
    with pytest.raises(RateLimited) as e:
        admit(gate, Demand(1))
    assert e.value.reason == "requests_per_minute"


def test_n_over_max_running_is_400_and_counted_as_a_rejection() -> None:
    config = settings(max_running=8, tenants=[{"id": "acme", "api_keys": [ACME_KEY]}])
    metrics = GatewayMetrics(CollectorRegistry(), adapter_label_top_k=0)
    tenancy = Tenancy(config, TenantDirectory(config, None, None), metrics)
    acme = tenancy.authenticate(ACME_KEY, None)

    async def run() -> None:
        with pytest.raises(RequestTooLarge) as e:
            await tenancy.admit(
                acme, None, model="m", adapter=None, prompt_tokens=3, max_tokens=4, n=9
            )
        assert e.value.param == "n" and "tenancy.max_running (8)" in e.value.message
        admitted = await tenancy.admit(acme, None, model="m", adapter=None, prompt_tokens=3,
                                       max_tokens=4, n=8)  # fmt: skip
        await admitted.close()

    asyncio.run(run())
    assert (
        metrics.registry.get_sample_value(
            "loraplex_rejections_total", {"tenant": "acme", "reason": "max_running"}
        )
        == 1.0
    )


def test_a_failed_enqueue_takes_nothing_from_the_quotas() -> None:
    """Quotas are checked, then the request queued, then the quotas taken: when the queue
    refuses, the tenant's concurrency and token allowance are untouched."""
    clock = FakeClock()  # no refill during the test
    admission = Admission(settings(max_running=2, max_queued=0), clock)
    acme = TenantDirectory(two_tenants(), None, None).authenticate(ACME_KEY)
    quotas = Quotas(max_concurrent=3, tokens_per_minute=100)
    acme = acme.__class__(**{**acme.__dict__, "quotas": quotas})

    async def run() -> None:
        # Both slots, 50 tokens.
        running = await admission.enter(acme, Demand(10, n=2, max_tokens=20))
        with pytest.raises(QueueFull):  # it would have to wait, and nothing may
            await admission.enter(acme, Demand(10, n=1, max_tokens=40))
        await running.close(50)
        # 50 tokens left, 3 sequences.
        await (await admission.enter(acme, Demand(10, n=1, max_tokens=40))).close(0)
        await (await admission.enter(acme, Demand(10, n=2, max_tokens=20))).close(0)

    asyncio.run(run())


# --- prefix-cache salts ------------------------------------------------------------------------
def test_cache_salts_separate_tenants_and_join_a_sharing_group() -> None:
    from vllm.entrypoints.generate.base.protocol import validate_cache_salt

    salts = CacheSalts({"partners": ["acme", "globex"]})
    assert salts.of("acme") == salts.of("globex")
    distinct = {salts.of("acme"), salts.of("initech"), salts.of("hooli"), salts.of("partners")}
    assert len(distinct) == 4
    for salt in (salts.of("acme"), salts.of("initech")):
        assert len(salt) == 64
        validate_cache_salt(salt)  # what vLLM's own server accepts
    # Drawn per process: another server (or anyone outside) cannot compute them.
    assert CacheSalts({}).of("initech") != CacheSalts({}).of("initech")


def test_every_engine_request_carries_its_tenants_salt() -> None:
    config = settings(
        tenants=[{"id": "acme", "api_keys": [ACME_KEY]}, {"id": "globex", "api_keys": [GLOBEX_KEY]},
                 {"id": "initech", "api_keys": ["initech-key-0123456789abcdef"]}],
        share_prefix_cache={"partners": ["acme", "initech"]},
    )  # fmt: skip
    tenancy = Tenancy(config, TenantDirectory(config, None, None),
                      GatewayMetrics(CollectorRegistry(), adapter_label_top_k=0))  # fmt: skip
    prompts: list[dict[str, Any]] = []

    class Engine:
        errored = False

        async def generate(self, prompt: dict[str, Any], *_: Any, **__: Any) -> Any:
            prompts.append(prompt)
            yield output(last=True)

    async def run() -> None:
        engine = EngineClient(Engine(), Tokenizer(), 2048)  # type: ignore[arg-type]
        for key in (ACME_KEY, GLOBEX_KEY, "initech-key-0123456789abcdef"):
            admitted = await tenancy.admit(tenancy.authenticate(key, None), None, model="m",
                                           adapter=None, prompt_tokens=3, max_tokens=1)  # fmt: skip
            params = SamplingParams(max_tokens=1)
            async for _ in admitted.generate(engine, [1, 2, 3], params, None, "r"):
                pass
            await admitted.close()

    asyncio.run(run())
    acme, globex, initech = (p["cache_salt"] for p in prompts)
    assert acme == initech != globex
    assert all(p["prompt_token_ids"] == [1, 2, 3] for p in prompts)
