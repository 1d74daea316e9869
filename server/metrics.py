"""Every gateway metric, in one place, with Prometheus naming (`loraplex_` prefix, base units).

Latencies are per tenant and, optionally, per adapter. The adapter label is bounded: the first
`adapter_label_top_k` adapters seen get their own value, every later one is `other`, requests
to the base model are `base`, and requests refused before they reached a model (no valid key, an
unknown model, a malformed body) are `none`. Labels never change once given, so each series is
stable for the life of the process and the series count is bounded by tenants x (K + 3). No
adapter can be registered under the three special values (`names.RESERVED_NAMES`). With
K = 0 the adapter label is left out entirely. vLLM's engine metrics (`vllm:` prefix) live in the
default registry and are exposed on the same endpoint by the app; this module defines loraplex's
own, and `picker_metrics` what an endpoint picker reads under vLLM's names.

Adapter names in metrics never carry a version: a request that names `name@version` is counted
under `name`, and the engine's LoRA names (`name@<sha256>`, server/engine/client.py) never reach
/metrics (`picker_metrics` serves the LoRA gauges in vLLM's stead). Versions are for the admin
API; who may read /metrics at all is `metrics_access`'s question.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.server.tenancy.record import RequestRecord

BASE_LABEL = "base"
OTHER_LABEL = "other"
NO_MODEL_LABEL = "none"

# Buckets cover a CPU demo (TTFT of seconds) and a GPU (tens of milliseconds) alike. Neighbours
# are at most 1.25x apart where medians are read (TTFT, OTPS), so histogram_quantile's linear
# interpolation stays within about 20% of the exact median the access log records.
TTFT_BUCKETS = (
    *(0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2),
    *(0.25, 0.3, 0.4, 0.5, 0.6, 0.8, 1, 1.25, 1.5, 2, 2.5, 3, 4, 5, 7.5, 10, 20, 60),
)
_ITL_BUCKETS = (
    *(0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.125),
    *(0.15, 0.2, 0.3, 0.5, 1, 2),
)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 60, 120, 300)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
OTPS_BUCKETS = (
    *(0.5, 1, 2, 3, 4, 5, 6, 8, 10, 12.5, 15, 20, 25, 30, 40, 50, 60, 80, 100),
    *(125, 150, 200, 250, 300, 400, 500, 600, 800, 1000, 1250, 1500, 2000, 3000),
)


def adapter_name(reference: str) -> str:
    """`name@version` -> `name` (adapter names never hold `@`: adapters_registry/names.py)."""
    return reference.split("@", 1)[0]


class AdapterLabels:
    """Bounded values for the adapter label: the first K adapters seen, then `other`."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._given: set[str] = set()

    def __call__(self, adapter: str | None) -> str:
        if adapter is None:
            return BASE_LABEL
        adapter = adapter_name(adapter)
        if adapter in self._given:
            return adapter
        if len(self._given) < self.top_k:
            self._given.add(adapter)
            return adapter
        return OTHER_LABEL


