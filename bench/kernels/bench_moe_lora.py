"""Our MoE-LoRA op against vLLM 0.26's `fused_moe_lora` on identical inputs, in one run.

    PYTHONPATH=/tmp/site:. python3 bench/kernels/bench_moe_lora.py --commit SHA --out DIR

Needs a CUDA GPU and vLLM 0.26 (see ../shared/gpu/README.md). For each model shape, call (w13,
w2) and batch, both ops get the same sets of inputs: vLLM's own routing metadata (its
`moe_lora_align_block_size` CUDA op, its naive/sorted rule and its MoE-LoRA config, as
`PunicaWrapperGPU.add_lora_w13` builds them). Times are medians per call in CUDA-graph replay,
the two ops' graphs replayed in turn (`moe_lora_workload.time_interleaved`); "eager" is a plain
Python loop of launches. The HBM floor is the adapter bytes the call must read once over the
device-to-device copy rate measured in the same run. Writes JSON rows (machine, commit, config)
and prints a table.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import vllm._custom_ops  # noqa: F401  (loads torch.ops._moe_C)
from vllm.lora.layers.utils import try_get_optimal_moe_lora_config
from vllm.lora.ops.triton_ops import fused_moe_lora as vllm_fused_moe_lora
from vllm.lora.ops.triton_ops.utils import _normalize_lora_config_keys

from loraplex.kernels.moe_down_fusion import MIN_PAIRS
from loraplex.kernels.moe_down_lora import expert_gemm_with_lora
from loraplex.kernels.moe_lora_act import expand_silu_and_mul
from loraplex.kernels.moe_lora_align import moe_lora_align_block_size
from loraplex.kernels.moe_lora_configs import MoeLoraConfig, ShapeKey, lookup, write_configs
from loraplex.kernels.moe_lora_op import (
    DownLora,
    HeldDownGemm,
    defer_gate_up_expand,
    down_gemm_held,
    fused_moe_lora,
)
from loraplex.kernels.moe_lora_reference import sorted_form_size
from loraplex.kernels.moe_lora_workload import (
    BATCHES,
    SHAPES,
    CallSpec,
    MoeShape,
    copy_bandwidth,
    make_set,
    make_weights,
    naive_form,
    set_topk_ids,
    sets_needed,
    time_interleaved,
)
from loraplex.kernels.tune_moe_lora import candidates, tune_point

CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "NUM_WARPS",
               "NUM_STAGES", "SPLIT_K")  # fmt: skip
DEFAULTS = (64, 64, 32, 8, 4, 3, 1)  # punica_gpu.add_lora_fused_moe's .get() defaults
# Above this many tokens a batch is a prefill: vLLM 0.26 captures CUDA graphs up to
# min(2 x max_num_seqs, 512) tokens, so larger batches always run eagerly.
PREFILL_MIN_TOKENS = 512
# At prefill sizes our op serves unless vLLM's is this much faster. vLLM's one-shot kernel
# specialises on arguments its warm-up cannot enumerate, and JIT-compiled while serving in
# every plugin session on the H200 so far, stalling the step (at c1a083b the repetition with
# the compile gave 58.0 tok/s per request, the other two 63.8 and 64.7); ours has compiled
# nothing while serving. At 204,800 pairs vLLM's down projection was 4-7% faster.
STOCK_MARGIN_PREFILL = 1.10


def vllm_configs(shape: MoeShape, op: str, tokens: int, rank: int) -> tuple[dict, dict]:
    w1 = (shape.experts, 2 * shape.inter, shape.hidden)
    w2 = (shape.experts, shape.hidden, shape.inter)
    get = functools.partial(try_get_optimal_moe_lora_config, w1_shape=w1, w2_shape=w2,
                            rank=rank, top_k=shape.top_k, dtype=None, M=tokens)  # fmt: skip
    shrink = _normalize_lora_config_keys(get(op_type=f"fused_moe_lora_{op}_shrink"))
    expand = _normalize_lora_config_keys(get(op_type=f"fused_moe_lora_{op}_expand"))
    return shrink, expand


def vllm_align(
    topk_ids: torch.Tensor,
    tlm: torch.Tensor,
    num_experts: int,
    block: int,
    max_loras: int,
    enabled: torch.Tensor,
    ours: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`PunicaWrapperGPU.moe_lora_align_block_size` (no expert map), through vLLM's CUDA op, or
    with `ours` through our align kernels (which the plugin serves from ALIGN_MIN_PAIRS on)."""
    padded, blocks = sorted_form_size(topk_ids.numel(), num_experts, block)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_loras * padded, dtype=torch.int32, device=dev)
    expert_ids = torch.full((max_loras * blocks,), -1, dtype=torch.int32, device=dev)
    ntpp = torch.empty(max_loras, dtype=torch.int32, device=dev)
    lora_ids = torch.full((max_loras + 1,), -1, dtype=torch.int32, device=dev)
    active = torch.unique(tlm).to(torch.int32)
    lora_ids[: active.numel()] = active
    if ours:
        moe_lora_align_block_size(topk_ids, tlm, num_experts, block, max_loras, padded, blocks,
                                  sorted_ids, expert_ids, ntpp, enabled)  # fmt: skip
    else:  # the CUDA op itself: its Python name is the plugin's op where the plugin registered
        torch.ops._moe_C.moe_lora_align_block_size(topk_ids, tlm, num_experts, block, max_loras,
                                                   padded, blocks, sorted_ids, expert_ids, ntpp,
                                                   enabled, lora_ids, None)  # fmt: skip
    return sorted_ids.view(max_loras, -1), expert_ids.view(max_loras, -1), ntpp


