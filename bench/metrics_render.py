"""What one scrape of /metrics costs the gateway's event loop, and what the endpoint picker's
scrape costs: the picker reads every replica every 50 ms.

In process, no engine: vLLM's registry as its Prometheus logger builds it for the embedded model
(`PrometheusStatLogger` over the engine's config), loraplex's own metrics after `--tenants`
tenants each sent requests to `--adapters` adapters (the adapter label keeps the first
`adapter_label_top_k`), and the picker's gauges with `--adapters` adapters resident in the
engine, a quarter of them decoding and a quarter waiting. Renders, timed `--n` times each:

- `metrics`: the whole of /metrics (vLLM's registry as served, then loraplex's);
- `vllm_registry`: vLLM's registry as /metrics serves it, alone;
- `picker`: /metrics/picker, only the families the picker reads;
- `vllm_lora_history`: vLLM's own `vllm:lora_requests_info` after `--combinations` different
  adapter sets were seen (it keeps a series for each), the gauge loraplex no longer serves.

Then what a whole /metrics costs the event loop it is served from, side by side: `--n` scrapes
rendered on the loop (`scrape_on_loop`, the render inline in the handler) against as the server
serves them (`scrape_in_thread`, server/metrics_scrape.py), while a probe task on the loop
sleeps 2 ms and writes to a socket, as a stream's turn does: the probe's lag (its wake-up past
the 2 ms) is what every stream's next token waits.

    python -m bench.metrics_render [--adapters 64] [--tenants 20] [--combinations 5000]

Prints a table and appends rows to bench/results/metrics_render.jsonl.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import socket
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Gauge, generate_latest

from bench.common import append_rows, stamp
from loraplex.adapters_registry.base import ServableAdapter
from loraplex.server.lora_activity import LoraActivity, Phase
from loraplex.server.metrics import GatewayMetrics, exposition
from loraplex.server.metrics_scrape import MetricsScrape
from loraplex.server.picker_metrics import (
    LORA_INFO,
    EngineMetrics,
    PickerMetrics,
    picker_exposition,
)
from loraplex.server.tenancy.record import RequestRecord


def vllm_registry() -> None:
    """vLLM's metrics in the default registry, as the engine's Prometheus logger makes them."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from loraplex.server.engine.builder import engine_args, vllm_namespace
    from loraplex.server.model_choice import choose_served_model
    from loraplex.server.settings import Settings

    settings = Settings()
    served = choose_served_model(settings)
    namespace = vllm_namespace(settings.engine, served.model_dir, served.name)
    config = engine_args(settings.engine, namespace).create_engine_config()
    PrometheusStatLogger(config, [0]).log_engine_initialized()  # adds vllm:cache_config_info


def loraplex_registry(tenants: int, adapters: int) -> GatewayMetrics:
    metrics = GatewayMetrics(CollectorRegistry(), adapter_label_top_k=20)
    for t in range(tenants):
        for a in range(adapters):
            record = RequestRecord("r", "POST", "/v1/chat/completions", started=0.0)
            record.tenant, record.model, record.adapter = f"tenant-{t}", f"a{a}", f"a{a}"
            record.status, record.prompt_tokens, record.reached_engine = 200, 10, True
            record.queued_s = 0.01
            record.on_tokens(1, 0.1)
            record.on_tokens(1, 0.2)
            record.finished_at = 0.3
            metrics.observe_request(record)
    return metrics


def timed(render: Callable[[], bytes], n: int) -> dict[str, float]:
    render()  # warm
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        body = render()
        seconds.append(time.perf_counter() - start)
    return {
        "p50_ms": statistics.median(seconds) * 1e3,
        "p99_ms": statistics.quantiles(seconds, n=100)[98] * 1e3,
        "bytes": len(body),
    }


PROBE_SLEEP_S = 0.002


async def _probe(lags: list[float], stop: asyncio.Event) -> None:
    """Sleep 2 ms, then write to a socket (a syscall that lets go of the GIL), as a stream's
    turn does; note how late each wake-up came."""
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        b.setblocking(False)
        while not stop.is_set():
            start = time.perf_counter()
            await asyncio.sleep(PROBE_SLEEP_S)
            lags.append(time.perf_counter() - start - PROBE_SLEEP_S)
            a.send(b"x" * 64)
            b.recv(4096)


