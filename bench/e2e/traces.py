"""Summaries of the torch profiler's traces of vLLM's worker (bench_e2e.py's profile modes).

Per step: GPU kernel time by group and the kernels that take most of it; the GPU's idle time
inside the kernels' span and its causes; the host calls that wait on the GPU.

The idle's cause, per gap between the union of kernel intervals: if the kernel after the gap
was launched after the GPU went idle, the host was late, and the gap is charged to the ops the
host was inside when it launched that kernel (the innermost three enclosing CPU ops; custom ops
such as vllm::moe_forward and loraplex's show there). Otherwise the kernel was queued in time
and waited for something else (another stream's event, a copy), and the gap is charged to
"queued in time". Host runtime calls longer than GAP_US inside late gaps (cudaMalloc,
cudaStreamSynchronize and the like) are summed by name.

Per stream: the main stream (the one with the most kernel time) is the step's critical path,
so its kernel time by group plus its idle is the step; the idle it spends while only other
streams' kernels run is its wait on them (loraplex's side stream, joined by an event).
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KERNEL_GROUPS = (  # first match wins; names as vLLM 0.26 and loraplex launch them
    ("moe_lora_ours", r"^moe_lora_(gemv_)?(shrink|expand|fused|expand_silu_and_mul)_kernel$"),
    ("moe_sum_ours", r"^moe_sum_with_delta_kernel$"),
    ("dense_lora_ours", r"^lora_dense_(tiled_(shrink|expand)_)?kernel$"),
    ("moe_lora_align_ours", r"^_(count|layout|place)_kernel$"),
    ("moe_lora_vllm", r"fused_moe_lora"),
    ("moe_lora_align", r"moe_lora_align|lora_align"),
    ("dense_lora", r"lora_shrink|lora_expand|_lora_"),
    ("moe_base", r"fused_moe_kernel|moe_align|moe_sum|topk|count_and_sort"),
    ("attention", r"flash|attn|attention|fmha"),
    ("gemm", r"gemm|nvjet|cutlass|cublas|sm90_xmma|matmul"),
)
GAP_US = 50.0  # GPU idle between kernels counted as a gap (launch-to-launch jitter is less)
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
QUEUED_IN_TIME = "queued in time (waited on another stream or a copy)"
HOST_OP_CATS = ("cpu_op", "user_annotation")


@dataclass(frozen=True)
class Kernel:
    start: float
    end: float
    name: str
    correlation: Any
    stream: Any = None


@dataclass(frozen=True)
class Gap:
    start: float  # the GPU's last kernel before the gap ended here
    end: float
    before: str
    after: Kernel

    @property
    def us(self) -> float:
        return self.end - self.start


@dataclass
class Trace:
    """The events of one or more trace files that the summaries read."""

    kernels: list[Kernel]
    ops: dict[Any, list[tuple[float, float, str]]]  # host thread: (start, end, name), sorted
    launches: dict[Any, tuple[Any, float]]  # correlation: (host thread, launch time)
    runtime: dict[Any, list[tuple[float, float, str]]]  # host thread: CUDA runtime calls


def read_trace(folder: Path) -> Trace:
    trace = Trace([], {}, {}, {})
    for path in sorted(folder.rglob("*.json*")):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            events = json.load(f).get("traceEvents", [])
        for ev in events:
            cat, name = ev.get("cat"), ev.get("name", "")
            ts, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
            args = ev.get("args") or {}
            correlation = args.get("correlation")
            if cat == "kernel":
                trace.kernels.append(Kernel(ts, ts + dur, name, correlation, args.get("stream")))
            elif cat in HOST_OP_CATS:
                trace.ops.setdefault(ev.get("tid"), []).append((ts, ts + dur, name))
            elif cat == "cuda_runtime":
                trace.runtime.setdefault(ev.get("tid"), []).append((ts, ts + dur, name))
                if correlation is not None:
                    trace.launches[correlation] = (ev.get("tid"), ts)
    for spans in (*trace.ops.values(), *trace.runtime.values()):
        spans.sort(key=lambda op: (op[0], -op[1]))  # enclosing ops first
    trace.kernels.sort(key=lambda k: (k.start, k.end))
    return trace


def kernel_union(kernels: list[Kernel]) -> tuple[float, float, list[Gap]]:
    """(busy µs, span µs, every gap) of the union of the kernels' intervals (sorted by start)."""
    busy, end, last = 0.0, float("-inf"), ""
    gaps: list[Gap] = []
    for k in kernels:
        if end > float("-inf") and k.start > end:
            gaps.append(Gap(end, k.start, last, k))
        busy += max(0.0, k.end - max(k.start, end))
        if k.end >= end:
            end, last = k.end, k.name
    span = end - kernels[0].start if kernels else 0.0
    return busy, span, gaps


