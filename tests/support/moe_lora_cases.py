"""Inputs for MoE-LoRA kernel tests: routing, adapter popularity, weights; shared by CPU and GPU."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from bench.kernels.moe_lora_workload import Popularity as WorkloadPopularity
from bench.kernels.moe_lora_workload import token_slots
from loraplex.kernels.ops.moe_lora.act import (
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
    expand_silu_and_mul,
    expand_swigluoai_and_mul,
)
from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig
from loraplex.kernels.ops.moe_lora.op import SplitExpand, defer_gate_up_expand, fused_moe_lora
from loraplex.kernels.ops.moe_lora.reference import (
    expand_silu_and_mul_reference,
    expand_swigluoai_and_mul_reference,
    fused_moe_lora_reference,
    pairs_to_update,
)
from loraplex.kernels.ops.moe_lora_align.reference import moe_lora_align_reference

Popularity = Literal["distinct", "uniform", "zipf", "identical", "skewed"]


@dataclass(frozen=True)
class Case:
    tokens: int
    top_k: int
    experts: int
    rank: int
    adapters: int
    popularity: Popularity = "uniform"
    no_adapter: float = 0.0  # fraction of tokens with slot -1
    expert_skew: bool = False
    k: int = 64
    n: int = 48
    slices: int = 2
    block_m: int = 16
    sorted_form: bool = False
    mul_routed_weight: bool = False
    add_inputs: bool = True
    offset: int = 0
    disabled_slot: bool = False  # slot 0 loaded but its adapter disabled
    # The plugin's metadata under vLLM's specialize_active_lora (`batch_metadata.fill_kernel_meta`):
    # lora_ids lists the adapters, then -1, and num_active_loras counts the adapters only; else
    # vLLM's order (-1 first) and max_loras + 1.
    specialize_active: bool = False


# The popularities the benchmarks' workload builder also draws (`token_slots`), by its names.
_WORKLOAD_POPULARITY: dict[str, WorkloadPopularity] = {
    "distinct": "round_robin", "identical": "one", "zipf": "zipf",
}  # fmt: skip


def _slots(case: Case, gen: torch.Generator) -> torch.Tensor:
    t, a = case.tokens, case.adapters
    if case.popularity in _WORKLOAD_POPULARITY:
        slots = token_slots(_WORKLOAD_POPULARITY[case.popularity], t, a, gen) % a
    else:
        if case.popularity == "uniform":
            p = torch.ones(a)
        else:  # skewed: nine tenths on one adapter
            p = torch.full((a,), 0.1 / max(a - 1, 1))
            p[0] = 0.9 if a > 1 else 1.0
        slots = torch.multinomial(p, t, replacement=True, generator=gen)
    none = torch.rand(t, generator=gen) < case.no_adapter
    return torch.where(none, -1, slots).to(torch.int32)


def _topk_ids(case: Case, gen: torch.Generator) -> torch.Tensor:
    if case.expert_skew:
        p = 1.0 / torch.arange(1, case.experts + 1, dtype=torch.float) ** 2
    else:
        p = torch.ones(case.experts)
    p = p.expand(case.tokens, -1)
    return torch.multinomial(p, case.top_k, replacement=False, generator=gen).to(torch.int32)


def make_inputs(
    case: Case, dtype: torch.dtype, device: str, seed: int, remap: dict[int, int] | None = None
) -> dict[str, Any]:
    """Random inputs for one call, scaled so that the LoRA delta is O(1) like the output.
    `remap` moves the tokens of a slot to another (or to -1) after the draw: the same call with
    every value but the mapping and the routing built from it unchanged."""
    gen = torch.Generator().manual_seed(seed)
    rows = case.tokens * case.top_k if case.mul_routed_weight else case.tokens
    num_slots = case.adapters
    a = [torch.randn(num_slots, case.experts, case.rank, case.k, generator=gen) / case.k**0.5]
    b = [torch.randn(num_slots, case.experts, case.n, case.rank, generator=gen) / case.rank**0.5]
    for _ in range(case.slices - 1):
        a.append(torch.randn(a[0].shape, generator=gen) / case.k**0.5)
        b.append(torch.randn(b[0].shape, generator=gen) / case.rank**0.5)
    tlm = _slots(case, gen)
    topk_ids = _topk_ids(case, gen)
    for slot, to in (remap or {}).items():
        tlm = torch.where(tlm == slot, to, tlm).to(torch.int32)
    enabled = torch.ones(num_slots + 1, dtype=torch.int32)
    if case.disabled_slot:
        enabled[0] = 0
    active = torch.unique(tlm).to(torch.int32)
    if case.specialize_active:
        active = active[active >= 0]
    lora_ids = torch.full((num_slots + 1,), -1, dtype=torch.int32)
    lora_ids[: active.numel()] = active
    n_active = active.numel() if case.specialize_active else num_slots + 1
    if case.sorted_form:
        st, eids, ntpp = moe_lora_align_reference(
            topk_ids, tlm, case.experts, case.block_m, num_slots, enabled
        )
    else:
        st, eids, ntpp = None, topk_ids.reshape(-1).clone(), None
    cols = case.offset + case.slices * case.n + 5
    dev = torch.device(device)

    def put(t: torch.Tensor | None, dt: torch.dtype | None = None) -> torch.Tensor | None:
        return None if t is None else t.to(device=dev, dtype=dt or t.dtype)

    return {
        "output": put(torch.randn(case.tokens, case.top_k, cols, generator=gen), dtype),
        "qcurr_hidden_states": put(torch.randn(rows, case.k, generator=gen), dtype),
        "lora_a_stacked": [put(t, dtype) for t in a],
        "lora_b_stacked": [put(t, dtype) for t in b],
        "topk_weights": put(torch.rand(case.tokens, case.top_k, generator=gen), torch.float32),
        "sorted_token_ids": put(st),
        "expert_ids": put(eids),
        "num_tokens_post_padded": put(ntpp),
        "token_lora_mapping": put(tlm),
        "max_lora_rank": case.rank,
        "top_k_num": case.top_k,
        "lora_ids": put(lora_ids),
        "num_active_loras": torch.tensor([n_active], dtype=torch.int32),
        "adapter_enabled": put(enabled),
    }


def check_against_reference(
    case: Case, config: MoeLoraConfig | None, dtype: torch.dtype, device: str, seed: int
) -> float:
    """Run kernel and reference on fresh inputs; return the relative error of the delta.

    Pairs the spec leaves alone must be bit for bit unchanged; the error is
    ||out - ref|| / ||ref - before||, with the reference in float64.
    """
    args = make_inputs(case, dtype, device, seed)
    before = args["output"].clone()
    if not case.add_inputs:
        args["output"].fill_(777.0)  # poison: every updated cell must be overwritten
        before.fill_(777.0)
    ref = before.double().cpu()
    cpu_args = _cpu_args(args)
    common: dict[str, Any] = {"mul_routed_weight": case.mul_routed_weight, "offset": case.offset}
    fused_moe_lora_reference(
        ref, **cpu_args, block_size=case.block_m, add_inputs=case.add_inputs, **common
    )
    fused_moe_lora(
        **args, shrink_block_size_m=case.block_m, add_inputs=case.add_inputs, config=config,
        **common,
    )  # fmt: skip
    out = args["output"].double().cpu()
    work = pairs_to_update(
        case.tokens * case.top_k,
        case.top_k,
        cpu_args["sorted_token_ids"],
        cpu_args["expert_ids"],
        cpu_args["num_tokens_post_padded"],
        cpu_args["token_lora_mapping"],
        cpu_args["lora_ids"],
        int(cpu_args["num_active_loras"][0]),
        cpu_args["adapter_enabled"],
        case.adapters,
        case.block_m,
    )
    touched = torch.zeros(case.tokens * case.top_k, dtype=torch.bool)
    touched[[f for f, _, _ in work]] = True
    flat_out = out.view(touched.numel(), -1)
    flat_before = before.double().cpu().view(touched.numel(), -1)
    assert torch.equal(flat_out[~touched], flat_before[~touched]), "a pair not routed changed"
    assert not torch.isnan(out).any()
    delta = (ref - before.double().cpu()).norm()
    if not work:
        return 0.0
    return float((out - ref).norm() / delta.clamp_min(1e-12))


def _cpu_args(args: dict[str, Any]) -> dict[str, Any]:
    """The op's arguments but `output`, on the CPU (for the float64 reference)."""
    cpu_args = {
        k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items() if k != "output"
    }
    cpu_args["lora_a_stacked"] = [t.cpu() for t in args["lora_a_stacked"]]
    cpu_args["lora_b_stacked"] = [t.cpu() for t in args["lora_b_stacked"]]
    return cpu_args