async def _loop_lag(render: Callable[[], Any], n: int) -> dict[str, float]:
    """`n` renders one after another (awaited when `render` gives an awaitable) beside the
    probe: the renders' wall time and the probe's lag."""
    lags: list[float] = []
    stop = asyncio.Event()
    probe = asyncio.create_task(_probe(lags, stop))
    await asyncio.sleep(0.05)
    lags.clear()
    seconds = []
    for _ in range(n):
        start = time.perf_counter()
        body = render()
        if asyncio.iscoroutine(body):
            body = await body
        seconds.append(time.perf_counter() - start)
        await asyncio.sleep(0)
    stop.set()
    await probe
    return {
        "p50_ms": statistics.median(seconds) * 1e3,
        "p99_ms": statistics.quantiles(seconds, n=100)[98] * 1e3,
        "bytes": len(body),
        "loop_lag_p50_ms": statistics.median(lags) * 1e3,
        "loop_lag_p99_ms": statistics.quantiles(lags, n=100, method="inclusive")[98] * 1e3,
        "loop_lag_max_ms": max(lags) * 1e3,
        "probes": len(lags),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--combinations", type=int, default=5000)
    parser.add_argument("--n", type=int, default=50)
    args = parser.parse_args()

    vllm_registry()
    metrics = loraplex_registry(args.tenants, args.adapters)
    gc.collect()  # what the server does once started (app._freeze_startup_heap): a collection
    gc.freeze()  # during a render then scans only what was made since, not vLLM's imports
    activity = LoraActivity()
    residents = [
        (ServableAdapter(f"org/adapter-{i}", "0" * 64, i + 1, Path("/x"), 16), i % 8 == 0)
        for i in range(args.adapters)
    ]
    picker = PickerMetrics(max(1, args.adapters // 4), activity, lambda: residents)
    metrics.live.register(picker)
    engine = EngineMetrics(REGISTRY, activity)

    history = CollectorRegistry()
    labels = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
    gauge = Gauge(LORA_INFO, "vLLM's.", labels, registry=history)
    rng = random.Random(0)
    names = [f"org/adapter-{i}@{'0' * 64}" for i in range(args.adapters)]
    for _ in range(args.combinations):
        running = ",".join(rng.sample(names, 4))
        gauge.labels("16", ",".join(rng.sample(names, 2)), running).set_to_current_time()

    with ExitStack() as stack:
        for i in range(args.adapters // 2):
            request = stack.enter_context(activity.track(f"org/adapter-{i}", 1))
            if i % 2:
                request.enter(Phase.RUNNING)
        results = {
            "metrics": timed(lambda: exposition(engine, metrics.live, metrics.registry), args.n),
            "vllm_registry": timed(lambda: exposition(engine), args.n),
            "picker": timed(lambda: picker_exposition(REGISTRY, picker, activity), args.n),
            "vllm_lora_history": timed(lambda: generate_latest(history), args.n),
        }
        scrape = MetricsScrape([engine, metrics.live], [metrics.registry])
        results["scrape_on_loop"] = asyncio.run(
            _loop_lag(lambda: exposition(engine, metrics.live, metrics.registry), args.n)
        )
        results["scrape_in_thread"] = asyncio.run(_loop_lag(scrape.render, args.n))

    config = {k: getattr(args, k) for k in ("adapters", "tenants", "combinations", "n")}
    load = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    print(f"{'render':<20}{'p50 ms':>10}{'p99 ms':>10}{'bytes':>10}{'x picker':>10}"
          f"{'loop lag p99 ms':>17}{'loop lag max ms':>17}")  # fmt: skip
    for name, r in results.items():
        ratio = r["p50_ms"] / results["picker"]["p50_ms"]
        lag = (f"{r['loop_lag_p99_ms']:>17.1f}{r['loop_lag_max_ms']:>17.1f}"
               if "loop_lag_p99_ms" in r else "")  # fmt: skip
        print(f"{name:<20}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['bytes']:>10}{ratio:>10.1f}"
              + lag)  # fmt: skip
        rows.append({**stamp(), "config": config, "render": name, **r, "load_avg_1m": load})
    print(f"rows -> {append_rows('metrics_render', rows)}")


if __name__ == "__main__":
    main()
