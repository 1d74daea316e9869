"""bench/e2e/traces.py on small hand-written traces: the kernels' union, and the GPU's idle
charged to the host op that launched late or to "queued in time"."""

from __future__ import annotations

import json
from pathlib import Path

from bench.e2e.traces import QUEUED_IN_TIME, kernel_group, summarize_traces


def kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def launch(ts: float, corr: int, tid: int = 1) -> dict:
    return {"cat": "cuda_runtime", "name": "cuLaunchKernelEx", "ts": ts, "dur": 5.0,
            "tid": tid, "args": {"correlation": corr}}  # fmt: skip


def op(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def write(tmp_path: Path, events: list[dict]) -> Path:
    (tmp_path / "worker.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    return tmp_path


def test_a_late_launch_is_charged_to_the_host_ops_around_it(tmp_path: Path) -> None:
    # GEMM 0-100 µs; the host sits in moe_forward > a slow malloc until it launches the
    # LoRA kernel at 400 µs, which runs 400-450: a 300 µs gap caused by the host.
    events = [
        kernel("nvjet_gemm", 0, 100, 1), launch(-10, 1),
        op("vllm::moe_forward", 50, 500), op("loraplex::fused_moe_lora", 120, 300),
        {"cat": "cuda_runtime", "name": "cudaMalloc", "ts": 150, "dur": 200, "tid": 1},
        kernel("moe_lora_shrink_kernel", 400, 50, 2), launch(400, 2),
    ]  # fmt: skip
    summary = summarize_traces(write(tmp_path, events), steps=1)
    assert summary["gpu_idle_in_span"] == 300.0
    gaps = summary["gpu_gaps"]
    assert gaps["count"] == 1 and gaps["total_us"] == 300.0
    cause = "vllm::moe_forward > loraplex::fused_moe_lora"
    assert gaps["idle_by_cause"] == {cause: [1, 300.0]}
    assert gaps["runtime_in_late_gaps"] == {"cudaMalloc": [1, 200.0]}
    assert gaps["largest"] == [[300.0, "nvjet_gemm", "moe_lora_shrink_kernel", cause]]


def test_a_kernel_queued_before_the_gap_waited_on_something_else(tmp_path: Path) -> None:
    # Both launched up front; the second starts 80 µs after the first ends (an event wait).
    events = [
        kernel("a", 0, 100, 1), launch(-20, 1),
        kernel("b", 180, 20, 2), launch(-10, 2),
    ]  # fmt: skip
    gaps = summarize_traces(write(tmp_path, events), steps=1)["gpu_gaps"]
    assert gaps["idle_by_cause"] == {QUEUED_IN_TIME: [1, 80.0]}
    assert gaps["runtime_in_late_gaps"] == {}


def test_overlapping_kernels_count_once_and_per_step(tmp_path: Path) -> None:
    # Two steps' worth: a GEMM with a side-stream kernel inside it, then a 10 µs late gap.
    events = [
        kernel("fused_moe_kernel", 0, 100, 1), launch(-5, 1),
        kernel("moe_lora_expand_kernel", 20, 50, 2), launch(-4, 2),
        kernel("moe_sum_with_delta_kernel", 110, 30, 3), launch(105, 3),
    ]  # fmt: skip
    summary = summarize_traces(write(tmp_path, events), steps=2)
    assert summary["all_kernels"] == 90.0  # (100 + 50 + 30) / 2
    assert summary["kernels_overlapped"] == 25.0  # the side kernel's 50 µs, per step
    assert summary["gpu_idle_in_span"] == 5.0
    assert summary["moe_sum_ours"] == 15.0 and summary["moe_lora_ours"] == 25.0
    assert summary["gpu_gaps"]["count"] == 0  # 10 µs is under GAP_US
    assert summary["gpu_gaps"]["idle_by_cause"] == {"(no host op)": [0.5, 5.0]}


def test_the_main_stream_is_split_from_the_side_stream_and_its_wait_on_it(tmp_path: Path) -> None:
    # Main stream 7: GEMM 0-100, then the fused activation 130-140 after an event join on the
    # side stream 9, whose shrink ran 20-60 and whose expand ran 90-125: main idled 100-130,
    # 25 µs of it while the side stream's expand ran.
    def on(stream: int, name: str, ts: float, dur: float, corr: int) -> dict:
        ev = kernel(name, ts, dur, corr)
        ev["args"]["stream"] = stream
        return ev

    events = [
        on(7, "fused_moe_kernel", 0, 100, 1), launch(-5, 1),
        on(9, "moe_lora_shrink_kernel", 20, 40, 2), launch(-4, 2),
        on(9, "moe_lora_expand_kernel", 90, 35, 3), launch(-3, 3),
        on(7, "moe_lora_expand_silu_and_mul_kernel", 130, 10, 4), launch(-2, 4),
    ]  # fmt: skip
    streams = summarize_traces(write(tmp_path, events), steps=1)["streams"]
    assert streams == {
        "main_busy": 110.0, "main_idle": 30.0, "main_idle_while_others_run": 25.0,
        "main_groups": {"moe_base": 100.0, "moe_lora_ours": 10.0},
        "other_streams": 1, "other_groups": {"moe_lora_ours": 75.0},
    }  # fmt: skip


def test_our_gemv_and_dense_kernels_count_as_ours() -> None:
    """Our kernels count as ours: the MoE-LoRA GEMVs (their names hold _lora_, as vLLM's dense
    LoRA kernels' do) and the dense LoRA's decode and prefill kernels."""
    assert kernel_group("moe_lora_gemv_shrink_kernel") == "moe_lora_ours"
    assert kernel_group("moe_lora_gemv_expand_kernel") == "moe_lora_ours"
    assert kernel_group("lora_dense_kernel") == "dense_lora_ours"
    assert kernel_group("lora_dense_tiled_shrink_kernel") == "dense_lora_ours"
    assert kernel_group("_lora_shrink_kernel") == "dense_lora"
