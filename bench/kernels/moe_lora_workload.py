"""MoE-LoRA calls as vLLM 0.26 makes them, for the tuner and the benchmarks (torch only).

A model shape gives two calls per layer (vLLM's `add_lora_w13` and `add_lora_w2`):

    w13: x (T, hidden) -> output (T, k, 2 * inter)
         2D layout: slices gate and up, K = hidden, N = inter
         3D layout: one slice, K = hidden, N = 2 * inter, gate and up rows interleaved
    w2:  x (T * k, inter) -> output (T, k, hidden), one slice, K = inter, N = hidden, the delta
         scaled by the routing weight

The layout is the one vLLM 0.26 builds for the model (`MoeShape.lora_3d`): `FusedMoEWithLoRA`
(2D) holds a gate and an up A and B per expert; `FusedMoE3DWithLoRA`, which serves a model whose
experts are one packed module (GPT-OSS), holds one A (L, E, R, hidden) and one B
(L, E, 2 * inter, R) for gate/up (vllm/lora/layers/fused_moe.py). The two layouts' gate/up calls
have different keys in the tuned configs (`ShapeKey`: N and the slice count).

vLLM routes a batch in the naive form when T * k * 8 <= experts * max_loras, else in the sorted
form aligned to blocks of its MoE config's BLOCK_SIZE_M (`default_block_m` is its default rule).
With the plugin in, our op also gets the naive form while T * k <= experts * max_loras, up to
1,024 pairs (`served_naive`, `REGIMES.naive`), and the sorted form in blocks of 16 to 64 where
the pairs are sparse (`served_block_m`, `REGIMES.block_m`; kernels/dispatch.py).

Timing: each call gets its own routing, adapter rotation, x and output (a "set"), and as many sets
as it takes for the adapter bytes they touch to exceed four L2s, so repeated replays measure HBM,
not the cache, the way 48 distinct layers would. The calls are captured in one CUDA graph, as
vLLM runs decode, and replayed; the figure is the median per call.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from loraplex.kernels.dispatch import REGIMES
from loraplex.kernels.ops.moe_lora_align.reference import moe_lora_align_reference

AlignFn = Callable[[torch.Tensor, torch.Tensor, int, int, int, torch.Tensor], tuple]
# How a call's tokens spread over the adapters: round robin (every adapter alike, the issue's
# benchmark), zipf (adapter i with probability proportional to 1 / (i + 1)) or one adapter on
# every token. Each set rotates the adapters, so the sets of a timing touch different slots.
Popularity = Literal["round_robin", "zipf", "one"]
POPULARITIES: tuple[Popularity, ...] = get_args(Popularity)
L2_BYTES = 50 * 2**20


@dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int
    inter: int
    experts: int
    top_k: int
    # After gate/up: "silu" is SiLU-and-mul, "swigluoai" GPT-OSS's clamped SwiGLU on gate and
    # up interleaved; the plugin fuses the LoRA's expand into either (`fuses_activation`).
    activation: str
    # Whether vLLM 0.26 serves the experts' LoRA with FusedMoE3DWithLoRA (the experts are one
    # packed module): gate/up is then one slice of 2 x inter columns, not two of inter.
    lora_3d: bool

    @property
    def layout(self) -> Literal["2d", "3d"]:
        """The MoE-LoRA layout vLLM serves this model with, as the benchmarks' rows name it."""
        return "3d" if self.lora_3d else "2d"


SHAPES = {
    "qwen3-30b-a3b": MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8, activation="silu", lora_3d=False),
    "gpt-oss-20b": MoeShape("gpt-oss-20b", 2880, 2880, 32, 4, activation="swigluoai", lora_3d=True),
}
BATCHES = (1, 4, 16, 64, 256, 16 * 1600)


@dataclass(frozen=True)
class CallSpec:
    """One of the two calls of a layer, in the shape's layout: its K, N, slices and whether x
    is per pair."""

    op: str
    k: int
    n: int
    slices: int
    per_pair: bool  # w2: x has a row per (token, expert) pair and the weight scales the delta

    @staticmethod
    def of(shape: MoeShape, op: str) -> CallSpec:
        if op == "w13" and shape.lora_3d:
            return CallSpec("w13", shape.hidden, 2 * shape.inter, 1, False)
        if op == "w13":
            return CallSpec("w13", shape.hidden, shape.inter, 2, False)
        return CallSpec("w2", shape.inter, shape.hidden, 1, True)