def fused_activation(expand: SplitExpand, out: torch.Tensor) -> None:
    """The plugin's fused activation for the call's layout: SiLU-and-mul for two slices side by
    side (Qwen3), swigluoai at vLLM's alpha and limit for one slice interleaved (GPT-OSS)."""
    if expand.slices() == 2:
        expand_silu_and_mul(expand, out)
    else:
        expand_swigluoai_and_mul(expand, out)


# A GPT-OSS-like buffer: values past swigluoai's limit (7) on both sides, so its clamps act.
SWIGLUOAI_BUFFER_SCALE = 4.0


def gate_up_call(
    case: Case, dtype: torch.dtype, device: str, seed: int, remap: dict[int, int] | None = None
) -> dict[str, Any]:
    """`make_inputs` for a gate/up call: the output cut to the call's width (a view of wider
    rows, as vLLM's strided buffers may be); one slice (2I interleaved columns) is scaled by
    SWIGLUOAI_BUFFER_SCALE."""
    assert case.slices in (1, 2) and case.offset == 0 and case.add_inputs
    assert not case.mul_routed_weight
    args = make_inputs(case, dtype, device, seed, remap)
    gate_up = args["output"][..., : case.slices * case.n]
    if case.slices == 1:
        assert case.n % 2 == 0, "an interleaved gate/up call has an even width"
        gate_up.mul_(SWIGLUOAI_BUFFER_SCALE)
    args["output"] = gate_up
    return args


