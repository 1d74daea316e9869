"""What an endpoint picker reads from a replica's /metrics, under vLLM's names.

The Gateway API Inference Extension's model server protocol, as llm-d-router's core metrics
extractor and `lora-affinity-scorer` read it (README, "Running a fleet"), scraped every 50 ms:

- `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`: one series,
  its value the time of the scrape (the lists are computed then; the picker takes the series of
  highest value). `running`: the adapters whose requests the engine is decoding (lora_activity's
  RUNNING phase) and the pinned ones (kept in a GPU slot for good). `waiting`: the adapters with
  requests admitted and not yet producing output, in the gateway or the engine, less the running
  ones, so the two lists never share a name. Names as clients send them, without versions.
- `vllm:num_requests_waiting`: vLLM's own count plus the sequences in the gateway's phase (the
  fair queue, adapter fetches and loads), so the queue scorer sees what waits here whatever
  holds it; `vllm:num_requests_running` and `vllm:kv_cache_usage_perc` are vLLM's own.
- `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}` (1, one series per adapter in the
  engine: `gpu` while pinned or running, `cpu` otherwise), `vllm:max_gpu_lora_adapters`,
  `vllm:num_gpu_loaded_lora_adapters` and `vllm:num_cpu_loaded_lora_adapters`: the residency
  gauges vLLM is adopting (vLLM PRs #51433 / #54830; llm-d-router's `lora-load-state-scorer`).

vLLM's own `vllm:lora_requests_info` is not served: it adds a series for every combination of
adapters ever seen and never drops one (its render cost grows with the fleet's history), names
the engine's LoRAs (`name@sha256`), and lists every adapter as running and waiting at once
(llm-d-router #2605). The engine client stops vLLM from updating it (engine/client.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from loraplex.adapters_registry.base import ServableAdapter
from loraplex.server.lora_activity import LoraActivity, Phase
from loraplex.server.metrics import exposition

LORA_INFO = "vllm:lora_requests_info"
REQUESTS_WAITING = "vllm:num_requests_waiting"
GATEWAY_WAITING = "loraplex_gateway_waiting_sequences"
# vLLM's families the picker reads (llm-d-router's `vllm` engine config).
PICKER_ENGINE_FAMILIES = (
    REQUESTS_WAITING,
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)

# (adapter, pinned) for each adapter in the engine's CPU cache or GPU slots.
Residents = Callable[[], Iterable[tuple[ServableAdapter, bool]]]


class PickerMetrics(Collector):
    """The families of the module docstring that loraplex builds, read at every scrape."""

    def __init__(self, max_loras: int, activity: LoraActivity, residents: Residents) -> None:
        self._max_loras = max_loras
        self._activity = activity
        self._residents = residents

    def collect(self) -> Iterator[Metric]:
        residents = list(self._residents())
        pinned = {adapter.name for adapter, is_pinned in residents if is_pinned}
        decoding = self._activity.adapters(Phase.RUNNING)
        running = decoding | pinned
        waiting = (
            self._activity.adapters(Phase.GATEWAY) | self._activity.adapters(Phase.ENGINE)
        ) - running
        info = GaugeMetricFamily(
            LORA_INFO,
            "Adapters decoding or in a GPU slot (running) and adapters with requests waiting "
            "that are not running (waiting), by the names clients send; the value is the time "
            "of this scrape.",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        info.add_metric(
            [str(self._max_loras), ",".join(sorted(running)), ",".join(sorted(waiting))],
            time.time(),
        )
        yield info
        yield from self._residency(residents, pinned, decoding)

    def _residency(
        self,
        residents: list[tuple[ServableAdapter, bool]],
        pinned: set[str],
        decoding: set[str],
    ) -> Iterator[Metric]:
        loaded = GaugeMetricFamily(
            "vllm:lora_adapter_loaded",
            "1 for each adapter in the engine: level gpu while pinned in a GPU slot or decoding, "
            "cpu while only in the engine's CPU cache.",
            labels=["adapter_name", "level", "pinned", "rank"],
        )
        # Versions of one name (a rollout's old and new) are one adapter to a client: one
        # series per name, at the highest level any of its versions holds.
        ranks: dict[str, int] = {}
        for adapter, _ in residents:
            ranks.setdefault(adapter.name, adapter.rank)
        on_gpu = 0
        for name, rank in sorted(ranks.items()):
            level = "gpu" if name in pinned or name in decoding else "cpu"
            on_gpu += level == "gpu"
            loaded.add_metric([name, level, str(name in pinned).lower(), str(rank)], 1)
        yield loaded
        yield GaugeMetricFamily(
            "vllm:num_gpu_loaded_lora_adapters",
            "Adapters in a GPU slot (pinned or decoding).",
            value=on_gpu,
        )
        yield GaugeMetricFamily(
            "vllm:num_cpu_loaded_lora_adapters",
            "Adapters only in the engine's CPU cache.",
            value=len(ranks) - on_gpu,
        )
        yield GaugeMetricFamily(
            "vllm:max_gpu_lora_adapters",
            "GPU slots for adapters (engine.max_loras).",
            value=self._max_loras,
        )


class EngineMetrics(Collector):
    """What /metrics serves of vLLM's registry: its families, without its LoRA info gauge (the
    module docstring says why), and with the gateway's waiting sequences in its waiting count."""

    def __init__(
        self, registry: Collector, activity: LoraActivity, *, gateway_gauge: bool = True
    ) -> None:
        self._registry = registry
        self._activity = activity
        self._gateway_gauge = gateway_gauge

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if family.name == LORA_INFO:
                continue
            if family.name == REQUESTS_WAITING:
                gateway = self._activity.sequences(Phase.GATEWAY)
                yield _plus(family, gateway)
                if self._gateway_gauge:  # the part of that count that waits here, not in vLLM
                    yield GaugeMetricFamily(
                        GATEWAY_WAITING,
                        f"Sequences waiting in the gateway, included in {REQUESTS_WAITING}.",
                        value=gateway,
                    )
            else:
                yield family


def picker_exposition(
    engine_registry: CollectorRegistry, picker: PickerMetrics, activity: LoraActivity
) -> bytes:
    """/metrics/picker: the families an endpoint picker reads and nothing else, the whole of
    vLLM's registry left unrendered (bench/metrics_render.py: what that saves each scrape)."""
    engine = EngineMetrics(
        engine_registry.restricted_registry(PICKER_ENGINE_FAMILIES), activity, gateway_gauge=False
    )
    return exposition(engine, picker)


def _plus(family: Metric, extra: int) -> Metric:
    """`family` with `extra` added to its first sample: loraplex runs one engine, whose series
    (engine="0") comes first."""
    total = Metric(family.name, family.documentation, family.type)
    for i, sample in enumerate(family.samples):
        value = sample.value + extra if i == 0 else sample.value
        total.add_sample(sample.name, sample.labels, value)
    return total