def default_block_m(tokens: int) -> int:
    """vLLM 0.26's default BLOCK_SIZE_M for bf16 MoE (`fused_moe.get_default_config`)."""
    if tokens <= 32:
        return 16
    if tokens <= 96:
        return 32
    return 64 if tokens <= 512 else 128


def naive_form(shape: MoeShape, tokens: int, max_loras: int) -> bool:
    """vLLM's rule (`punica_gpu.add_lora_w13`, SPARSITY_FACTOR 8)."""
    return tokens * shape.top_k * 8 <= shape.experts * max_loras


def served_naive(shape: MoeShape, tokens: int, max_loras: int) -> bool:
    """The form our op gets once the plugin is in (`REGIMES.naive`)."""
    pairs = tokens * shape.top_k
    return REGIMES.naive(pairs, shape.experts, max_loras, naive_form(shape, tokens, max_loras))


def served_block_m(shape: MoeShape, tokens: int, max_loras: int) -> int:
    """The sorted form's block size our op gets once the plugin is in, over vLLM's default
    (`REGIMES.block_m`)."""
    pairs = tokens * shape.top_k
    return REGIMES.block_m(pairs, shape.experts, max_loras, default_block_m(tokens))


def make_weights(
    shape: MoeShape, spec: CallSpec, adapters: int, rank: int, dtype: torch.dtype, device: str
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Stacked A (L, E, R, K) and B (L, E, N, R) per slice, scaled like a trained adapter."""
    e = shape.experts
    a = [
        torch.randn(adapters, e, rank, spec.k, device=device, dtype=dtype) / spec.k**0.5
        for _ in range(spec.slices)
    ]
    b = [
        torch.randn(adapters, e, spec.n, rank, device=device, dtype=dtype) / (8 * rank**0.5)
        for _ in range(spec.slices)
    ]
    return a, b


def make_set(
    shape: MoeShape,
    spec: CallSpec,
    tokens: int,
    adapters: int,
    set_index: int,
    weights: tuple[list[torch.Tensor], list[torch.Tensor]],
    block_m: int,
    dtype: torch.dtype,
    device: str,
    align: AlignFn = moe_lora_align_reference,
    naive: bool | None = None,
    popularity: Popularity = "round_robin",
) -> tuple[dict, int]:
    """Arguments of one call (adapters spread over tokens by `popularity`, rotated by set;
    random top-k) and the adapter bytes it must read (`floor_bytes`). The routing form is
    `naive`'s, or where it is None vLLM's rule's (`naive_form`); a set's tokens and routing do
    not depend on it."""
    gen = torch.Generator().manual_seed(1000 + set_index)
    k = shape.top_k
    # The slots draw from their own generator, so every popularity gets the same routing.
    slot_gen = torch.Generator().manual_seed(2000 + set_index)
    tlm = (token_slots(popularity, tokens, adapters, slot_gen) + set_index) % adapters
    tlm = tlm.to(torch.int32)
    scores = torch.rand(tokens, shape.experts, generator=gen)
    topk_ids = scores.topk(k, dim=1).indices.to(torch.int32)
    enabled = torch.ones(adapters + 1, dtype=torch.int32)
    lora_ids = torch.full((adapters + 1,), -1, dtype=torch.int32)
    active = torch.unique(tlm).to(torch.int32)
    lora_ids[: active.numel()] = active
    dev = torch.device(device)
    if naive_form(shape, tokens, adapters) if naive is None else naive:
        st, ntpp, eids = None, None, topk_ids.reshape(-1).to(dev)
    else:
        st, eids, ntpp = align(topk_ids.to(dev), tlm.to(dev), shape.experts, block_m, adapters,
                               enabled.to(dev))  # fmt: skip
    rows = tokens * k if spec.per_pair else tokens
    cols = spec.slices * spec.n
    args = {
        "output": torch.randn(tokens, k, cols, generator=gen).to(dev, dtype),
        "qcurr_hidden_states": torch.randn(rows, spec.k, generator=gen).to(dev, dtype),
        "lora_a_stacked": weights[0],
        "lora_b_stacked": weights[1],
        "topk_weights": torch.rand(tokens, k, generator=gen).to(dev),
        "sorted_token_ids": st,
        "expert_ids": eids,
        "num_tokens_post_padded": ntpp,
        "token_lora_mapping": tlm.to(dev),
        "max_lora_rank": weights[0][0].shape[2],
        "top_k_num": k,
        "lora_ids": lora_ids.to(dev),
        # vLLM's default (specialize_active_lora off) launches over max_loras + 1 slots.
        "num_active_loras": torch.tensor([adapters + 1], dtype=torch.int32),
        "adapter_enabled": enabled.to(dev),
        "mul_routed_weight": spec.per_pair,
    }
    return args, floor_bytes(topk_ids, tlm, weights)


def make_sets(
    shape: MoeShape,
    spec: CallSpec,
    tokens: int,
    adapters: int,
    weights: tuple[list[torch.Tensor], list[torch.Tensor]],
    block_m: int,
    dtype: torch.dtype,
    device: str,
    align: AlignFn = moe_lora_align_reference,
    naive: bool | None = None,
    popularity: Popularity = "round_robin",
) -> list[tuple[dict, int]]:
    """`make_set` for set 0, 1, ... until the sets' adapter bytes exceed the L2s
    (`sets_needed`): the cold sets a timing rotates over, each with its `floor_bytes`."""
    make = functools.partial(make_set, shape, spec, tokens, adapters, weights=weights,
                             block_m=block_m, dtype=dtype, device=device, align=align,
                             naive=naive, popularity=popularity)  # fmt: skip
    first = make(set_index=0)
    return [first] + [make(set_index=i) for i in range(1, sets_needed(first[1]))]


def token_slots(
    popularity: Popularity, tokens: int, adapters: int, gen: torch.Generator
) -> torch.Tensor:
    """Each token's adapter slot (int64, before the set's rotation) under `popularity`."""
    if popularity == "round_robin":
        return torch.arange(tokens)
    if popularity == "one":
        return torch.zeros(tokens, dtype=torch.long)
    if popularity == "zipf":
        weights = 1.0 / torch.arange(1, adapters + 1, dtype=torch.float)
        return torch.multinomial(weights, tokens, replacement=True, generator=gen)
    raise ValueError(f"popularity must be one of {POPULARITIES}, got {popularity!r}")


def distinct_slot_experts(
    tlm: torch.Tensor, expert_ids: torch.Tensor, top_k: int, experts: int
) -> torch.Tensor:
    """slot * experts + expert of every distinct (slot, expert) routed, sorted: pair p is token
    p // top_k's slot (`tlm`) with expert_ids' p-th expert (naive-form order)."""
    slots = tlm.long().repeat_interleave(top_k)
    return torch.unique(slots * experts + expert_ids.reshape(-1).long())


