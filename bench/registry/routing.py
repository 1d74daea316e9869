"""Routing lookup with 10,000 registered adapters: what the registry adds to each request.

    python -m bench.registry.routing [--adapters 10000] [--requests 200000]

Fills a real catalog with `--adapters` registrations (applied as log events, exactly as a replica
replays them), makes four of them resident in the engine tier (a stub engine that loads nothing:
the engine's own cost is not the registry's), then times per request:

- resolve: `registry.resolve(model)` for random names (name check + catalog lookup);
- lease: `async with registry.lease(model)` enter and exit on a warm adapter (the whole
  per-request registry path the gateway runs: resolve, hold, release).

Prints mean/p50/p99 in microseconds and appends JSON rows to bench/results/registry_routing.jsonl.
Target: < 50 us per request.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry
from rich.console import Console
from rich.table import Table

from bench.common import append_rows, stamp
from bench.registry.stubs import StubEngine, write_tiny_model
from loraplex.adapters_registry.events import Registered
from loraplex.adapters_registry.lifecycle import build_registry
from loraplex.adapters_registry.records import FileEntry, VersionRecord
from loraplex.adapters_registry.settings import RegistrySettings


def pcts(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "mean_us": statistics.fmean(ordered) * 1e6,
        "p50_us": ordered[len(ordered) // 2] * 1e6,
        "p99_us": ordered[int(len(ordered) * 0.99)] * 1e6,
    }


async def run(adapters: int, requests: int) -> dict[str, dict[str, float]]:
    work = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    registry = await build_registry(
        RegistrySettings(), StubEngine(), model_dir=write_tiny_model(work / "model"),
        base_model_name="tiny", max_lora_rank=64, max_loras=4, max_cpu_loras=8,
        cache_root=work / "cache", metrics_registry=CollectorRegistry(),
    )  # fmt: skip
    files = (FileEntry("adapter_model.safetensors", "0" * 64, 1000),)
    names = [f"tenant{i % 100}/adapter-{i}" for i in range(adapters)]
    for i, name in enumerate(names, start=1):
        version = f"{i:064x}"
        record = VersionRecord(name, version, i, 16, files, "tiny", "s3://b/p", 0.0)
        registry.catalog.apply(i, Registered(name=name, record=record, pinned=False))
    warm = random.sample(names, 4)
    for name in warm:
        record = registry.resolve(name)
        await registry.tiers.load(registry.residency.servable(record), record.size_bytes)

    rng = random.Random(0)
    resolve_s, lease_s = [], []
    for _ in range(requests):
        name = names[rng.randrange(adapters)]
        t = time.perf_counter()
        registry.resolve(name)
        resolve_s.append(time.perf_counter() - t)
    for i in range(requests):
        name = warm[i % 4]
        t = time.perf_counter()
        async with registry.lease(name):
            pass
        lease_s.append(time.perf_counter() - t)
    return {"resolve": pcts(resolve_s), "lease (warm)": pcts(lease_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--requests", type=int, default=200_000)
    args = parser.parse_args()
    results = asyncio.run(run(args.adapters, args.requests))
    table = Table(
        title=f"registry routing with {args.adapters} adapters ({args.requests} requests)"
    )
    for col in ("path", "mean us", "p50 us", "p99 us", "target"):
        table.add_column(col)
    for path, r in results.items():
        table.add_row(path, f"{r['mean_us']:.2f}", f"{r['p50_us']:.2f}", f"{r['p99_us']:.2f}",
                      "< 50 us")  # fmt: skip
    console = Console()
    console.print(table)
    config = {"adapters": args.adapters, "requests": args.requests}
    rows = [{**stamp(), "bench": "registry_routing", "path": path, "config": config, **r,
             "target_us": 50.0} for path, r in results.items()]  # fmt: skip
    console.print(f"wrote {append_rows('registry_routing', rows)}")


if __name__ == "__main__":
    main()
