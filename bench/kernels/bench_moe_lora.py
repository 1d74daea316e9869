"""Our MoE-LoRA op against vLLM 0.26's `fused_moe_lora` on identical inputs, in one run.

    PYTHONPATH=/tmp/site:. python3 bench/kernels/bench_moe_lora.py --commit SHA --out DIR

Needs a CUDA GPU and vLLM 0.26 (see ../shared/gpu/README.md). For each model shape, call (w13,
w2) and batch, built in the MoE-LoRA layout vLLM serves the model with (`moe_lora_workload`:
GPT-OSS's gate/up one slice of 2 x inter columns, the 3D layout; Qwen3's two slices, the 2D
layout; each row's `layout`), both ops get the same tokens, adapters and routing, in the routing
form each gets in vLLM: vLLM's own metadata (its `moe_lora_align_block_size` CUDA op, its
naive/sorted rule and its MoE-LoRA config, as `PunicaWrapperGPU.add_lora_w13` builds them), for
our op also in the naive form while pairs <= experts x max_loras, up to 1,024 pairs, and in the
sorted form in the plugin's blocks (the plugin's rules, `REGIMES.naive` and `REGIMES.block_m` in
kernels/dispatch.py).
Where the two forms differ our op also runs in vLLM's form ("in vLLM's form", ours_vllm_form_us,
with the config the configs file gives that form; see bench_point).
Times are medians per call in CUDA-graph replay, the graphs replayed in turn
(`moe_lora_workload.time_interleaved`); "eager" is a plain Python loop of launches. The HBM
floor is the adapter bytes the call must read once over the device-to-device copy rate measured
in the same run. With --tune, the config the configs file gave before the tune is timed in the
same interleaved run ("was", prev_us). --popularity spreads the tokens over the adapters other
than round robin (`moe_lora_workload.token_slots`): zipf, or one adapter on every token. Writes
JSON rows (machine, commit, config, layout, popularity) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from pathlib import Path

import torch
import vllm._custom_ops  # noqa: F401  (loads torch.ops._moe_C)
from vllm.lora.layers.utils import try_get_optimal_moe_lora_config
from vllm.lora.ops.triton_ops import fused_moe_lora as vllm_fused_moe_lora
from vllm.lora.ops.triton_ops.utils import _normalize_lora_config_keys

from bench.common import append_rows
from bench.kernels.moe_lora_workload import (
    BATCHES,
    POPULARITIES,
    SHAPES,
    CallSpec,
    MoeShape,
    copy_bandwidth,
    make_sets,
    make_weights,
    naive_form,
    served_naive,
    time_interleaved,
)
from bench.kernels.tune_moe_lora import candidates, fuses_activation, shape_key, tune_point
from loraplex.kernels.dispatch import REGIMES
from loraplex.kernels.ops.moe_lora.act import expand_silu_and_mul, expand_swigluoai_and_mul
from loraplex.kernels.ops.moe_lora.configs import (
    MoeLoraConfig,
    gpu_of,
    gpu_slug,
    lookup,
    write_configs,
)
from loraplex.kernels.ops.moe_lora.op import defer_gate_up_expand, fused_moe_lora
from loraplex.kernels.ops.moe_lora_align.op import moe_lora_align_block_size
from loraplex.kernels.ops.moe_lora_align.reference import sorted_form_size

CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "NUM_WARPS",
               "NUM_STAGES", "SPLIT_K")  # fmt: skip
DEFAULTS = (64, 64, 32, 8, 4, 3, 1)  # punica_gpu.add_lora_fused_moe's .get() defaults
# Above this many tokens a batch is a prefill: vLLM 0.26 captures CUDA graphs up to
# min(2 x max_num_seqs, 512) tokens, so larger batches always run eagerly.
PREFILL_MIN_TOKENS = 512
# At prefill sizes our op serves unless vLLM's is this much faster. vLLM's one-shot kernel
# specialises on arguments its warm-up cannot enumerate, and JIT-compiled while serving in
# every plugin session on the H200, stalling the step (the repetition with the compile: 58.0
# tok/s per request, the other two 63.8 and 64.7); ours has compiled nothing while serving. At
# 204,800 pairs vLLM's down projection was 4-7% faster.
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
    with `ours` through our align kernels (which the plugin serves where `REGIMES.our_align`
    says)."""
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