def floor_bytes(topk_ids: torch.Tensor, tlm: torch.Tensor, weights: tuple) -> int:
    """Adapter bytes a call must read once: A and B of every distinct (slot, expert) routed."""
    a, b = weights
    distinct = distinct_slot_experts(tlm, topk_ids, topk_ids.shape[1], a[0].shape[1]).numel()
    per_pair = sum(t[0, 0].numel() * t.element_size() for t in (*a, *b))
    return distinct * per_pair


def sets_needed(bytes_per_call: int) -> int:
    return max(2, min(64, -(-4 * L2_BYTES // max(bytes_per_call, 1))))


def time_per_call(calls: Sequence[Callable[[], None]], reps: int = 10, trials: int = 7) -> float:
    """Median microseconds per call, the calls captured in one CUDA graph and replayed."""
    return time_interleaved([calls], reps, trials)[0]


def time_interleaved(
    call_lists: Sequence[Sequence[Callable[[], None]]], reps: int = 10, trials: int = 7
) -> list[float]:
    """Median microseconds per call of each list, each captured in its own CUDA graph. Every
    trial replays the graphs in turn, so drift in clocks or in a neighbour's load lands on all
    of them alike: a ratio of two medians taken this way is what the benchmarks report."""
    graphs = [_capture(calls) for calls in call_lists]
    torch.cuda.synchronize()
    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(trials):
        for graph, calls, out in zip(graphs, call_lists, times, strict=True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                graph.replay()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1000 / (reps * len(calls)))
    return [statistics.median(t) for t in times]


def _capture(calls: Sequence[Callable[[], None]]) -> torch.cuda.CUDAGraph:
    """The calls in one CUDA graph, warmed up (compiles, cached pointer tables) outside it and
    replayed once."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return graph


def copy_bandwidth(device: str = "cuda", nbytes: int = 2 * 2**30) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * nbytes / statistics.median(times)
