"""Metric names, units and label bounds; the access-log middleware on a minimal ASGI app."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from loraplex.adapters_registry.names import RESERVED_NAMES
from loraplex.server.access_log import AccessLogMiddleware, record_of
from loraplex.server.metrics import (
    BASE_LABEL,
    NO_MODEL_LABEL,
    OTHER_LABEL,
    AdapterLabels,
    GatewayMetrics,
    exposition,
)
from loraplex.server.tenancy.record import RequestRecord

# Per metric type, how a name ends: histograms in a base unit; counters count things (their
# samples end in _total); gauges of requests count them by state; the health gauge is 0 or 1.
NAME_ENDINGS = {
    "histogram": ("_seconds", "_tokens_per_second"),
    "counter": ("_tokens", "_requests", "_rejections"),
    "gauge": ("_requests_queued", "_requests_running", "_healthy"),
}


def finished_record(adapter: str | None = "acme/bot") -> RequestRecord:
    r = RequestRecord("rid", "POST", "/v1/chat/completions", started=100.0)
    r.tenant, r.model, r.adapter, r.status = "acme", adapter or "base-model", adapter, 200
    r.queued_s, r.prompt_tokens, r.reached_engine = 0.02, 7, True
    r.on_tokens(1, 100.1)
    r.on_tokens(2, 100.3)
    r.on_tokens(1, 100.4)
    r.finished_at = 100.5
    return r


def test_record_derived_timings() -> None:
    r = finished_record()
    assert r.ttft_s == pytest.approx(0.1)
    assert r.tpot_s == pytest.approx(0.1)  # 0.3 s over 3 tokens after the first
    assert r.output_tokens_per_s == pytest.approx(4 / 0.4)
    assert r.e2e_s == pytest.approx(0.5)
    assert r.inter_token_latencies() == pytest.approx([0.1, 0.1, 0.1])


def test_tpot_and_gaps_are_per_sequence_when_n_streams_several() -> None:
    # n=2: both sequences get a token at each step, 0.1 s apart; the request's tokens double,
    # a sequence's time per token does not.
    r = RequestRecord("rid", "POST", "/v1/completions", started=100.0)
    for step in range(4):
        for choice in (0, 1):
            r.on_tokens(1, 100.1 + 0.1 * step, choice)
    assert r.completion_tokens == 8
    assert r.tpot_s == pytest.approx(0.1)
    assert r.inter_token_latencies() == pytest.approx([0.1] * 6)


def test_every_metric_is_prefixed_and_in_base_units() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, adapter_label_top_k=5)
    metrics.watch_queues(lambda: {"acme": (3, 2)})
    metrics.watch_engine(lambda: True)
    metrics.observe_request(finished_record())
    metrics.observe_rejection("acme", "requests_per_minute")
    families = [*registry.collect(), *metrics.live.collect()]
    assert {f.type for f in families} == set(NAME_ENDINGS)
    for family in families:
        assert family.name.startswith("loraplex_"), family.name
        assert ":" not in family.name
        assert family.name.endswith(NAME_ENDINGS[family.type]), (family.type, family.name)
        if family.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in family.samples)
    text = exposition(registry, metrics.live).decode()
    assert (
        'loraplex_time_to_first_token_seconds_count{adapter="acme/bot",tenant="acme"} 1.0' in text
    )
    assert 'loraplex_generation_tokens_total{adapter="acme/bot",tenant="acme"} 4.0' in text
    assert 'loraplex_prompt_tokens_total{adapter="acme/bot",tenant="acme"} 7.0' in text
    assert (
        'loraplex_requests_total{adapter="acme/bot",error_type="none",status="200",tenant="acme"}'
        in text
    )
    assert 'loraplex_rejections_total{reason="requests_per_minute",tenant="acme"} 1.0' in text
    assert 'loraplex_requests_queued{tenant="acme"} 3.0' in text
    assert "loraplex_engine_healthy 1.0" in text
    assert (
        'loraplex_inter_token_latency_seconds_count{adapter="acme/bot",tenant="acme"} 3.0' in text
    )


def test_adapter_label_is_bounded_and_stable() -> None:
    labels = AdapterLabels(top_k=2)
    assert labels(None) == "base"
    assert [labels(a) for a in ("x/1", "x/2", "x/3", "x/1", "x/4", "x/2")] == [
        "x/1",
        "x/2",
        OTHER_LABEL,
        "x/1",
        OTHER_LABEL,
        "x/2",
    ]


def test_an_adapter_named_with_its_version_is_counted_under_its_name() -> None:
    """A request may name `name@version`; the label never shows the version."""
    labels = AdapterLabels(top_k=2)
    version = "ab" * 32
    assert labels(f"x/1@{version}") == "x/1" and labels("x/1") == "x/1"
    assert labels(f"x/2@{version[:8]}") == "x/2" and labels("x/3") == OTHER_LABEL


def test_the_special_adapter_labels_are_names_no_registration_may_take() -> None:
    assert {BASE_LABEL, OTHER_LABEL, NO_MODEL_LABEL} == RESERVED_NAMES


def test_requests_refused_before_a_model_are_labelled_none() -> None:
    """An unknown adapter (404) or a bad key (401) reached no model: not `base`, and no slot
    of the adapter label's budget either."""
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, adapter_label_top_k=1)
    unknown = RequestRecord("rid", "POST", "/v1/chat/completions", started=100.0)
    unknown.tenant, unknown.status, unknown.error_type = "acme", 404, "model_not_found"
    metrics.observe_request(unknown)
    metrics.observe_request(finished_record(adapter=None))
    metrics.observe_request(finished_record(adapter="acme/bot"))
    text = generate_latest(registry).decode()
    for adapter, status, error in (
        ("none", "404", "model_not_found"),
        ("base", "200", "none"),
        ("acme/bot", "200", "none"),  # the one adapter slot is still free for it
    ):
        series = (
            f'loraplex_requests_total{{adapter="{adapter}",error_type="{error}",'
            f'status="{status}",tenant="acme"}} 1.0'
        )
        assert series in text