def vllm_call(args: dict, shrink: dict, expand: dict) -> None:
    sh = [shrink.get(k) or d for k, d in zip(CONFIG_KEYS, DEFAULTS, strict=True)]
    ex = [expand.get(k) or d for k, d in zip(CONFIG_KEYS, DEFAULTS, strict=True)]
    vllm_fused_moe_lora(
        args["output"], args["qcurr_hidden_states"], args["lora_a_stacked"],
        args["lora_b_stacked"], args["topk_weights"], args["sorted_token_ids"],
        args["expert_ids"], args["num_tokens_post_padded"], args["token_lora_mapping"],
        args["max_lora_rank"], args["top_k_num"], args["lora_ids"], args["num_active_loras"],
        args["adapter_enabled"], *sh, *ex, args["mul_routed_weight"], False, 0, True,
    )  # fmt: skip


def with_activation(
    lora: functools.partial, gate_up: torch.Tensor, out: torch.Tensor, fuse: bool = False
) -> None:
    """A gate/up call into `gate_up` (pairs, 2N), then vLLM's SiLU-and-mul of it into `out`, as
    vLLM's fused experts run them; with `fuse`, our op's expand added inside the activation
    (`moe_act_fusion`) where the op defers it."""
    if fuse:
        with defer_gate_up_expand() as deferred:
            lora()
        if deferred:
            expand_silu_and_mul(deferred[0], out)
            return
    else:
        lora()
    torch.ops._C.silu_and_mul(out, gate_up)


