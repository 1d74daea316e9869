"""One replica's catalog and tenant followers for the fleet bench: the server's own code, no engine.

    AWS_ACCESS_KEY_ID=<replica> python -m bench.registry.fleet_replica '<config JSON>'

Opens the registry as the server's lifespan does (`open_adapter_source`: the base model's spec,
the disk cache, the catalog read from the store, then the poll loop every `poll_interval_s`), on
a stub engine and the tiny base model, and follows the tenants beside it
(`fleet_tenants.following_tenants`). Prints JSON lines on stdout: `{"ready": seconds to open,
"adapters": names, "tenants": tenants}` once open; after a line `watch` on stdin, `{"seen": k,
"at": time.monotonic()}` when probe name k (`probe_name`) becomes known to the catalog and
`{"tenant_seen": k, "at": ...}` when tenant change k shows (`fleet_tenants`), each checked every
`WATCH_S` (only then: the idle measurement counts the followers' CPU alone). A line `change k`
makes tenant change k here and answers `{"changed": k, "at": ...}` once it is written. Runs until
stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from bench.registry.fleet_tenants import change_tenant, following_tenants, tenant_change_seen
from bench.registry.stubs import TINY_MODEL_NAME, StubEngine
from loraplex.adapters_registry.admin import ManagedRegistry
from loraplex.adapters_registry.lifecycle import open_adapter_source
from loraplex.adapters_registry.settings import RegistrySettings
from loraplex.server.tenancy.directory import TenantDirectory

# How often the watcher looks for the next probe name: 100x finer than the default poll (2 s),
# and 32 replicas waking this often cost the 2-core machine about 2% of a core.
WATCH_S = 0.02


def probe_name(k: int) -> str:
    return f"probe/p{k:04d}"


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def watch(registry: ManagedRegistry) -> None:
    k = 0
    while True:
        while registry.catalog.entry(probe_name(k)) is not None:
            emit({"seen": k, "at": time.monotonic()})
            k += 1
        await asyncio.sleep(WATCH_S)


async def watch_tenants(directory: TenantDirectory) -> None:
    k = 0
    while True:
        while tenant_change_seen(directory, k):
            emit({"tenant_seen": k, "at": time.monotonic()})
            k += 1
        await asyncio.sleep(WATCH_S)


async def follow(config: dict[str, Any]) -> None:
    settings = RegistrySettings(
        store=config["store"],
        s3_endpoint_url=config["endpoint"],
        poll_interval_s=config["poll_interval_s"],
    )
    start = time.perf_counter()
    async with open_adapter_source(
        settings, StubEngine(), model_dir=Path(config["model_dir"]),
        base_model_name=TINY_MODEL_NAME, max_lora_rank=64, max_loras=4, max_cpu_loras=8,
        cache_root=Path(config["cache_root"]), metrics_registry=CollectorRegistry(),
    ) as registry, following_tenants(registry) as tenants:  # fmt: skip
        emit({
            "ready": time.perf_counter() - start,
            "adapters": len(registry.catalog.names()),
            "tenants": len(tenants.tenants()),
        })  # fmt: skip
        watchers = []
        while line := await asyncio.to_thread(sys.stdin.readline):  # until stdin closes
            match line.split():
                case ["watch"]:
                    watchers += [asyncio.create_task(watch(registry)),
                                 asyncio.create_task(watch_tenants(tenants))]  # fmt: skip
                case ["change", k]:
                    await change_tenant(tenants, int(k))
                    emit({"changed": int(k), "at": time.monotonic()})
        for watcher in watchers:
            watcher.cancel()


if __name__ == "__main__":
    asyncio.run(follow(json.loads(sys.argv[1])))