def test_adapter_label_can_be_left_out() -> None:
    registry = CollectorRegistry()
    GatewayMetrics(registry, adapter_label_top_k=0).observe_request(finished_record())
    text = generate_latest(registry).decode()
    assert "adapter=" not in text
    assert 'loraplex_time_to_first_token_seconds_count{tenant="acme"} 1.0' in text


def test_many_adapters_make_a_bounded_number_of_series() -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, adapter_label_top_k=3)
    for i in range(200):
        metrics.observe_request(finished_record(f"acme/a{i}"))
    ttft_series = {
        tuple(sorted(s.labels.items()))
        for f in registry.collect()
        if f.name == "loraplex_time_to_first_token_seconds"
        for s in f.samples
        if s.name.endswith("_count")
    }
    assert len(ttft_series) == 4  # three named adapters and `other`


def _app(metrics: GatewayMetrics) -> AccessLogMiddleware:
    async def chat(request: Request) -> StreamingResponse:
        record = record_of(request)
        assert record is not None
        record.tenant, record.model, record.adapter = "acme", "acme/bot", "acme/bot"

        async def body():
            for i in range(3):
                record.on_tokens(1, asyncio.get_running_loop().time())
                yield f"data: {i}\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def missing(request: Request) -> JSONResponse:
        err = {"message": "no", "type": "invalid_request_error", "code": "model_not_found"}
        return JSONResponse({"error": err}, status_code=404)

    app = Starlette(routes=[Route("/v1/chat", chat, methods=["POST"]), Route("/v1/x", missing)])
    return AccessLogMiddleware(app, metrics)


def test_access_log_honours_or_generates_request_id(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    app = _app(GatewayMetrics(registry, adapter_label_top_k=5))

    async def calls() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            given = await client.post("/v1/chat", headers={"x-request-id": "req-42"})
            generated = await client.post("/v1/chat", headers={"x-request-id": "bad id\n"})
            missing = await client.get("/v1/x")
            return given, generated, missing

    with caplog.at_level(logging.INFO, logger="loraplex.access"):
        given, generated, _ = asyncio.run(calls())
    assert given.headers["x-request-id"] == "req-42"
    assert len(generated.headers["x-request-id"]) == 32
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "loraplex.access"]
    assert [line["request_id"] for line in lines[:2]] == [
        "req-42",
        generated.headers["x-request-id"],
    ]
    first = lines[0]
    assert (first["tenant"], first["adapter"], first["status"]) == ("acme", "acme/bot", 200)
    assert first["completion_tokens"] == 3 and first["ttft_ms"] is not None
    assert (lines[2]["status"], lines[2]["error_type"]) == (404, "model_not_found")
    text = generate_latest(registry).decode()
    assert 'error_type="model_not_found",status="404",tenant="unknown"' in text