# The shape's activation after gate/up: vLLM's op, and ours with the LoRA's expand fused in.
ACTIVATIONS = {
    "silu": (lambda out, gate_up: torch.ops._C.silu_and_mul(out, gate_up), expand_silu_and_mul),
    "swigluoai": (lambda out, gate_up: torch.ops._C.swigluoai_and_mul(out, gate_up),
                  expand_swigluoai_and_mul),
}  # fmt: skip


def with_activation(
    lora: functools.partial, gate_up: torch.Tensor, out: torch.Tensor, activation: str,
    fuse: bool = False,
) -> None:  # fmt: skip
    """A gate/up call into `gate_up` (pairs, 2N), then vLLM's `activation` of it into `out`
    (silu_and_mul or swigluoai_and_mul, at its defaults as vLLM's fused experts call it), as
    vLLM's fused experts run them; with `fuse`, our op's expand added inside the activation
    (`fused_experts`) where the op defers it."""
    vllm_act, fused_act = ACTIVATIONS[activation]
    if fuse:
        with defer_gate_up_expand() as deferred:
            lora()
        if deferred:
            fused_act(deferred[0], out)
            return
    else:
        lora()
    vllm_act(out, gate_up)


def bench_activation(
    their_args: list[dict], args: list[dict], theirs: list, ours: list, activation: str
) -> dict:
    """The gate/up LoRA with the activation after it: vLLM's op (on their_args, its routing
    form), ours and ours fused into it (on args)."""
    tokens, top_k, width = args[0]["output"].shape
    pairs = tokens * top_k
    outs = [torch.empty(pairs, width // 2, dtype=args[0]["output"].dtype, device="cuda")
            for _ in args]  # fmt: skip

    def calls(loras: list, sets: list[dict], fuse: bool) -> list:
        return [functools.partial(with_activation, lora, s["output"].view(pairs, width), out,
                                  activation, fuse)
                for lora, s, out in zip(loras, sets, outs, strict=True)]  # fmt: skip

    runs = {"vllm": calls(theirs, their_args, False), "ours": calls(ours, args, False),
            "fused": calls(ours, args, True)}  # fmt: skip
    before = args[0]["output"].clone()
    results = []
    for name in ("ours", "fused"):
        args[0]["output"].copy_(before)
        runs[name][0]()
        results.append(outs[0].float())
    args[0]["output"].copy_(before)
    err = float((results[1] - results[0]).norm() / results[0].norm().clamp_min(1e-30))
    vllm_us, ours_us, fused_us = time_interleaved([runs["vllm"], runs["ours"], runs["fused"]])
    return {"activation": activation, "act_vllm_us": vllm_us, "act_ours_us": ours_us,
            "act_fused_us": fused_us, "act_fused_vs_ours": ours_us / fused_us,
            "act_fused_vs_vllm": vllm_us / fused_us, "act_fused_rel_err_vs_ours": err}  # fmt: skip


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
    num_pairs = tokens * shape.top_k
    vllm_block = int(shrink.get("BLOCK_SIZE_M") or 64)
    block_m = REGIMES.block_m(num_pairs, shape.experts, ns.adapters, vllm_block)
    align = functools.partial(vllm_align, ours=ns.align == "ours")

    def make(block: int, naive: bool) -> list[tuple[dict, int]]:
        return make_sets(shape, spec, tokens, ns.adapters, weights, block, ns.dtype, "cuda",
                         align, naive=naive, popularity=ns.popularity)  # fmt: skip

    vllm_naive = naive_form(shape, tokens, ns.adapters)
    our_naive = served_naive(shape, tokens, ns.adapters)
    sorted_form = not our_naive
    # Each op gets the routing form it gets in vLLM, on the same tokens and routing: vLLM's by
    # its own rules, ours by the plugin's (`REGIMES.naive`, `REGIMES.block_m`).
    sets = make(block_m, our_naive)
    args = [s for s, _ in sets]
    same_form = vllm_naive == our_naive and (our_naive or block_m == vllm_block)
    their_args = args if same_form else [s for s, _ in make(vllm_block, vllm_naive)]
    key = shape_key(shape, spec, ns.rank, sorted_form, str(ns.dtype))
    theirs = [functools.partial(vllm_call, a, shrink, expand) for a in their_args]
    gpu = gpu_of(torch.cuda.get_device_properties(0))
    our_block = block_m if sorted_form else None  # what a sorted entry records it was tuned at
    cfg = lookup(gpu, key, num_pairs, our_block)
    # With --tune, the config this tree's file gave before the tune: timed beside the new one,
    # so the row says what the re-tune changed in the same interleaved run.
    prev = cfg if ns.tune else None
    # With --tune, and where the file says stock (time our best kernel anyway: the row compares
    # kernels), tune here.
    if ns.tune or cfg.variant == "stock":
        best, _ = tune_point(
            args,
            candidates(spec.k, num_pairs, spec.slices, naive=not sorted_form,
                       fused_activation=fuses_activation(shape, op)),
            block_m,
        )  # fmt: skip
        cfg = dataclasses.replace(best, tuned_block_m=our_block)

    def ours_with(config: MoeLoraConfig, sets: list[dict], block: int = block_m) -> list:
        return [functools.partial(fused_moe_lora, **a, shrink_block_size_m=block,
                                  config=config) for a in sets]  # fmt: skip

    ours = ours_with(cfg, args)
    # Compared on zeroed outputs, so the error is the delta's, not the base values' rounding.
    before = args[0]["output"].clone()
    their_args[0]["output"].zero_()
    theirs[0]()
    ref = their_args[0]["output"].float()
    their_args[0]["output"].copy_(before)
    args[0]["output"].zero_()
    ours[0]()
    got = args[0]["output"].float()
    args[0]["output"].copy_(before)
    err = float((got - ref).norm() / ref.norm().clamp_min(1e-30))
    timed = {"vllm": theirs, "ours": ours}
    if prev is not None and prev.variant != "stock" and prev != cfg:
        timed["prev"] = ours_with(prev, args)
    # Where the plugin's rules give our op another form than vLLM's (naive, or smaller blocks):
    # our op in vLLM's form too, with the config the file gives that form and block (`lookup`:
    # an entry serves blocks within BLOCK_M_TOLERANCE of its own; one that records no block, as
    # before entries recorded theirs, was tuned at vLLM's block and serves any).
    if their_args is not args:
        vllm_form_key = dataclasses.replace(key, sorted_form=not vllm_naive)
        vllm_form_cfg = lookup(gpu, vllm_form_key, num_pairs,
                               None if vllm_naive else vllm_block)  # fmt: skip
        if vllm_form_cfg.variant != "stock":
            timed["ours_vllm_form"] = ours_with(vllm_form_cfg, their_args, vllm_block)
    times = dict(zip(timed, time_interleaved(list(timed.values())), strict=True))
    vllm_us, ours_us = times["vllm"], times["ours"]
    # "was" is None without a tune and where the file's config was "stock" (vLLM's kernel
    # served the call).
    prev_us = times.get("prev", ours_us if prev == cfg else None)
    served = cfg
    # Keep what wins (the plugin hands "stock" calls to vLLM's kernel), except at prefill sizes,
    # where vLLM's must win by STOCK_MARGIN_PREFILL: see its comment.
    margin = STOCK_MARGIN_PREFILL if tokens > PREFILL_MIN_TOKENS else 1.0
    if vllm_us * margin < ours_us:
        served = MoeLoraConfig("stock", cfg.block_k, cfg.block_n, tuned_block_m=our_block)
    if ns.tune:
        ns.tuned.setdefault(key.text(), {})[num_pairs] = served
    floor_us = statistics.mean(b for _, b in sets) / bw * 1e6
    fused = fuses_activation(shape, op)
    activation = bench_activation(their_args, args, theirs, ours, shape.activation) if fused else {}
    return activation | {
        "shape": shape.name, "layout": shape.layout, "op": op, "tokens": tokens,
        "form": "sorted" if sorted_form else "naive",
        "vllm_form": "naive" if vllm_naive else "sorted",
        "block_m": None if our_naive else block_m,
        "vllm_block_m": None if vllm_naive else vllm_block, "sets": len(sets),
        "vllm_us": vllm_us, "ours_us": ours_us,
        "speedup": vllm_us / ours_us, "plugin_speedup": vllm_us / min(vllm_us, ours_us),
        "plugin_serves": "vllm" if served.variant == "stock" else "loraplex",
        "floor_us": floor_us, "ours_over_floor": ours_us / floor_us,
        "vllm_eager_us": eager_per_call(theirs), "ours_eager_us": eager_per_call(ours),
        "rel_err_vs_vllm": err, "our_config": cfg.to_json(),
        "prev_config": prev.to_json() if prev else None,
        "prev_us": prev_us,
        "ours_vllm_form_us": times.get("ours_vllm_form"),
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
                        help="who builds the sorted routing form (vLLM's op reads it, and ours "
                             "where the plugin does not give it the naive form)")  # fmt: skip
    parser.add_argument("--shape-ops", nargs="+", default=["w13", "w2"])
    parser.add_argument("--popularity", choices=POPULARITIES, default="round_robin",
                        help="how tokens spread over the adapters (moe_lora_workload)")  # fmt: skip
    ns = parser.parse_args()
    if ns.tune and ns.popularity != "round_robin":
        # The configs file's keys hold no popularity: a tune on a skewed load would serve all.
        parser.error(f"--tune takes the round_robin popularity, not {ns.popularity}")
    ns.tuned = {}  # shape key -> num pairs -> MoeLoraConfig
    ns.dtype = torch.bfloat16
    gpu = gpu_of(torch.cuda.get_device_properties(0))
    bw = copy_bandwidth()
    print(f"{gpu.name}: copy {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for name in ns.shapes:
        shape = SHAPES[name]
        for op in ns.shape_ops:
            weights = make_weights(shape, CallSpec.of(shape, op), ns.adapters, ns.rank, ns.dtype,
                                   "cuda")  # fmt: skip
            for tokens in ns.batches:
                row = bench_point(shape, op, tokens, weights, bw, ns)
                row.update(machine=gpu.name, commit=ns.commit, copy_tb_s=bw / 1e12, rank=ns.rank,
                           adapters=ns.adapters, dtype="bfloat16", align=ns.align,
                           popularity=ns.popularity)  # fmt: skip
                rows.append(row)
                form = row["form"] + (str(row["block_m"]) if row["block_m"] else "")
                print(f"{name:14s} {op:3s} T={tokens:6d} {form:8s} vllm "
                      f"{row['vllm_us']:9.1f} ours {row['ours_us']:9.1f} x{row['speedup']:5.2f} "
                      f"floor {row['floor_us']:8.1f} ours/floor {row['ours_over_floor']:5.2f} "
                      f"err {row['rel_err_vs_vllm']:.1e}"
                      + (f" was {row['prev_us']:9.1f}" if row["prev_us"] else "")
                      + (f" in vLLM's form {row['ours_vllm_form_us']:9.1f}"
                         if row["ours_vllm_form_us"] else ""),
                      flush=True)  # fmt: skip
                if "act_fused_us" in row:
                    print(f"{'':14s} +{row['activation']:13s} vllm {row['act_vllm_us']:9.1f} ours "
                          f"{row['act_ours_us']:9.1f} fused {row['act_fused_us']:9.1f} "
                          f"x{row['act_fused_vs_ours']:5.2f} vs ours "
                          f"err {row['act_fused_rel_err_vs_ours']:.1e}", flush=True)  # fmt: skip
            del weights
            torch.cuda.empty_cache()
    if ns.tune:
        print("wrote", write_configs(gpu, ns.tuned))
    name = "moe_lora" if ns.align == "vllm" else "moe_lora_align_ours"
    print("wrote", append_rows(f"{name}_{gpu_slug(gpu.name)}", rows, ns.out))


if __name__ == "__main__":
    main()
