"""The registry's Prometheus metrics, all in one place.

Tiers are `disk` (object store -> local disk), `cpu` (disk -> the engine's CPU cache) and `gpu`
(pinned in a GPU slot). Label values come from those three and from validation's fixed `reason`
labels, so cardinality stays bounded however many adapters exist.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

TIERS = ("disk", "cpu", "gpu")
# Loads span a few ms (a small adapter from page cache) to minutes (GBs from a slow store).
_LOAD_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RegistryMetrics:
    """Pass a fresh CollectorRegistry per instance when several live in one process (tests)."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.collector_registry = registry
        self.loads = Counter(
            "loraplex_adapter_loads_total", "Adapters loaded into a tier.", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.load_failures = Counter(
            "loraplex_adapter_load_failures_total", "Adapter loads into a tier that failed.",
            ["tier"], registry=registry,
        )  # fmt: skip
        self.load_seconds = Histogram(
            "loraplex_adapter_load_seconds", "Seconds to load an adapter into a tier.", ["tier"],
            buckets=_LOAD_BUCKETS, registry=registry,
        )  # fmt: skip
        # cpu: per request; disk: per load into the cpu tier (one for many requests waiting).
        self.hits = Counter(
            "loraplex_adapter_cache_hits_total",
            "Requests (disk: loads into the cpu tier) that found the adapter in a tier.",
            ["tier"], registry=registry,
        )  # fmt: skip
        self.misses = Counter(
            "loraplex_adapter_cache_misses_total",
            "Requests (disk: loads into the cpu tier) that had to load the adapter first.",
            ["tier"], registry=registry,
        )  # fmt: skip
        self.evictions = Counter(
            "loraplex_adapter_evictions_total", "Adapters evicted from a tier.", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.resident_bytes = Gauge(
            "loraplex_adapter_resident_bytes", "Bytes of adapter weights resident in a tier.",
            ["tier"], registry=registry,
        )  # fmt: skip
        self.resident = Gauge(
            "loraplex_adapter_resident", "Adapters resident in a tier.", ["tier"],
            registry=registry,
        )  # fmt: skip
        self.validation_failures = Counter(
            "loraplex_adapter_validation_failures_total", "Adapters refused at registration.",
            ["reason"], registry=registry,
        )  # fmt: skip
        self.registered = Gauge(
            "loraplex_adapters_registered", "Adapter names in the catalog.", registry=registry
        )
        self.quarantines = Counter(
            "loraplex_adapter_quarantines_total",
            "Adapter versions this replica quarantined (non-finite outputs, or an admin's word).",
            registry=registry,
        )  # fmt: skip
        self.quarantined = Gauge(
            "loraplex_adapters_quarantined", "Adapter versions quarantined in the catalog.",
            registry=registry,
        )  # fmt: skip
        for tier in TIERS:
            for metric in (self.loads, self.load_failures, self.hits, self.misses, self.evictions):
                metric.labels(tier)
            self.resident_bytes.labels(tier).set(0)
            self.resident.labels(tier).set(0)