class _QueueCollector(Collector):
    """Queued and running requests per tenant, read from the dispatcher at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, tuple[int, int]]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily]:
        queued = GaugeMetricFamily(
            "loraplex_requests_queued", "Requests waiting for an engine slot.", labels=["tenant"]
        )
        running = GaugeMetricFamily(
            "loraplex_requests_running", "Requests holding an engine slot.", labels=["tenant"]
        )
        for tenant, (q, r) in sorted(self._snapshot().items()):
            queued.add_metric([tenant], q)
            running.add_metric([tenant], r)
        yield queued
        yield running


class _EngineCollector(Collector):
    def __init__(self, healthy: Callable[[], bool]) -> None:
        self._healthy = healthy

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "loraplex_engine_healthy",
            "1 while the inference engine is alive, 0 once it has died.",
            value=1.0 if self._healthy() else 0.0,
        )


class GatewayMetrics:
    """`registry` holds prometheus_client's own metrics, which any thread may read (each child
    under its lock); `live` the collectors that read the gateway's state at scrape time, which
    only the event loop may (metrics_scrape renders the two accordingly)."""

    def __init__(self, registry: CollectorRegistry, adapter_label_top_k: int) -> None:
        self.registry = registry
        self.live = CollectorRegistry()
        self._adapters = AdapterLabels(adapter_label_top_k)
        per_request = ["tenant", "adapter"] if adapter_label_top_k else ["tenant"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, per_request, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        self.ttft = hist(
            "loraplex_time_to_first_token_seconds",
            "Arrival to first generated token, queueing included.",
            TTFT_BUCKETS,
        )
        self.itl = hist(
            "loraplex_inter_token_latency_seconds", "Gap between generated tokens.", _ITL_BUCKETS
        )
        self.tpot = hist(
            "loraplex_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            _ITL_BUCKETS,
        )
        self.otps = hist(
            "loraplex_request_output_tokens_per_second",
            "Output tokens per second of each request (arrival to last token).",
            OTPS_BUCKETS,
        )
        self.e2e = hist(
            "loraplex_e2e_request_latency_seconds", "Arrival to end of response.", _E2E_BUCKETS
        )
        self.queue_time = Histogram(
            "loraplex_request_queue_time_seconds",
            "Time waiting for an engine slot in the fair queue.",
            ["tenant"],
            buckets=_QUEUE_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = counter(
            "loraplex_prompt_tokens", "Prompt tokens of requests the engine took.", per_request
        )
        self.generation_tokens = counter(
            "loraplex_generation_tokens", "Generated tokens.", per_request
        )
        self.requests = counter(
            "loraplex_requests",
            "Finished requests by HTTP status and error type (`none` when it succeeded).",
            [*per_request, "status", "error_type"],
        )
        self.rejections = counter(
            "loraplex_rejections",
            "Requests refused by admission, by reason (quota name, queue_full, unauthorized).",
            ["tenant", "reason"],
        )
        # The shared quota store (tenancy.quota_store); they stay at their initial values
        # without one.
        self.quota_store_healthy = Gauge(
            "loraplex_quota_store_healthy",
            "1 while the shared quota store answers (or none is configured), 0 while it is "
            "unreachable.",
            registry=registry,
        )
        self.quota_store_healthy.set(1)
        self.quota_store_failed_requests = counter(
            "loraplex_quota_store_failed_requests",
            "Requests to the shared quota store (Redis) that failed or timed out, by operation "
            "(acquire, release, renew).",
            ["operation"],
        )
        self.quota_store_bypassed_requests = counter(
            "loraplex_quota_store_bypassed_requests",
            "Requests admitted or refused without the unreachable quota store, by "
            "tenancy.quota_store_failure: open (decided on this replica's own quotas) or closed "
            "(refused 503).",
            ["tenant", "failure_mode"],
        )
        self._per_adapter = bool(adapter_label_top_k)

    def watch_queues(self, snapshot: Callable[[], dict[str, tuple[int, int]]]) -> None:
        """Export `{tenant: (queued, running)}` as gauges, read at every scrape."""
        self.live.register(_QueueCollector(snapshot))

    def watch_engine(self, healthy: Callable[[], bool]) -> None:
        """Export `loraplex_engine_healthy` (1 or 0), read at every scrape: what alerts watch."""
        self.live.register(_EngineCollector(healthy))

    def _labels(self, record: RequestRecord) -> list[str]:
        tenant = record.tenant or "unknown"
        if not self._per_adapter:
            return [tenant]
        # The route sets the model once it resolved one (an adapter that exists, or the base).
        return [tenant, NO_MODEL_LABEL if record.model is None else self._adapters(record.adapter)]

    def observe_rejection(self, tenant: str, reason: str) -> None:
        self.rejections.labels(tenant, reason).inc()

    def observe_request(self, record: RequestRecord) -> None:
        """Record a finished request (called once, after its last byte)."""
        labels = self._labels(record)
        status = str(record.status)
        self.requests.labels(*labels, status, record.error_type or "none").inc()
        if record.tenant is None or record.model is None:
            return  # refused before it named a model: counted above, nothing else to time
        if record.queued_s is not None:
            self.queue_time.labels(labels[0]).observe(record.queued_s)
        if record.prompt_tokens and record.reached_engine:
            self.prompt_tokens.labels(*labels).inc(record.prompt_tokens)
        if record.completion_tokens:
            self.generation_tokens.labels(*labels).inc(record.completion_tokens)
        for value, metric in (
            (record.ttft_s, self.ttft),
            (record.tpot_s, self.tpot),
            (record.output_tokens_per_s, self.otps),
            (record.e2e_s, self.e2e),
        ):
            if value is not None:
                metric.labels(*labels).observe(value)
        itl = self.itl.labels(*labels)
        for gap in record.inter_token_latencies():
            itl.observe(gap)


def exposition(*registries: Collector) -> bytes:
    """The text format of several registries, one after the other (their names never clash)."""
    return b"".join(generate_latest(r) for r in registries)


METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST
