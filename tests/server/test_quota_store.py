"""Fleet-wide quotas against a real Redis (Debian's redis-server on loopback, no persistence):
the Lua scripts' semantics, two replicas' clients on one store, leases that lapse and come back,
and the open / closed failure modes with Redis stopped, hung (SIGSTOP) and restarted empty.

No engine: the scripts are called through `RedisQuotas`, admissions through the real
`Admission` / `Tenancy`. Limits are small so that Redis' clock (the scripts use TIME) refills
next to nothing over a test: 3 requests a minute refill one every 20 s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio
from prometheus_client import CollectorRegistry

from bench.loadgen.redis_server import RedisServer
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.settings import ConfigError, load_settings
from loraplex.server.tenancy.admission import Admission
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.errors import QueueFull, QuotaStoreUnavailable, RateLimited
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.quota_store import RETRY_S, SharedQuotas, StoreState
from loraplex.server.tenancy.quotas import Demand, QuotaGate
from loraplex.server.tenancy.redis_quotas import KEY_PREFIX, Lease, RedisQuotas
from loraplex.server.tenancy.service import Tenancy
from loraplex.server.tenancy.settings import Quotas, TenancySettings

ACME_KEY = "acme-key-0123456789abcdef"
FREE_KEY = "unlimited-key-0123456789abcdef"
BYPASSED = "loraplex_quota_store_bypassed_requests_total"
# A healthy store's bound: the first call connects and loads its script, which took over 0.2 s
# on a loaded 2-core CI machine (CI at ff55eed). Only the tests of a store that does not answer
# wait it out, once or twice each.
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    """The module's Redis, running and empty (a test before may have stopped or paused it)."""
    redis_server.resume()
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()

    async def flush() -> None:
        client = redis.asyncio.Redis.from_url(redis_server.url)
        await client.flushall()
        await client.aclose()

    asyncio.run(flush())
    return redis_server