def check_expand_activation(
    case: Case, config: MoeLoraConfig, dtype: torch.dtype, device: str, seed: int
) -> float:
    """The gate/up op deferred (`defer_gate_up_expand`), then its expand fused into the
    activation (`fused_activation`), against the spec; returns the relative error of the
    activation. The buffer must be left as it was: the shrink alone does not touch it and the
    fused kernel only reads it."""
    args = gate_up_call(case, dtype, device, seed)
    gate_up = args["output"]
    before = gate_up.clone()
    cpu_args = {**_cpu_args(args), "block_size": case.block_m}
    if case.slices == 2:
        want = expand_silu_and_mul_reference(before.cpu(), **cpu_args)
    else:
        want = expand_swigluoai_and_mul_reference(before.cpu(), SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT,
                                                  **cpu_args)  # fmt: skip
    with defer_gate_up_expand() as deferred:
        fused_moe_lora(**args, shrink_block_size_m=case.block_m, config=config)
    assert len(deferred) == 1, "a split gate/up call must leave its expand"
    assert torch.equal(gate_up, before), "the shrink alone changed the buffer"
    width = gate_up.shape[-1] // 2
    out = torch.full((case.tokens * case.top_k, width), 777.0, dtype=dtype, device=device)
    fused_activation(deferred[0], out)
    assert torch.equal(gate_up, before), "the fused kernel wrote the buffer"
    got = out.double().cpu()
    assert not torch.isnan(got).any()
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def assert_same_groups(
    ours: torch.Tensor, ref: torch.Tensor, ref_experts: torch.Tensor, block: int
) -> None:
    """Sorted forms (slots x EM) agree group by group: the same pair ids and padding in each
    (slot, expert) group, in any order within the group (the order atomics land)."""
    for slot in range(ref.shape[0]):
        row = ref_experts[slot].tolist()
        start = 0
        while start < len(row) and row[start] >= 0:
            end = start
            while end < len(row) and row[end] == row[start]:
                end += 1
            lo, hi = start * block, end * block
            got = torch.sort(ours[slot, lo:hi]).values
            want = torch.sort(ref[slot, lo:hi]).values
            assert torch.equal(got, want), f"slot {slot}, expert {row[start]}"
            start = end


def slowly_written(values: torch.Tensor, lead_bytes: int = 2**30) -> tuple[torch.Tensor, Any]:
    """(view, rewrite): `view` is shaped like `values` and sits at the end of a poisoned 1 GiB
    buffer; `rewrite()` writes the whole buffer with an elementwise kernel, `view` last, so that
    `view` then holds `values`.

    On a GPU that write takes about a quarter of a millisecond. A kernel launched right after it
    that read `view` before the write finished would see the poison: how the tests check that our
    PDL launches wait for the kernel before them. A kernel, not `copy_`: a same-dtype copy is a
    cudaMemcpy, and after a copy no kernel launches early under PDL.
    """
    lead = lead_bytes // values.element_size()
    big = torch.full((lead + values.numel(),), 1e4, dtype=values.dtype, device=values.device)
    src = torch.zeros_like(big)
    src[lead:] = values.flatten()
    return big[lead:].view(values.shape), lambda: torch.mul(src, 1, out=big)
