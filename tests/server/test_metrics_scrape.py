"""/metrics off the event loop (server/metrics_scrape.py): which thread reads which collector,
one render at a time shared by the scrapes that wait for it, and the loop running meanwhile."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.server.metrics import exposition
from loraplex.server.metrics_scrape import MetricsScrape

WAIT_S = 10.0  # only a broken scrape waits this long: the tests assert order, not time


class CollectorState(Collector):
    """Notes whether the garbage collector runs while it is collected."""

    def __init__(self) -> None:
        self.gc_enabled: list[bool] = []

    def collect(self) -> Iterator[Metric]:
        self.gc_enabled.append(gc.isenabled())
        yield GaugeMetricFamily("loraplex_state", "State.", value=1)


class Numbered(Collector):
    """A gauge whose value counts its collections; it notes the thread of each, and may hold
    a collection until `release` is set."""

    def __init__(self, name: str, hold: bool = False) -> None:
        self.name = name
        self.count = 0
        self.threads: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def collect(self) -> Iterator[Metric]:
        self.count += 1
        self.threads.append(threading.get_ident())
        self.started.set()
        if not self.release.wait(WAIT_S):
            raise TimeoutError("the collection was never released")
        yield GaugeMetricFamily(self.name, "Collections so far.", value=self.count)


def value(body: bytes, name: str) -> float:
    line = next(x for x in body.decode().splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def test_the_exposition_of_both_with_the_live_part_read_on_the_loop() -> None:
    async def run() -> None:
        registry = CollectorRegistry()
        Counter("loraplex_things", "Things.", ["tenant"], registry=registry).labels("acme").inc(3)
        live = CollectorRegistry()
        Counter("loraplex_live", "Live.", registry=live).inc()
        body = await MetricsScrape([live], [registry]).render()
        assert body == exposition(live, registry)
        assert 'loraplex_things_total{tenant="acme"} 3.0' in body.decode()

    asyncio.run(run())


def test_live_collectors_run_on_the_loop_the_others_in_the_scrape_thread() -> None:
    async def run() -> None:
        live, slow = Numbered("loraplex_live"), Numbered("loraplex_slow")
        body = await MetricsScrape([live], [slow]).render()
        assert (value(body, "loraplex_live"), value(body, "loraplex_slow")) == (1, 1)
        assert live.threads == [threading.get_ident()]  # the loop's thread
        assert slow.threads != [threading.get_ident()]

    asyncio.run(run())


def test_scrapes_during_a_render_share_the_next_never_an_older_one() -> None:
    async def run() -> None:
        slow = Numbered("loraplex_slow", hold=True)
        scrape = MetricsScrape([], [slow])
        first = asyncio.create_task(scrape.render())
        assert await asyncio.to_thread(slow.started.wait, WAIT_S)  # render 1 holds the thread
        later = [asyncio.create_task(scrape.render()) for _ in range(3)]
        await asyncio.sleep(0)
        slow.release.set()
        bodies = await asyncio.gather(first, *later)
        assert value(bodies[0], "loraplex_slow") == 1
        assert [value(b, "loraplex_slow") for b in bodies[1:]] == [2, 2, 2]
        assert slow.count == 2
        assert value(await scrape.render(), "loraplex_slow") == 3  # a new scrape: a new render

    asyncio.run(run())


def test_the_loop_runs_while_a_render_holds_the_thread() -> None:
    async def run() -> None:
        # The render waits for a task on the loop: were it on the loop, neither could go on.
        slow = Numbered("loraplex_slow", hold=True)
        scrape = MetricsScrape([], [slow])
        render = asyncio.create_task(scrape.render())
        assert await asyncio.to_thread(slow.started.wait, WAIT_S)
        ticks = 0
        for _ in range(5):
            await asyncio.sleep(0)
            ticks += 1
        assert not render.done()
        slow.release.set()
        assert value(await render, "loraplex_slow") == 1
        assert ticks == 5

    asyncio.run(run())


def test_a_scrape_that_leaves_does_not_cancel_the_render_others_wait_for() -> None:
    async def run() -> None:
        slow = Numbered("loraplex_slow", hold=True)
        scrape = MetricsScrape([], [slow])
        first = asyncio.create_task(scrape.render())
        assert await asyncio.to_thread(slow.started.wait, WAIT_S)
        leaving, staying = (
            asyncio.create_task(scrape.render()),
            asyncio.create_task(scrape.render()),
        )
        await asyncio.sleep(0)
        leaving.cancel()
        slow.release.set()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert value(await staying, "loraplex_slow") == 2
        assert value(await first, "loraplex_slow") == 1

    asyncio.run(run())


def test_a_failed_render_fails_its_scrapes_and_the_next_one_renders() -> None:
    async def run() -> None:
        class Broken(Collector):
            def collect(self) -> Iterator[Metric]:
                raise RuntimeError("collector broke")

        registry = CollectorRegistry()
        broken = Broken()
        registry.register(broken)
        scrape = MetricsScrape([], [registry])
        with pytest.raises(RuntimeError, match="collector broke"):
            await scrape.render()
        registry.unregister(broken)
        assert await scrape.render() == b""

    asyncio.run(run())


def test_the_garbage_collector_pauses_for_a_render_and_resumes_after_it() -> None:
    async def run() -> None:
        state = CollectorState()
        registry = CollectorRegistry()
        registry.register(state)
        scrape = MetricsScrape([], [registry])
        await scrape.render()
        assert state.gc_enabled == [False] and gc.isenabled()

        class Broken(Collector):
            def collect(self) -> Iterator[Metric]:
                raise RuntimeError("collector broke")

        registry.register(Broken())
        with pytest.raises(RuntimeError):
            await scrape.render()
        assert gc.isenabled()

    assert gc.isenabled()
    asyncio.run(run())


def test_closing_ends_the_scrape_thread_and_a_later_render_starts_one() -> None:
    async def run() -> None:
        slow = Numbered("loraplex_slow")
        scrape = MetricsScrape([], [slow])
        await scrape.render()
        (ident,) = slow.threads
        (thread,) = [t for t in threading.enumerate() if t.ident == ident]
        assert thread.name.startswith("metrics-scrape")
        scrape.close()
        thread.join(WAIT_S)
        assert not thread.is_alive()
        body = await scrape.render()  # after close: a thread of its own again
        assert value(body, "loraplex_slow") == 2
        (again,) = [t for t in threading.enumerate() if t.ident == slow.threads[1]]
        assert again is not thread and again.name.startswith("metrics-scrape")
        scrape.close()

    asyncio.run(run())