def enclosing(spans: list[tuple[float, float, str]], at: float) -> list[str]:
    """Names of the spans that contain `at`, outermost first."""
    return [name for lo, hi, name in spans if lo <= at <= hi]


def late_launch(trace: Trace, gap: Gap) -> tuple[Any, float] | None:
    """(host thread, launch time) of the kernel after the gap if it was launched after the GPU
    went idle, else None."""
    launch = trace.launches.get(gap.after.correlation)
    if launch is None or launch[1] <= gap.start:
        return None
    return launch


def idle_causes(trace: Trace, gaps: list[Gap], steps: int) -> dict[str, Any]:
    """The gaps' µs per step by cause (see the module docstring), the late gaps' long runtime
    calls, and the largest gaps over GAP_US with their neighbours and cause."""
    by_cause: dict[str, list[float]] = {}
    runtime_in_late: dict[str, list[float]] = {}
    largest: list[list[Any]] = []
    for gap in sorted(gaps, key=lambda g: -g.us):
        launch = late_launch(trace, gap)
        cause = QUEUED_IN_TIME
        if launch is not None:
            tid, at = launch
            cause = " > ".join(enclosing(trace.ops.get(tid, []), at)[-3:]) or "(no host op)"
            for lo, hi, name in trace.runtime.get(tid, []):
                if lo >= gap.start and hi <= at and hi - lo > GAP_US:
                    entry = runtime_in_late.setdefault(name, [0, 0.0])
                    entry[0] += 1
                    entry[1] += hi - lo
        entry = by_cause.setdefault(cause, [0, 0.0])
        entry[0] += 1
        entry[1] += gap.us
        if gap.us > GAP_US and len(largest) < 12:
            largest.append([round(gap.us, 1), gap.before[:60], gap.after.name[:60], cause[:120]])

    def per_step(table: dict[str, list[float]], n: int) -> dict[str, list[float]]:
        top = sorted(table.items(), key=lambda kv: -kv[1][1])[:n]
        return {k[:160]: [round(v[0] / steps, 1), round(v[1] / steps, 1)] for k, v in top}

    return {
        "over_us": GAP_US,
        "count": sum(1 for g in gaps if g.us > GAP_US),
        "total_us": round(sum(g.us for g in gaps if g.us > GAP_US) / steps, 1),
        "largest": largest,
        "idle_by_cause": per_step(by_cause, 12),  # every gap: [gaps per step, µs per step]
        "runtime_in_late_gaps": per_step(runtime_in_late, 8),
    }


def host_waits(trace: Trace, steps: int) -> dict[str, list[float]]:
    """Host calls that wait on the GPU (synchronizations, blocking copies), by the ops that
    made them: [calls per step, µs per step]."""
    by_caller: dict[str, list[float]] = {}
    for tid, calls in trace.runtime.items():
        for lo, hi, name in calls:
            if not name.startswith(SYNCS):
                continue
            chain = enclosing(trace.ops.get(tid, []), lo)[:3]
            entry = by_caller.setdefault(" > ".join([*chain, name]), [0, 0.0])
            entry[0] += 1
            entry[1] += hi - lo
    top = sorted(by_caller.items(), key=lambda kv: -kv[1][1])[:12]
    return {k: [int(v[0]), round(v[1] / steps, 1)] for k, v in top}


