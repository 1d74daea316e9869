"""The endpoint picker's gauges (server/picker_metrics.py) over request phases
(server/lora_activity.py), read with the picker's own rules (tests/support/picker_rules.py).
The same contract against a real server: test_picker_metrics.py."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge

from loraplex.adapters_registry.base import ServableAdapter
from loraplex.server.lora_activity import LoraActivity, Phase
from loraplex.server.metrics import exposition
from loraplex.server.picker_metrics import (
    LORA_INFO,
    EngineMetrics,
    PickerMetrics,
    picker_exposition,
)
from tests.support.picker_rules import picker_view

SHA = "ab" * 32


def adapter(name: str, rank: int = 8, engine_id: int = 1) -> ServableAdapter:
    return ServableAdapter(name, SHA, engine_id, Path("/nonexistent"), rank)


def render(
    activity: LoraActivity,
    residents: list[tuple[ServableAdapter, bool]] | None = None,
    engine_registry: CollectorRegistry | None = None,
) -> str:
    ours = CollectorRegistry()
    ours.register(PickerMetrics(4, activity, lambda: residents or []))
    engine = EngineMetrics(engine_registry or CollectorRegistry(), activity)
    return exposition(engine, ours).decode()


def test_a_request_moves_through_the_phases_and_is_counted_once() -> None:
    activity = LoraActivity()
    with activity.track(f"acme/bot@{SHA[:8]}", sequences=3) as request:
        assert activity.adapters(Phase.GATEWAY) == {"acme/bot"}
        assert activity.sequences(Phase.GATEWAY) == 3
        request.enter(Phase.ENGINE)
        request.enter(Phase.RUNNING)
        request.enter(Phase.ENGINE)  # never backwards
        assert activity.adapters(Phase.RUNNING) == {"acme/bot"}
        assert activity.sequences(Phase.RUNNING) == 3
        assert not activity.adapters(Phase.GATEWAY) and not activity.adapters(Phase.ENGINE)
        assert activity.sequences(Phase.GATEWAY) == activity.sequences(Phase.ENGINE) == 0
    assert all(not activity.adapters(p) and activity.sequences(p) == 0 for p in Phase)


def test_running_and_waiting_lists_never_share_an_adapter() -> None:
    """An adapter decoding for one request and queued for another is running only; one whose
    requests all wait (gateway or engine) is waiting; the base model is in neither."""
    activity = LoraActivity()
    with (
        activity.track("hot", 1) as hot_running,
        activity.track("hot", 1),
        activity.track("cold", 1),
        activity.track("queued-in-engine", 1) as in_engine,
        activity.track(None, 2),
    ):
        hot_running.enter(Phase.RUNNING)
        in_engine.enter(Phase.ENGINE)
        view = picker_view(render(activity))
        assert view.running == {"hot"}
        assert view.waiting == {"cold", "queued-in-engine"}
        assert view.max_lora == 4
        # Ranked as the picker ranks: the running one first; the others still fit (1 + 2 < 4).
        assert view.affinity("hot") == 1.0 and view.affinity("cold") == 0.8
    assert picker_view(render(activity)).running == frozenset()


def test_pinned_adapters_run_and_residency_names_each_adapter_once() -> None:
    """Pinned adapters hold a GPU slot: running, level gpu. A rollout's two versions of one name
    are one series; an adapter only in the CPU cache is level cpu. No version anywhere."""
    activity = LoraActivity()
    with activity.track("pinned", 1):  # queued, but its adapter is on the GPU already
        residents = [
            (adapter("pinned", rank=16, engine_id=1), True),
            (adapter("idle", engine_id=2), False),
            (adapter("idle", engine_id=3), False),
        ]
        text = render(activity, residents)
    view = picker_view(text)
    assert view.running == {"pinned"} and view.waiting == frozenset()
    assert SHA[:8] not in text and "@" not in text
    loaded = sorted(line for line in text.splitlines() if line.startswith("vllm:lora_adapter_"))
    assert loaded == [
        'vllm:lora_adapter_loaded{adapter_name="idle",level="cpu",pinned="false",rank="8"} 1.0',
        'vllm:lora_adapter_loaded{adapter_name="pinned",level="gpu",pinned="true",rank="16"} 1.0',
    ]
    assert "vllm:num_gpu_loaded_lora_adapters 1.0" in text
    assert "vllm:num_cpu_loaded_lora_adapters 1.0" in text
    assert "vllm:max_gpu_lora_adapters 4.0" in text


def test_the_waiting_count_adds_the_gateway_queue_to_the_engine_s() -> None:
    """vLLM's waiting gauge plus the sequences the gateway holds before the engine (n=2 is two,
    as vLLM counts choices); vLLM's own LoRA gauge, with its versioned names, is not served."""
    engine_registry = CollectorRegistry()
    waiting = Gauge(
        "vllm:num_requests_waiting", "W.", ["model_name", "engine"], registry=engine_registry
    )
    waiting.labels("m", "0").set(3)
    Gauge(
        "vllm:num_requests_running", "R.", ["model_name", "engine"], registry=engine_registry
    ).labels("m", "0").set(5)
    old = Gauge(
        LORA_INFO,
        "vLLM's.",
        ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        registry=engine_registry,
    )
    old.labels("4", f"a@{SHA}", f"a@{SHA}").set(1e12)  # a later value than ours: would win
    activity = LoraActivity()
    with activity.track("a", 2), activity.track(None, 1), activity.track("b", 1) as b:
        b.enter(Phase.ENGINE)  # in vLLM's own count now
        text = render(activity, engine_registry=engine_registry)
    view = picker_view(text)
    assert view.queued == 3 + 3 and view.running_requests == 5
    assert SHA not in text
    assert sum(line.startswith(LORA_INFO + "{") for line in text.splitlines()) == 1
    assert view.waiting == {"a", "b"}


def test_the_picker_path_serves_only_what_the_picker_reads() -> None:
    engine_registry = CollectorRegistry()
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:other_stat"):
        Gauge(name, "x.", registry=engine_registry).set(1)
    activity = LoraActivity()
    picker = PickerMetrics(4, activity, lambda: [])
    with activity.track(None, 2):
        view = picker_view(picker_exposition(engine_registry, picker, activity).decode())
    assert view.queued == 1 + 2
    assert view.families == {
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        LORA_INFO,
        "vllm:lora_adapter_loaded",
        "vllm:num_gpu_loaded_lora_adapters",
        "vllm:num_cpu_loaded_lora_adapters",
        "vllm:max_gpu_lora_adapters",
    }
