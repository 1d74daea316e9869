"""What the shared quota store costs an admission, and what a hung Redis costs the gateway.

Admissions through the real `Admission` (no engine): one tenant with every quota limited far
above what the run takes, admitted and closed in turn (one at a time, then 32 at once), on the
replica's own gate and on Redis (Debian's redis-server on loopback, as tests/support starts it),
side by side as a ratio. Then Redis hung by SIGSTOP: the first admission waits out
`quota_store_timeout_s`, the next ones are decided without the store; a 5 ms ticker measures the
event loop's longest gap meanwhile.

    python -m bench.quota_store [--n 2000] [--timeout-s 0.25]

Prints a table and appends rows to bench/results/quota_store.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench.common import append_rows, stamp
from bench.loadgen.redis_server import RedisServer
from loraplex.server.metrics import GatewayMetrics
from loraplex.server.tenancy.admission import Admission
from loraplex.server.tenancy.directory import TenantDirectory
from loraplex.server.tenancy.model import Tenant
from loraplex.server.tenancy.quota_store import SharedQuotas
from loraplex.server.tenancy.quotas import Demand
from loraplex.server.tenancy.redis_quotas import RedisQuotas
from loraplex.server.tenancy.settings import TenancySettings

KEY = "bench-key-0123456789abcdef"
DEMAND = Demand(100, n=1, max_tokens=100)
CONCURRENCY = 32


def bench_tenant() -> Tenant:
    quotas = {"max_concurrent": 10**6, "requests_per_minute": 10**8, "tokens_per_minute": 10**10}
    config = TenancySettings.model_validate(
        {"tenants": [{"id": "bench", "api_keys": [KEY], "quotas": quotas}]}
    )
    return TenantDirectory(config, None, None).authenticate(KEY)


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]


async def admissions(admission: Admission, tenant: Tenant, n: int) -> dict[str, float]:
    """Admit and close `n` requests one at a time, then `n` with 32 in flight."""
    enter_s: list[float] = []
    close_s: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        entry = await admission.enter(tenant, DEMAND)
        mid = time.perf_counter()
        await entry.close(150)
        enter_s.append(mid - start)
        close_s.append(time.perf_counter() - mid)

    async def one() -> None:
        await (await admission.enter(tenant, DEMAND)).close(150)

    start = time.perf_counter()
    for _ in range(n // CONCURRENCY):
        await asyncio.gather(*(one() for _ in range(CONCURRENCY)))
    concurrent_s = time.perf_counter() - start
    return {
        "enter_p50_us": percentile(enter_s, 50) * 1e6,
        "enter_p99_us": percentile(enter_s, 99) * 1e6,
        "close_p50_us": percentile(close_s, 50) * 1e6,
        "close_p99_us": percentile(close_s, 99) * 1e6,
        f"admissions_per_s_{CONCURRENCY}_at_once": (n // CONCURRENCY) * CONCURRENCY / concurrent_s,
    }


async def hung(admission: Admission, tenant: Tenant, redis: RedisServer) -> dict[str, float]:
    await (await admission.enter(tenant, DEMAND)).close(150)  # connected
    gaps: list[float] = []

    async def ticker() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    redis.pause()
    try:
        start = time.perf_counter()
        entries = [await admission.enter(tenant, DEMAND)]
        first_s = time.perf_counter() - start
        start = time.perf_counter()
        entries += [await admission.enter(tenant, DEMAND) for _ in range(100)]
        next_s = (time.perf_counter() - start) / 100
        for entry in entries:
            await entry.close(150)
    finally:
        redis.resume()
        ticking.cancel()
    return {
        "first_admission_ms": first_s * 1e3,
        "next_admissions_mean_us": next_s * 1e6,
        "longest_loop_gap_ms": max(gaps) * 1e3,
    }


async def run(args: argparse.Namespace, redis: RedisServer) -> list[dict[str, Any]]:
    tenant = bench_tenant()
    settings = TenancySettings(max_running=10_000, max_queued=10_000)
    metrics = GatewayMetrics(CollectorRegistry(), adapter_label_top_k=0)

    def shared() -> SharedQuotas:
        return SharedQuotas(RedisQuotas(redis.url, args.timeout_s), "open", metrics)

    async def measure(
        mode: str, quotas: SharedQuotas | None, body: Callable[[Admission], Awaitable[Any]]
    ) -> dict[str, Any]:
        admission = Admission(settings, shared=quotas)
        result = await body(admission)
        if quotas is not None:
            await quotas.store.aclose()
        return {"mode": mode, **result}

    return [
        await measure("local", None, lambda a: admissions(a, tenant, args.n)),
        await measure("redis", shared(), lambda a: admissions(a, tenant, args.n)),
        await measure("redis-hung", shared(), lambda a: hung(a, tenant, redis)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="admissions per mode")
    parser.add_argument("--timeout-s", type=float, default=0.25)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]  # the machine's other work shows in the tails
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp)).start()
        try:
            rows = asyncio.run(run(args, redis))
        finally:
            redis.kill()
    load = {"load_average_1m": [load_before, os.getloadavg()[0]]}
    local, shared, hung_row = rows
    print(f"{'':28}{'local':>12}{'redis':>12}{'ratio':>8}")
    for key in local:
        if key != "mode":
            print(f"{key:28}{local[key]:12.1f}{shared[key]:12.1f}{shared[key] / local[key]:8.2f}")
    print(f"hung redis (timeout {args.timeout_s} s): " + ", ".join(
        f"{k} {v:.1f}" for k, v in hung_row.items() if k != "mode"
    ))  # fmt: skip
    meta = {**stamp(), **load, "config": {"n": args.n, "timeout_s": args.timeout_s,
                                          "concurrency": CONCURRENCY}}  # fmt: skip
    path = append_rows("quota_store", [{**meta, **row} for row in rows])
    print(f"rows appended to {path}")


if __name__ == "__main__":
    main()