def kernel_group(name: str) -> str:
    return next((g for g, rx in KERNEL_GROUPS if re.search(rx, name)), "other")


def group_totals(kernels: list[Kernel]) -> dict[str, float]:
    """Kernel µs by KERNEL_GROUPS group (unknown names under "other")."""
    totals: dict[str, float] = {}
    for k in kernels:
        group = kernel_group(k.name)
        totals[group] = totals.get(group, 0.0) + k.end - k.start
    return totals


def _overlap(gaps: list[Gap], kernels: list[Kernel]) -> float:
    """µs of the gaps during which at least one of the kernels (sorted by start) ran."""
    _, _, own_gaps = kernel_union(kernels)
    spans = []  # the kernels' union as (start, end) intervals
    if kernels:
        start = kernels[0].start
        for g in own_gaps:
            spans.append((start, g.start))
            start = g.end
        spans.append((start, max(k.end for k in kernels)))
    return sum(max(0.0, min(g.end, hi) - max(g.start, lo)) for g in gaps for lo, hi in spans)


def stream_split(kernels: list[Kernel], steps: int) -> dict[str, Any]:
    """The main stream's kernel time by group and its idle (the part while other streams'
    kernels ran: its wait on them), and the other streams' kernel time by group, per step."""
    by_stream: dict[Any, list[Kernel]] = {}
    for k in kernels:
        by_stream.setdefault(k.stream, []).append(k)
    if not by_stream:
        return {}
    main = max(by_stream, key=lambda s: sum(k.end - k.start for k in by_stream[s]))
    others = sorted((k for s, ks in by_stream.items() if s != main for k in ks),
                    key=lambda k: (k.start, k.end))  # fmt: skip

    def groups(ks: list[Kernel]) -> dict[str, float]:
        return {g: round(us / steps, 1) for g, us in sorted(group_totals(ks).items())}

    busy, span, gaps = kernel_union(by_stream[main])
    return {
        "main_busy": round(busy / steps, 1),
        "main_idle": round((span - busy) / steps, 1),
        "main_idle_while_others_run": round(_overlap(gaps, others) / steps, 1),
        "main_groups": groups(by_stream[main]),
        "other_streams": len(by_stream) - 1,
        "other_groups": groups(others),
    }


def summarize_traces(folder: Path, steps: int) -> dict[str, Any]:
    """The summaries of the module docstring for the trace files under `folder`, per step."""
    trace = read_trace(folder)
    totals = group_totals(trace.kernels)
    by_name: dict[str, list[float]] = {}
    for k in trace.kernels:
        by_name.setdefault(k.name, []).append(k.end - k.start)
    per_step: dict[str, Any] = {g: round(us / steps, 1) for g, us in sorted(totals.items())}
    per_step["all_kernels"] = round(sum(totals.values()) / steps, 1)
    top_names = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:16]
    per_step["top_kernels"] = {  # name: [launches per step, µs per step, median µs per launch]
        name[:90]: [len(d) // steps, round(sum(d) / steps, 1), round(statistics.median(d), 2)]
        for name, d in top_names
    }
    busy, span, gaps = kernel_union(trace.kernels)
    per_step["gpu_idle_in_span"] = round((span - busy) / steps, 1)
    # Kernel time that ran beside other kernels (loraplex's side stream): all_kernels - busy.
    per_step["kernels_overlapped"] = round((sum(totals.values()) - busy) / steps, 1)
    per_step["gpu_gaps"] = idle_causes(trace, gaps, steps)
    per_step["host_waits"] = host_waits(trace, steps)
    per_step["streams"] = stream_split(trace.kernels, steps)
    return per_step
