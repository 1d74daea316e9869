"""A replica's /metrics read as llm-d-router's endpoint picker reads it (v0.10.0, core metrics
extractor `pkg/epp/framework/plugins/datalayer/extractor/metrics/`, and `lora-affinity-scorer`):

- the LoRA gauge: of the series of `vllm:lora_requests_info`, the one of highest value
  (`LoRASpec.getLatestMetric`); its `running_lora_adapters` and `waiting_lora_adapters` split on
  commas, each name whitespace-trimmed, empty names dropped (`addAdapters`); `max_lora` an int;
- the queue gauges: the value of `vllm:num_requests_waiting` / `vllm:num_requests_running`;
- the affinity score of an adapter: 1.0 running; else 0.8 if running + waiting < max_lora; else
  0.6 if waiting; else 0 (`LoraAffinityScorer.Score`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class PickerView:
    max_lora: int | None
    running: frozenset[str]
    waiting: frozenset[str]
    queued: float
    running_requests: float
    families: frozenset[str]

    def affinity(self, adapter: str) -> float:
        if adapter in self.running:
            return 1.0
        if self.max_lora is not None and len(self.running) + len(self.waiting) < self.max_lora:
            return 0.8
        return 0.6 if adapter in self.waiting else 0.0


def _adapters(csv: str) -> frozenset[str]:
    return frozenset(name.strip() for name in csv.split(",") if name.strip())


def picker_view(text: str) -> PickerView:
    families = {family.name: family for family in text_string_to_metric_families(text)}
    latest = None
    lora = families.get("vllm:lora_requests_info")
    for sample in lora.samples if lora else ():
        if latest is None or sample.value > latest.value:
            latest = sample
    labels = latest.labels if latest is not None else {}

    def value(name: str) -> float:
        return families[name].samples[0].value if name in families else 0.0

    return PickerView(
        max_lora=int(labels["max_lora"]) if labels.get("max_lora") else None,
        running=_adapters(labels.get("running_lora_adapters", "")),
        waiting=_adapters(labels.get("waiting_lora_adapters", "")),
        queued=value("vllm:num_requests_waiting"),
        running_requests=value("vllm:num_requests_running"),
        families=frozenset(families),
    )