class FakeClock:
    """The replica's clock for the store's retry timing (Redis keeps its own time)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


NOTHING = Demand(0)  # one sequence, no tokens


async def take(
    store: RedisQuotas, quotas: Quotas, demand: Demand = NOTHING, tenant: str = "acme"
) -> Lease | RateLimited:
    lease = store.new_lease(tenant, quotas, demand)
    refused = await store.acquire(lease, quotas, demand)
    return lease if refused is None else refused


async def release(
    store: RedisQuotas, lease: Lease | RateLimited, quotas: Quotas, used: int
) -> bool:
    assert isinstance(lease, Lease), lease
    back = lease.reservation.tokens - used if lease.reservation.tokens else 0
    return await store.release(lease, quotas, requests_back=0, tokens_back=back)


def refused(outcome: Lease | RateLimited, reason: str) -> RateLimited:
    assert isinstance(outcome, RateLimited), f"admitted, expected a 429 for {reason}"
    assert outcome.reason == reason, outcome.message
    return outcome


# --- the scripts ---------------------------------------------------------------------------------
def test_request_rate_counts_sequences_and_says_when_to_retry(server: RedisServer) -> None:
    quotas = Quotas(requests_per_minute=3)

    async def main() -> None:
        store = RedisQuotas(server.url, TIMEOUT_S)
        wide = await take(store, quotas, Demand(0, n=2))
        assert isinstance(wide, Lease) and wide.reservation.sequences == 2
        assert isinstance(await take(store, quotas), Lease)
        limited = refused(await take(store, quotas), "requests_per_minute")
        assert limited.status == 429 and 19 <= limited.retry_after <= 20  # one every 20 s
        assert limited.headers["Retry-After"] == "20"
        assert "3 requests per minute" in limited.message
        await store.aclose()

    run(main)


def test_tokens_are_reserved_and_the_unused_part_comes_back(server: RedisServer) -> None:
    """The in-process test of the same name, on Redis: prompt + n x max_tokens reserved at
    admission, the unused part given back at release, debt repaid by the refill."""
    quotas = Quotas(tokens_per_minute=200)

    async def main() -> None:
        store = RedisQuotas(server.url, TIMEOUT_S)
        first = await take(store, quotas, Demand(10, n=2, max_tokens=50))  # 110: 90 left
        limited = refused(await take(store, quotas, Demand(10, max_tokens=81)), "tokens_per_minute")
        assert "91 tokens (10 in the prompt + n 1 x max_tokens 81)" in limited.message
        second = await take(store, quotas, Demand(10, max_tokens=80))  # 90 do fit
        assert await release(store, first, quotas, used=30)  # 80 of its 110 come back
        assert await release(store, second, quotas, used=90)
        third = await take(store, quotas, Demand(10, max_tokens=70))  # the 80 given back
        refused(await take(store, quotas, Demand(1)), "tokens_per_minute")
        assert await release(store, third, quotas, used=0)  # never reached the engine
        fourth = await take(store, quotas, Demand(10, max_tokens=70))
        # Used 280 of its 80: 200 of debt on an empty bucket is a minute at 200 a minute.
        assert await release(store, fourth, quotas, used=280)
        debt = refused(await take(store, quotas, Demand(1)), "tokens_per_minute")
        assert 60 <= debt.retry_after <= 60.5  # 201 tokens at 200 a minute
        await store.aclose()

    run(main)


def test_concurrency_is_shared_by_replicas_and_freed_by_release(server: RedisServer) -> None:
    quotas = Quotas(max_concurrent=3)

    async def main() -> None:
        a, b = RedisQuotas(server.url, TIMEOUT_S), RedisQuotas(server.url, TIMEOUT_S)
        on_a = await take(a, quotas, Demand(0, n=2))
        on_b = await take(b, quotas)
        limited = refused(await take(a, quotas), "max_concurrent")
        assert "3 sequences are in flight and the limit is 3" in limited.message
        assert limited.headers["Retry-After"] == "1"
        assert await release(a, on_a, quotas, used=0)
        assert isinstance(await take(b, quotas, Demand(0, n=2)), Lease)
        refused(await take(a, quotas), "max_concurrent")
        assert await release(b, on_b, quotas, used=0)
        assert isinstance(await take(a, quotas), Lease)
        await a.aclose()
        await b.aclose()

    run(main)


def test_a_release_acts_once_and_only_on_a_lease_that_was_taken(server: RedisServer) -> None:
    quotas = Quotas(max_concurrent=1, tokens_per_minute=100)

    async def main() -> None:
        store = RedisQuotas(server.url, TIMEOUT_S)
        lease = await take(store, quotas, Demand(10, max_tokens=40))  # 50 reserved
        assert await release(store, lease, quotas, used=0)
        assert not await release(store, lease, quotas, used=0)  # no second refund
        never = store.new_lease("acme", quotas, Demand(10, max_tokens=40))
        assert not await store.release(never, quotas, requests_back=1, tokens_back=50)
        held = [await take(store, quotas, Demand(10, max_tokens=40))]  # 50 of 100 left
        refused(await take(store, quotas, Demand(10, max_tokens=40)), "max_concurrent")
        assert await release(store, held[0], quotas, used=50)  # nothing comes back: 50 left
        refused(await take(store, quotas, Demand(10, max_tokens=41)), "tokens_per_minute")
        await store.aclose()

    run(main)


def test_an_acquire_sent_twice_takes_once(server: RedisServer) -> None:
    """A call retried after its connection broke may have run the first time: the same lease
    is taken once (one sequence held, one request and its tokens charged)."""
    quotas = Quotas(max_concurrent=2, requests_per_minute=2, tokens_per_minute=100)
    demand = Demand(10, max_tokens=40)

    async def main() -> None:
        store = RedisQuotas(server.url, TIMEOUT_S)
        lease = store.new_lease("acme", quotas, demand)
        assert await store.acquire(lease, quotas, demand) is None
        assert await store.acquire(lease, quotas, demand) is None
        assert isinstance(await take(store, quotas, demand), Lease)  # 2 sequences, 100 tokens
        refused(await take(store, quotas, Demand(0)), "max_concurrent")
        await store.aclose()

    run(main)


def test_scripts_decide_as_the_in_process_gate_does(server: RedisServer) -> None:
    """One sequence of admissions and releases, on the replica's own gate (fake clock, no
    refill) and on Redis (its clock refills 10 tokens and 1/12 of a request a second at these
    rates): the same admissions, the same quota named in each refusal, the same Retry-After to
    the second."""
    quotas = Quotas(max_concurrent=4, requests_per_minute=5, tokens_per_minute=600)
    script = [  # (demand, used tokens, or None to keep it in flight)
        (Demand(100, n=2, max_tokens=50), 120),  # 200 reserved, 80 back: 480 left
        (Demand(10, n=1, max_tokens=300), None),  # 170 left, 2 requests
        (Demand(10, n=2, max_tokens=75), None),  # 10 left, no request, 3 in flight
        (Demand(1, n=1, max_tokens=30), None),  # 31 tokens of 10: 2.1 s
        (Demand(1, n=1, max_tokens=8), None),  # 9 tokens fit, but no request: 12 s
        (Demand(0), 0),
        (Demand(0, n=2), 0),  # 5 sequences of 4
    ]
    clock = FakeClock()
    gate = QuotaGate(quotas, clock)
    local: list[str] = []
    for demand, used in script:
        try:
            reservation = gate.check(demand)
        except RateLimited as e:
            local.append(f"{e.reason} {e.headers['Retry-After']}")
            continue
        gate.take(reservation)
        local.append("admitted")
        if used is not None:
            gate.release(reservation, used)

    async def main() -> list[str]:
        store = RedisQuotas(server.url, TIMEOUT_S)
        shared: list[str] = []
        for demand, used in script:
            outcome = await take(store, quotas, demand)
            if isinstance(outcome, RateLimited):
                shared.append(f"{outcome.reason} {outcome.headers['Retry-After']}")
                continue
            shared.append("admitted")
            if used is not None:
                await release(store, outcome, quotas, used)
        await store.aclose()
        return shared

    assert asyncio.run(main()) == local
    assert local == [
        *("admitted",) * 3, "tokens_per_minute 3", *("requests_per_minute 12",) * 2,
        "max_concurrent 1",
    ]  # fmt: skip


def test_buckets_refill_continuously_and_keys_expire_once_full(server: RedisServer) -> None:
    quotas = Quotas(requests_per_minute=600)  # 10 a second

    async def main() -> None:
        store = RedisQuotas(server.url, TIMEOUT_S)
        client = redis.asyncio.Redis.from_url(server.url)
        assert isinstance(await take(store, quotas, Demand(0, n=600)), Lease)
        start = time.monotonic()
        first = refused(await take(store, quotas, Demand(0, n=6)), "requests_per_minute")
        assert 0.5 <= first.retry_after <= 0.6
        await asyncio.sleep(0.3)
        later = refused(await take(store, quotas, Demand(0, n=6)), "requests_per_minute")
        elapsed = time.monotonic() - start
        assert later.retry_after == pytest.approx(0.6 - elapsed, abs=0.05)
        # The bucket keeps its state until it is full again (60 s at most here), then goes.
        state = f"{KEY_PREFIX}{{acme}}"
        assert 0 < await client.pttl(state) <= 60_000 + 1_000
        assert await client.ttl(state + ":leases") > 0
        for key in await client.keys("*"):
            assert await client.pttl(key) > 0, f"{key!r} would never expire"
        await client.aclose()
        await store.aclose()

    run(main)


def test_a_dead_replicas_leases_lapse_and_a_live_ones_are_renewed(server: RedisServer) -> None:
    quotas = Quotas(max_concurrent=2)
    ttl = 0.6

    async def main() -> None:
        dead = RedisQuotas(server.url, TIMEOUT_S, lease_ttl_s=ttl)
        live = RedisQuotas(server.url, TIMEOUT_S, lease_ttl_s=ttl)
        assert isinstance(await take(dead, quotas), Lease)  # never released nor renewed
        kept = await take(live, quotas)
        assert isinstance(kept, Lease)
        refused(await take(live, quotas), "max_concurrent")
        for _ in range(5):  # 1.5 s, over twice the ttl: renewed every ttl / 2
            await asyncio.sleep(ttl / 2)
            await live.renew({"acme": [kept.member]})
        # The dead replica's sequence lapsed and was reaped; the renewed one still counts.
        again = await take(live, quotas)
        assert isinstance(again, Lease)
        refused(await take(live, quotas), "max_concurrent")
        await dead.aclose()
        await live.aclose()

    run(main)


def test_a_renewal_takes_back_leases_an_empty_restarted_redis_lost(server: RedisServer) -> None:
    quotas = Quotas(max_concurrent=2)

    async def main() -> None:
        a = RedisQuotas(server.url, TIMEOUT_S)
        held = await take(a, quotas, Demand(0, n=2))
        assert isinstance(held, Lease)
        server.restart()  # no persistence: empty
        b = RedisQuotas(server.url, TIMEOUT_S)
        assert isinstance(await take(b, quotas), Lease)  # the restart forgot a's two
        await b.aclose()
        b = RedisQuotas(server.url, TIMEOUT_S)
        await a.renew({"acme": [held.member]})  # a's requests still run: they count again
        refused(await take(b, quotas), "max_concurrent")
        await a.aclose()
        await b.aclose()

    run(main)


# --- admission with the shared store -----------------------------------------------------------
def tenant(quotas: Quotas, tenant_id: str = "acme") -> Tenant:
    config = TenancySettings.model_validate(
        {"tenants": [{"id": tenant_id, "api_keys": [ACME_KEY], "quotas": quotas.model_dump()}]}
    )
    return TenantDirectory(config, None, None).authenticate(ACME_KEY)


def shared(
    server: RedisServer, failure: str, clock: FakeClock, timeout_s: float = TIMEOUT_S, **kw: Any
) -> tuple[SharedQuotas, GatewayMetrics]:
    metrics = GatewayMetrics(CollectorRegistry(), adapter_label_top_k=0)
    store = RedisQuotas(server.url, timeout_s, **kw)
    return SharedQuotas(store, failure, metrics, clock), metrics  # type: ignore[arg-type]


def sample(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_two_replicas_admit_a_tenants_rate_once_between_them(server: RedisServer) -> None:
    """The issue's check at the admission level: rpm 10, 30 requests spread over two replicas'
    admissions: 10 admitted and 20 refused 429 with Retry-After."""
    acme = tenant(Quotas(requests_per_minute=10))
    clock = FakeClock()
    settings = TenancySettings(max_running=64, max_queued=64)

    async def main() -> None:
        replicas = [shared(server, "closed", clock)[0] for _ in range(2)]
        admissions = [Admission(settings, clock, shared=s) for s in replicas]
        outcomes: list[str] = []
        for i in range(30):
            try:
                entry = await admissions[i % 2].enter(acme, Demand(5, max_tokens=5))
            except RateLimited as e:
                assert 1 <= int(e.headers["Retry-After"]) <= 6
                outcomes.append("429")
            else:
                outcomes.append("admitted")
                await entry.close(10)
        assert outcomes.count("admitted") == 10 and outcomes.count("429") == 20
        for s in replicas:
            await s.store.aclose()

    run(main)


def test_a_queue_refusal_gives_the_shared_quotas_back(server: RedisServer) -> None:
    acme = tenant(Quotas(requests_per_minute=3, tokens_per_minute=100))
    clock = FakeClock()

    async def main() -> None:
        quotas, _ = shared(server, "closed", clock)
        admission = Admission(TenancySettings(max_running=1, max_queued=0), clock, shared=quotas)
        running = await admission.enter(acme, Demand(10, max_tokens=10))
        for _ in range(4):  # each took its lease in Redis, then the queue refused it
            with pytest.raises(QueueFull):
                await admission.enter(acme, Demand(10, max_tokens=10))
        await running.close(20)
        # Two requests and 80 tokens left: nothing the refused ones took stayed taken.
        await (await admission.enter(acme, Demand(10, max_tokens=30))).close(40)
        await (await admission.enter(acme, Demand(10, max_tokens=30))).close(40)
        with pytest.raises(RateLimited) as e:
            await admission.enter(acme, Demand(0))
        assert e.value.reason == "requests_per_minute"
        await quotas.store.aclose()

    run(main)


def test_open_admits_on_the_replicas_own_quotas_while_redis_is_down(
    server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    acme = tenant(Quotas(requests_per_minute=4))
    clock = FakeClock()

    async def main() -> None:
        quotas, metrics = shared(server, "open", clock)
        admission = Admission(TenancySettings(), clock, shared=quotas)
        await (await admission.enter(acme, Demand(0))).close(0)  # through Redis, mirrored here
        server.stop()
        with caplog.at_level(logging.WARNING):
            for _ in range(3):  # this replica's own gate: 4 a minute, one of them used
                await (await admission.enter(acme, Demand(0))).close(0)
            with pytest.raises(RateLimited) as e:
                await admission.enter(acme, Demand(0))
            assert e.value.reason == "requests_per_minute"
        assert quotas.state is StoreState.DOWN
        assert sample(metrics, "loraplex_quota_store_healthy") == 0
        assert (
            sample(metrics, "loraplex_quota_store_failed_requests_total", operation="acquire") == 1
        )
        assert sample(metrics, BYPASSED, tenant="acme", failure_mode="open") == 4
        down = [r for r in caplog.records if "quota store unreachable" in r.getMessage()]
        assert len(down) == 1 and "this replica's own quotas" in down[0].getMessage()

        server.start()  # empty: a full minute again for the shared bucket
        clock.now += RETRY_S
        with caplog.at_level(logging.INFO):
            for _ in range(4):
                await (await admission.enter(acme, Demand(0))).close(0)
        assert (
            quotas.state is StoreState.UP and sample(metrics, "loraplex_quota_store_healthy") == 1
        )
        assert any("reachable again" in r.getMessage() for r in caplog.records)
        with pytest.raises(RateLimited):  # Redis decides again: its 4 are used
            await admission.enter(acme, Demand(0))
        await quotas.store.aclose()

    run(main)


def test_a_redis_answering_errors_counts_as_down(server: RedisServer) -> None:
    """Redis answers, but refuses every write (min-replicas-to-write 1 without replicas: the
    scripts' first write fails with NOREPLICAS). Open admits on the replica's own quotas; once
    writes are allowed again, Redis decides again."""
    acme = tenant(Quotas(requests_per_minute=100))
    clock = FakeClock()

    async def refuse_writes(refuse: bool) -> None:
        client = redis.asyncio.Redis.from_url(server.url)
        await client.config_set("min-replicas-to-write", "1" if refuse else "0")
        await client.aclose()

    async def main() -> None:
        quotas, metrics = shared(server, "open", clock)
        admission = Admission(TenancySettings(), clock, shared=quotas)
        await refuse_writes(True)
        try:
            await (await admission.enter(acme, Demand(0))).close(0)
        finally:
            await refuse_writes(False)
        assert quotas.state is StoreState.DOWN
        assert sample(metrics, "loraplex_quota_store_failed_requests_total", operation="acquire")
        assert sample(metrics, BYPASSED, tenant="acme", failure_mode="open") == 1
        clock.now += RETRY_S
        await (await admission.enter(acme, Demand(0))).close(0)
        assert quotas.state is StoreState.UP
        await quotas.store.aclose()

    run(main)


def test_an_admission_is_one_round_trip_even_after_redis_restarted(server: RedisServer) -> None:
    """Redis comes back empty (its script cache too): the probe loads every script, so the next
    admission is a single EVALSHA, not NOSCRIPT, SCRIPT LOAD and EVALSHA again."""
    acme = tenant(Quotas(requests_per_minute=100))
    clock = FakeClock()

    async def calls() -> dict[str, int]:
        """Script calls and NOSCRIPT errors since the last look (the commands run inside
        scripts are counted too, and redis-py's CLIENT SETINFO on connecting fails on Redis
        7.0: those are left out)."""
        client = redis.asyncio.Redis.from_url(server.url)
        stats = await client.info("commandstats")
        errors = await client.info("errorstats")
        await client.config_resetstat()
        await client.aclose()
        scripted = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_script|load")
        counts = {k: v["calls"] for k, v in stats.items() if k in scripted}
        return counts | {k: v["count"] for k, v in errors.items() if k == "errorstat_NOSCRIPT"}

    async def main() -> None:
        quotas, _ = shared(server, "closed", clock)
        admission = Admission(TenancySettings(), clock, shared=quotas)
        await quotas.tick()  # at start: the scripts are loaded
        await (await admission.enter(acme, Demand(0))).close(0)
        server.stop()
        with pytest.raises(QuotaStoreUnavailable):
            await admission.enter(acme, Demand(0))
        server.start()
        clock.now += RETRY_S
        await quotas.tick()  # the probe
        assert quotas.state is StoreState.UP
        await calls()
        entry = await admission.enter(acme, Demand(0))
        assert await calls() == {"cmdstat_evalsha": 1}
        await entry.close(0)
        assert await calls() == {"cmdstat_evalsha": 1}
        await quotas.store.aclose()

    run(main)


def test_closed_refuses_503_with_retry_after_and_counts_it(server: RedisServer) -> None:
    """Refused while Redis is down, admitted again once it is back; a tenant without limits
    never needs Redis and is served throughout."""
    config = TenancySettings.model_validate(
        {"tenants": [{"id": "acme", "api_keys": [ACME_KEY],
                      "quotas": {"requests_per_minute": 1000}},
                     {"id": "unlimited", "api_keys": [FREE_KEY]}],
         "quota_store": server.url, "quota_store_failure": "closed",
         "quota_store_timeout_s": TIMEOUT_S}
    )  # fmt: skip
    metrics = GatewayMetrics(CollectorRegistry(), adapter_label_top_k=0)
    tenancy = Tenancy(config, TenantDirectory(config, None, None), metrics)

    async def admit(key: str = ACME_KEY) -> None:
        admitted = await tenancy.admit(tenancy.authenticate(key, None), None, model="m",
                                       adapter=None, prompt_tokens=1, max_tokens=1)  # fmt: skip
        await admitted.close()

    async def main() -> None:
        async with tenancy.sharing_quotas():
            await admit()
            server.stop()
            for _ in range(3):
                with pytest.raises(QuotaStoreUnavailable) as e:
                    await admit()
                assert e.value.status == 503 and e.value.code == "quota_store_unavailable"
                assert e.value.headers["Retry-After"] == "1"
                await admit(FREE_KEY)
            server.start()
            await asyncio.sleep(RETRY_S)
            await admit()

    run(main)
    assert sample(metrics, "loraplex_rejections_total", tenant="acme",
                  reason="quota_store_unavailable") == 3  # fmt: skip
    assert sample(metrics, BYPASSED, tenant="acme", failure_mode="closed") == 3
    assert sample(metrics, BYPASSED, tenant="unlimited", failure_mode="closed") == 0


def test_a_hung_redis_costs_one_request_the_timeout_and_never_stalls_the_loop(
    server: RedisServer,
) -> None:
    """SIGSTOP: connections open and nothing answers. The first admission waits out the
    timeout; the others are decided at once until the retry time; the event loop keeps
    running throughout (a 5 ms ticker's longest gap stays far below the timeout, which a
    blocked loop would show)."""
    acme = tenant(Quotas(requests_per_minute=100))
    clock = FakeClock()
    timeout_s = 0.5

    async def main() -> None:
        quotas, _ = shared(server, "open", clock, timeout_s)
        admission = Admission(TenancySettings(), clock, shared=quotas)
        await (await admission.enter(acme, Demand(0))).close(0)  # connected
        for _ in range(5):  # a first connect slower than the timeout (a loaded CI machine)
            if quotas.state is StoreState.UP:
                break
            clock.now += RETRY_S
            await quotas.tick()
        assert quotas.state is StoreState.UP
        gaps: list[float] = []

        async def ticker() -> None:
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticking = asyncio.create_task(ticker())
        server.pause()
        try:
            start = time.perf_counter()
            entries = [await admission.enter(acme, Demand(0))]
            probe_s = time.perf_counter() - start
            start = time.perf_counter()
            entries += [await admission.enter(acme, Demand(0)) for _ in range(20)]
            others_s = time.perf_counter() - start
            for entry in entries:
                await entry.close(0)  # admitted on the replica's own gate: nothing to release
        finally:
            server.resume()
            ticking.cancel()
        print(f"hung redis: probe {probe_s * 1e3:.0f} ms, 20 more {others_s * 1e3:.1f} ms, "
              f"longest loop gap {max(gaps) * 1e3:.1f} ms")  # fmt: skip
        assert timeout_s <= probe_s < timeout_s + 0.5, probe_s
        assert others_s < timeout_s / 2, others_s
        assert max(gaps) < timeout_s / 2, max(gaps)
        clock.now += RETRY_S
        await quotas.tick()  # the probe: back
        assert quotas.state is StoreState.UP
        await quotas.store.aclose()

    run(main)


async def pause_writes(server: RedisServer, pause: bool) -> None:
    """CLIENT PAUSE WRITE: scripts wait unanswered, and one whose client gives up (the
    timeout closes its connection) never runs, unlike under SIGSTOP."""
    client = redis.asyncio.Redis.from_url(server.url)
    if pause:
        await client.execute_command("CLIENT", "PAUSE", "10000", "WRITE")
    else:
        await client.execute_command("CLIENT", "UNPAUSE")
    await client.aclose()


async def leases_of(server: RedisServer, tenant_id: str) -> int:
    client = redis.asyncio.Redis.from_url(server.url)
    count = int(await client.zcard(f"{KEY_PREFIX}{{{tenant_id}}}:leases"))
    await client.aclose()
    return count


def test_a_release_that_could_not_reach_redis_is_retried(server: RedisServer) -> None:
    acme = tenant(Quotas(max_concurrent=1, tokens_per_minute=100))
    clock = FakeClock()

    async def main() -> None:
        quotas, metrics = shared(server, "closed", clock)
        admission = Admission(TenancySettings(), clock, shared=quotas)
        entry = await admission.enter(acme, Demand(10, max_tokens=80))  # 90 reserved
        await pause_writes(server, True)
        try:
            await entry.close(10)  # 80 to give back, and the lease: times out, never runs
        finally:
            await pause_writes(server, False)
        assert (
            sample(metrics, "loraplex_quota_store_failed_requests_total", operation="release") == 1
        )
        other = RedisQuotas(server.url, TIMEOUT_S)  # another replica sees it still held
        refused(await take(other, acme.quotas), "max_concurrent")
        clock.now += RETRY_S
        await quotas.tick()  # the probe, then the pending release
        assert isinstance(await take(other, acme.quotas, Demand(10, max_tokens=80)), Lease)
        await other.aclose()
        await quotas.store.aclose()

    run(main)


def test_an_admission_cancelled_mid_call_leaves_no_lease(server: RedisServer) -> None:
    """The client goes away while admission waits on a hung Redis, which then runs the script:
    the lease it took is undone (its sequence, request and tokens all come back)."""
    acme = tenant(Quotas(max_concurrent=1, requests_per_minute=2, tokens_per_minute=100))
    clock = FakeClock()

    async def main() -> None:
        quotas, _ = shared(server, "closed", clock)
        admission = Admission(TenancySettings(), clock, shared=quotas)
        await (await admission.enter(acme, Demand(0))).close(0)  # connected; 1 request left
        server.pause()
        entering = asyncio.create_task(admission.enter(acme, Demand(10, max_tokens=40)))
        await asyncio.sleep(0.05)  # sent, unanswered
        entering.cancel()
        with pytest.raises(asyncio.CancelledError):
            await entering
        server.resume()
        for _ in range(100):  # the resumed server runs what it had read
            if await leases_of(server, "acme"):
                break
            await asyncio.sleep(0.01)
        assert await leases_of(server, "acme") == 1
        await quotas.tick()
        assert await leases_of(server, "acme") == 0
        other = RedisQuotas(server.url, TIMEOUT_S)  # the last request and all 100 tokens
        assert isinstance(await take(other, acme.quotas, Demand(10, max_tokens=90)), Lease)
        await other.aclose()
        await quotas.store.aclose()

    run(main)


def test_held_leases_outlive_their_ttl_while_the_replica_renews_them(server: RedisServer) -> None:
    acme = tenant(Quotas(max_concurrent=1))
    clock = FakeClock()

    async def main() -> None:
        quotas, _ = shared(server, "closed", clock, lease_ttl_s=0.6)
        admission = Admission(TenancySettings(), clock, shared=quotas)
        entry = await admission.enter(acme, Demand(0))
        other = RedisQuotas(server.url, TIMEOUT_S)
        for _ in range(6):  # 1.2 s, twice the ttl
            await asyncio.sleep(0.2)
            clock.now += 0.2
            await quotas.tick()
        refused(await take(other, acme.quotas), "max_concurrent")
        await entry.close(0)
        assert isinstance(await take(other, acme.quotas), Lease)
        await other.aclose()
        await quotas.store.aclose()

    run(main)


# --- settings ------------------------------------------------------------------------------------
def test_quota_store_settings_are_checked_and_the_url_never_printed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for bad, words in (
        ("http://redis:6379", "scheme redis, rediss, unix"),
        ("redis://:hunter2secret@:6379/0", "must name a host"),
        ("redis://:hunter2secret@redis:port/0", "Port could not be cast"),
    ):
        monkeypatch.setenv("LORAPLEX_TENANCY__QUOTA_STORE", bad)
        with pytest.raises(ConfigError) as e:
            load_settings()
        assert "tenancy.quota_store" in str(e.value) and words in str(e.value)
        assert "hunter2secret" not in str(e.value)
    monkeypatch.setenv("LORAPLEX_TENANCY__QUOTA_STORE", "redis://:hunter2secret@redis:6379/0")
    monkeypatch.setenv("LORAPLEX_TENANCY__QUOTA_STORE_FAILURE", "closed")
    settings = load_settings()
    assert settings.tenancy.quota_store_failure == "closed"
    assert "hunter2secret" not in repr(settings)
    store = RedisQuotas(settings.tenancy.quota_store.get_secret_value(), 0.1)  # type: ignore[union-attr]
    assert store.address == "redis://redis:6379/0"
    monkeypatch.setenv("LORAPLEX_TENANCY__QUOTA_STORE_FAILURE", "ajar")
    with pytest.raises(ConfigError, match="quota_store_failure"):
        load_settings()
