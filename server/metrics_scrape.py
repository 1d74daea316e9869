"""/metrics rendered off the event loop: what a scrape costs the streams it shares the loop with.

A whole /metrics of 20 tenants x 21 adapter labels is 61k samples, 5.7 MB, rendered by
prometheus_client in 0.54 s on an idle 2-core machine and 0.66 s p50 / 2.8 s p99 at load 4
(bench/metrics_render.py). On the event loop that stops every stream for as long. So the scrape
reads two kinds of collectors differently:

- `on_loop`: collectors that read the gateway's own state (queues, the adapters' phases, the
  engine's health), which only the event loop changes: they are collected on the loop, cheaply
  (the picker's families and vLLM's registry: 3 ms together), into a snapshot;
- `in_thread`: prometheus_client's own metrics (the per-tenant, per-adapter histograms and
  counters), which take a lock per child and so read consistently from any thread: collected
  and rendered in the scrape thread, with the snapshot, while the loop runs the streams.

The thread still takes the GIL from the loop in 5 ms turns, and the garbage collector, run by
whichever thread allocates, holds it for as long as a collection takes: a render keeps its 61k
samples (each a tuple and a dict) alive until it ends, so the generation-2 collections its
allocations trigger scan them all, 13 of them in 10 renders, the longest 1,076 ms, the loop's
longest lag 1,138 ms. The render frees all it made by reference counting (no cycles), so the
collector is paused while it runs: the loop's lag p99 25 ms (346 with the collector), a render
849 ms p50 (2,996), load average 9 (`python -m bench.metrics_render`: the loop's lag while a
render runs on the loop and in the thread). One render runs at a time;
the scrapes that arrive while one runs share the next, which starts when it ends, so any
number of scrapers cost at most one render at a time and none gets a render older than its
request.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import Metric
from prometheus_client.registry import Collector

from loraplex.server.metrics import exposition


class _Frozen(Collector):
    """Families collected earlier, rendered as they were."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _without_collector(*collectors: Collector) -> bytes:
    """`exposition(*collectors)`, the cyclic garbage collector paused meanwhile (module
    docstring). What other threads allocate meanwhile is collected once it resumes."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return exposition(*collectors)
    finally:
        if was_enabled:
            gc.enable()


class MetricsScrape:
    """Renders the exposition of `on_loop` then `in_thread` collectors (module docstring)."""

    def __init__(self, on_loop: Sequence[Collector], in_thread: Sequence[Collector]) -> None:
        self._on_loop = on_loop
        self._in_thread = in_thread
        self._thread: ThreadPoolExecutor | None = None  # started by the first render
        self._running: asyncio.Task[bytes] | None = None
        self._next: asyncio.Task[bytes] | None = None  # what scrapes arriving now will get

    def close(self) -> None:
        """Ends the scrape thread (the app's lifespan, at shutdown): a render still running
        finishes; a later render starts a thread again."""
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None

    async def render(self) -> bytes:
        """The exposition as of a moment after this call (never an earlier render's)."""
        if self._next is None:
            self._next = asyncio.create_task(self._render_after(self._running))
        # Shielded: a scrape whose client left does not cancel the render the others wait for.
        return await asyncio.shield(self._next)

    async def _render_after(self, before: asyncio.Task[bytes] | None) -> bytes:
        if before is not None:
            await asyncio.wait([before])
        self._running, self._next = self._next, None  # later scrapes wait for the next one
        try:
            snapshot = _Frozen([f for c in self._on_loop for f in c.collect()])
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="metrics-scrape")
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._thread, _without_collector, snapshot, *self._in_thread
            )
        finally:
            self._running = None
