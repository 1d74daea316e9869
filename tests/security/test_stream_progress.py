"""Issue 45, "one request freezes the gateway": a bystander's stream keeps flowing, unchanged,
while the heaviest work one client can make the gateway do per step or per scrape runs beside
it: scrapes of /metrics one after another (rendered off the event loop,
server/metrics_scrape.py), and mallory's stream of n choices with 20 top logprobs at every token
(held flat in vLLM's front end, server/engine/finite_guard.py). These assert order and output,
not time; what each costs the other streams' inter-token latency is `python -m bench.stall`'s
(kinds metrics_scrape, n16_stream, logprobs_response).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from bench.loadgen.server import LiveServer
from tests.support.bystanders import BOB_KEY, MALLORY_KEY, METRICS_TOKEN, Bystanders, base_model

TOP = 20


class Timeline:
    """Events of several threads in the order they happened."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[tuple[str, int]] = []  # (what, which)

    def note(self, what: str, which: int = 0) -> None:
        with self._lock:
            self.events.append((what, which))


def _stream(
    server: LiveServer, key: str, body: dict[str, Any], on_chunk: Callable[[dict[str, Any]], None]
) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body,
                      "stream": True}, headers=headers, timeout=600) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                on_chunk(json.loads(line[6:]))


def _bob_body(server: LiveServer) -> dict[str, Any]:
    return {"model": base_model(server), "temperature": 0, "max_tokens": 48, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Name three rivers in Europe."}]}  # fmt: skip


def _bob_text(server: LiveServer, on_token: Callable[[], None] = lambda: None) -> str:
    """Bob's greedy stream's text; `on_token` runs as each piece of it arrives."""
    parts: list[str] = []

    def on_chunk(chunk: dict[str, Any]) -> None:
        for choice in chunk["choices"]:
            if choice["delta"].get("content"):
                parts.append(choice["delta"]["content"])
                on_token()

    _stream(server, BOB_KEY, _bob_body(server), on_chunk)
    return "".join(parts)


def _during(events: list[tuple[str, int]], what: str, inside: tuple[str, str]) -> int:
    """How many `what` events came while at least one `inside` span (start, end events of one
    `which`) was open."""
    open_spans: set[int] = set()
    count = 0
    start, end = inside
    for name, which in events:
        if name == start:
            open_spans.add(which)
        elif name == end:
            open_spans.discard(which)
        elif name == what and open_spans:
            count += 1
    return count


def test_a_stream_flows_unchanged_while_metrics_are_scraped_without_pause(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    clean = _bob_text(shared_server)
    timeline = Timeline()
    bob_done = threading.Event()
    bodies: list[str] = []

    def scrape_until_bob_is_done(scraper: int) -> None:
        headers = {"Authorization": f"Bearer {METRICS_TOKEN}"}
        n = 0
        with httpx.Client(base_url=shared_server.base_url, headers=headers, timeout=120) as c:
            while not bob_done.is_set():
                which = scraper * 1_000_000 + n
                timeline.note("scrape", which)
                r = c.get("/metrics")
                timeline.note("scraped", which)
                assert r.status_code == 200, r.text
                bodies.append(r.text)
                n += 1

    with ThreadPoolExecutor(4) as pool:
        scrapers = [pool.submit(scrape_until_bob_is_done, i) for i in range(3)]
        try:
            text = _bob_text(shared_server, lambda: timeline.note("bob"))
        finally:
            bob_done.set()
        for scraper in scrapers:
            scraper.result()

    assert text == clean
    assert _during(timeline.events, "bob", ("scrape", "scraped")) > 0, timeline.events
    for body in bodies:  # the loop's part, the scrape thread's part and vLLM's, every time
        for family in ("loraplex_requests_queued", "loraplex_requests_total",
                       "vllm:lora_requests_info", "vllm:num_requests_running"):  # fmt: skip
            assert family in body
    bystanders.assert_unchanged()


def test_a_stream_flows_unchanged_beside_n_choices_with_20_top_logprobs(
    shared_server: LiveServer, bystanders: Bystanders
) -> None:
    clean = _bob_text(shared_server)
    timeline = Timeline()
    n, tokens = 8, 24  # n=8: bob's request and mallory's fit max_running (16) side by side
    body = {"model": base_model(shared_server), "n": n, "max_tokens": tokens, "ignore_eos": True,
            "temperature": 1.0, "seed": 0, "logprobs": True, "top_logprobs": TOP,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}  # fmt: skip
    entries: dict[int, list[dict[str, Any]]] = {i: [] for i in range(n)}
    bob_started = threading.Event()

    def mallory() -> None:
        assert bob_started.wait(300)
        timeline.note("mallory")

        def on_chunk(chunk: dict[str, Any]) -> None:
            for choice in chunk["choices"]:
                entries[choice["index"]] += (choice.get("logprobs") or {}).get("content") or []
            timeline.note("chunk")

        _stream(shared_server, MALLORY_KEY, body, on_chunk)
        timeline.note("mallory done")

    def on_bob_token() -> None:
        timeline.note("bob")
        bob_started.set()  # mallory starts once bob is decoding

    with ThreadPoolExecutor(2) as pool:
        heavy = pool.submit(mallory)
        text = pool.submit(_bob_text, shared_server, on_bob_token).result()
        heavy.result()

    assert text == clean
    assert _during(timeline.events, "bob", ("mallory", "mallory done")) > 0, timeline.events
    assert {i: len(e) for i, e in entries.items()} == dict.fromkeys(range(n), tokens)
    for choice in entries.values():
        for entry in choice:  # 20 alternatives each, best first beside the sampled token
            tops = entry["top_logprobs"]  # (which vLLM's server lists first)
            others = [top["logprob"] for top in tops if top["token"] != entry["token"]]
            assert len(tops) == TOP and others == sorted(others, reverse=True)
            assert all(-9999.0 <= top["logprob"] <= 0.0 for top in tops)
    bystanders.assert_unchanged()