def bench_activation(args: list[dict], theirs: list, ours: list) -> dict:
    """The gate/up LoRA with the SiLU-and-mul after it: vLLM's op, ours, ours fused into it."""
    tokens, top_k, width = args[0]["output"].shape
    pairs = tokens * top_k
    buffers = [a["output"].view(pairs, width) for a in args]
    outs = [torch.empty(pairs, width // 2, dtype=b.dtype, device="cuda") for b in buffers]

    def calls(loras: list, fuse: bool) -> list:
        return [functools.partial(with_activation, lora, buffer, out, fuse)
                for lora, buffer, out in zip(loras, buffers, outs, strict=True)]  # fmt: skip

    runs = {"vllm": calls(theirs, False), "ours": calls(ours, False), "fused": calls(ours, True)}
    before = args[0]["output"].clone()
    results = []
    for name in ("ours", "fused"):
        args[0]["output"].copy_(before)
        runs[name][0]()
        results.append(outs[0].float())
    args[0]["output"].copy_(before)
    err = float((results[1] - results[0]).norm() / results[0].norm().clamp_min(1e-30))
    vllm_us, ours_us, fused_us = time_interleaved([runs["vllm"], runs["ours"], runs["fused"]])
    return {"act_vllm_us": vllm_us, "act_ours_us": ours_us, "act_fused_us": fused_us,
            "act_fused_vs_ours": ours_us / fused_us, "act_fused_vs_vllm": vllm_us / fused_us,
            "act_fused_rel_err_vs_ours": err}  # fmt: skip


def bench_down_gemm(shape: MoeShape, tokens: int, args: list[dict], ours: list) -> dict:
    """The down GEMM with the down LoRA after it, as vLLM's fused experts run them: vLLM's GEMM
    alone, vLLM's GEMM then our op (adding into its output), and our GEMM with the LoRA in its
    epilogue after the op's shrink (`moe_down_fusion`). vLLM's own config and expert sorting
    (`moe_align_block_size`) for the GEMM, random w2; `down_slots_per_block` is the mean count
    of adapter slots among a sorted block's pairs (the epilogue does one dot per slot)."""
    import triton.language as tl
    from vllm.model_executor.layers.fused_moe import fused_moe
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    # vLLM 0.26's launcher; typed as Any, as mypy reads the CPU environment's newer vLLM.
    invoke: Any = fused_moe.invoke_fused_moe_triton_kernel
    try_get_optimal_moe_config = fused_moe.try_get_optimal_moe_config

    e, hidden, inter, k = shape.experts, shape.hidden, shape.inter, shape.top_k
    w2 = (torch.randn(e, hidden, inter, device="cuda") * inter**-0.5).to(torch.bfloat16)
    cfg = try_get_optimal_moe_config((e, 2 * inter, hidden), tuple(w2.shape), k, None, tokens)
    routings = [moe_align_block_size(set_topk_ids(shape, tokens, i).cuda(), cfg["BLOCK_SIZE_M"],
                                     e) for i in range(len(args))]  # fmt: skip
    flags = dict.fromkeys(("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16",
                           "per_channel_quant"), False)  # fmt: skip

    def gemm(a: dict, routing: tuple) -> None:
        invoke(
            a["qcurr_hidden_states"], w2, a["output"], None, None, a["topk_weights"], *routing,
            True, 1, cfg, compute_type=tl.bfloat16, **flags,
        )  # fmt: skip

    def unfused(a: dict, routing: tuple, lora: functools.partial) -> None:
        gemm(a, routing)
        lora()

    def fused(a: dict, routing: tuple, lora: functools.partial) -> None:
        def launch(down: DownLora | None) -> None:
            if down is None:
                gemm(a, routing)
            else:
                sorted_ids, expert_ids, ntpp = routing
                expert_gemm_with_lora(a["qcurr_hidden_states"], w2, a["output"],
                                      a["topk_weights"], sorted_ids, expert_ids, ntpp, cfg, True,
                                      down)  # fmt: skip

        held = HeldDownGemm(a["output"], launch)
        with down_gemm_held(held):
            lora()

    runs = [[functools.partial(fn, a, r, lora) for a, r, lora in zip(args, routings, ours,
                                                                       strict=True)]
            for fn in (unfused, fused)]  # fmt: skip
    gemm_only = [functools.partial(gemm, a, r) for a, r in zip(args, routings, strict=True)]
    results = []
    for run in runs:
        run[0]()
        results.append(args[0]["output"].float())
    err = float((results[1] - results[0]).norm() / results[0].norm())
    sorted_ids, _, ntpp = routings[0]
    pairs = tokens * k
    blocks = sorted_ids[: int(ntpp)].view(-1, cfg["BLOCK_SIZE_M"]).long()
    slot_of = torch.where(blocks < pairs, args[0]["token_lora_mapping"].long()[blocks.clamp(
        max=pairs - 1) // k], -1)  # fmt: skip
    present = torch.zeros(blocks.shape[0], int(slot_of.max()) + 2, device="cuda")
    present.scatter_(1, slot_of + 1, 1.0)
    slots_per_block = float(present[:, 1:].sum(1).mean())
    gemm_us, unfused_us, fused_us = time_interleaved([gemm_only, *runs])
    return {"down_gemm_us": gemm_us, "down_unfused_us": unfused_us, "down_fused_us": fused_us,
            "down_fused_vs_unfused": unfused_us / fused_us,
            "down_lora_us_unfused": unfused_us - gemm_us, "down_lora_us_fused": fused_us - gemm_us,
            "down_fused_rel_err_vs_unfused": err, "down_slots_per_block": slots_per_block,
            "down_gemm_config": cfg}  # fmt: skip


def eager_per_call(calls: list, trials: int = 5) -> float:
    times = []
    for _ in range(trials):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for call in calls:
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e6 / len(calls))
    return statistics.median(times)


def bench_point(
    shape: MoeShape, op: str, tokens: int, weights: tuple, bw: float, ns: argparse.Namespace
) -> dict:
    spec = CallSpec.of(shape, op)
    shrink, expand = vllm_configs(shape, op, tokens, ns.rank)
    block_m = int(shrink.get("BLOCK_SIZE_M") or 64)
    align = functools.partial(vllm_align, ours=ns.align == "ours")
    first, nbytes = make_set(shape, spec, tokens, ns.adapters, 0, weights, block_m, ns.dtype,
                             "cuda", align)  # fmt: skip
    sets = [(first, nbytes)] + [
        make_set(shape, spec, tokens, ns.adapters, i, weights, block_m, ns.dtype, "cuda", align)
        for i in range(1, sets_needed(nbytes))
    ]  # fmt: skip
    args = [s for s, _ in sets]
    sorted_form = not naive_form(shape, tokens, ns.adapters)
    key = ShapeKey(spec.k, spec.n, spec.slices, ns.rank, shape.experts, shape.top_k, sorted_form,
                   str(ns.dtype))  # fmt: skip
    num_pairs = tokens * shape.top_k
    theirs = [functools.partial(vllm_call, a, shrink, expand) for a in args]
    if ns.tune:
        cfg, _ = tune_point(args, candidates(spec.k, num_pairs, spec.slices), block_m)
    else:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        cfg = lookup(torch.cuda.get_device_name(), key, num_pairs, sms)
        if cfg.variant == "stock":  # time our best kernel anyway: the row compares kernels
            cfg, _ = tune_point(args, candidates(spec.k, num_pairs, spec.slices), block_m)
    ours = [
        functools.partial(fused_moe_lora, **a, shrink_block_size_m=block_m, config=cfg)
        for a in args
    ]
    # Compared on a zeroed output, so the error is the delta's, not the base values' rounding.
    before = args[0]["output"].clone()
    args[0]["output"].zero_()
    theirs[0]()
    ref = args[0]["output"].float()
    args[0]["output"].zero_()
    ours[0]()
    got = args[0]["output"].float()
    args[0]["output"].copy_(before)
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    vllm_us, ours_us = time_interleaved([theirs, ours])
    served = cfg
    # Keep what wins (the plugin hands "stock" calls to vLLM's kernel), except at prefill sizes,
    # where vLLM's must win by STOCK_MARGIN_PREFILL: see its comment.
    margin = STOCK_MARGIN_PREFILL if tokens > PREFILL_MIN_TOKENS else 1.0
    if vllm_us * margin < ours_us:
        served = MoeLoraConfig("stock", cfg.block_k, cfg.block_n)
    if ns.tune:
        ns.tuned.setdefault(key.text(), {})[num_pairs] = served
    floor_us = statistics.mean(b for _, b in sets) / bw * 1e6
    if op == "w13" and shape.activation == "silu":
        extra = bench_activation(args, theirs, ours)
    elif op == "w2" and sorted_form and tokens * shape.top_k >= MIN_PAIRS:
        extra = bench_down_gemm(shape, tokens, args, ours)
    else:
        extra = {}
    return extra | {
        "shape": shape.name, "op": op, "tokens": tokens,
        "form": "sorted" if sorted_form else "naive",
        "vllm_block_m": block_m, "sets": len(sets), "vllm_us": vllm_us, "ours_us": ours_us,
        "speedup": vllm_us / ours_us, "plugin_speedup": vllm_us / min(vllm_us, ours_us),
        "plugin_serves": "vllm" if served.variant == "stock" else "loraplex",
        "floor_us": floor_us, "ours_over_floor": ours_us / floor_us,
        "vllm_eager_us": eager_per_call(theirs), "ours_eager_us": eager_per_call(ours),
        "rel_err_vs_vllm": err, "our_config": cfg.to_json(),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--tune", action="store_true", help="tune our op on these inputs first")
    parser.add_argument("--align", choices=["vllm", "ours"], default="vllm",
                        help="who builds the sorted routing form both ops read")  # fmt: skip
    parser.add_argument("--shape-ops", nargs="+", default=["w13", "w2"])
    ns = parser.parse_args()
    ns.tuned = {}  # shape key -> num pairs -> MoeLoraConfig
    ns.dtype = torch.bfloat16
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for name in ns.shapes:
        shape = SHAPES[name]
        for op in ns.shape_ops:
            weights = make_weights(shape, CallSpec.of(shape, op), ns.adapters, ns.rank, ns.dtype,
                                   "cuda")  # fmt: skip
            for tokens in ns.batches:
                row = bench_point(shape, op, tokens, weights, bw, ns)
                row.update(machine=gpu, commit=ns.commit, copy_tb_s=bw / 1e12, rank=ns.rank,
                           adapters=ns.adapters, dtype="bfloat16", align=ns.align)  # fmt: skip
                rows.append(row)
                print(f"{name:14s} {op:3s} T={tokens:6d} {row['form']:6s} vllm "
                      f"{row['vllm_us']:9.1f} ours {row['ours_us']:9.1f} x{row['speedup']:5.2f} "
                      f"floor {row['floor_us']:8.1f} ours/floor {row['ours_over_floor']:5.2f} "
                      f"err {row['rel_err_vs_vllm']:.1e}", flush=True)  # fmt: skip
                if "down_fused_us" in row:
                    print(f"{'':14s} down GEMM {row['down_gemm_us']:9.1f} +LoRA "
                          f"{row['down_unfused_us']:9.1f} fused {row['down_fused_us']:9.1f} "
                          f"x{row['down_fused_vs_unfused']:5.2f} slots/block "
                          f"{row['down_slots_per_block']:4.1f} err "
                          f"{row['down_fused_rel_err_vs_unfused']:.1e}", flush=True)  # fmt: skip
                if "act_fused_us" in row:
                    print(f"{'':14s} +silu_and_mul  vllm {row['act_vllm_us']:9.1f} ours "
                          f"{row['act_ours_us']:9.1f} fused {row['act_fused_us']:9.1f} "
                          f"x{row['act_fused_vs_ours']:5.2f} vs ours "
                          f"err {row['act_fused_rel_err_vs_ours']:.1e}", flush=True)  # fmt: skip
            del weights
            torch.cuda.empty_cache()
    if ns.tune:
        print("wrote", write_configs(gpu, ns.tuned))
    ns.out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in gpu).lower()
    name = f"moe_lora_{slug}.json" if ns.align == "vllm" else f"moe_lora_{slug}_align_ours.json"
    (ns.out / name).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
