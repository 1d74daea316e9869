"""Prefill-sized LoRA pieces, ours against vLLM 0.26's on identical inputs, in one run:

- align: the MoE-LoRA routing (sorted form) by our kernels (`moe_lora_align`) and by vLLM's
  `moe_lora_align_block_size` CUDA op, at Qwen3-30B-A3B (128 experts, top-8) and GPT-OSS-20B
  (32 experts, top-4) routing;
- dense: attention LoRA (qkv, o) by our tiled kernels (`lora_dense_tiled`) and by vLLM's
  `_lora_shrink` + `_lora_expand`, both on vLLM's own `LoRAKernelMeta`;
- sum: the experts' outputs summed per token with the side-stream down LoRA's deltas
  (`ops.moe_lora_sum.op.moe_sum_with_delta`, two (T, k, H) buffers) beside vLLM's `moe_sum` of one
  buffer, the op it replaces: not the same work, so the row reports each over its own floor.

    PYTHONPATH=/tmp/site:. python3 bench/kernels/bench_lora_prefill.py --commit SHA --out DIR \
        [--parts align dense sum]

Batches are 16 requests in runs of equal length, round robin over 8 rank-32 adapter slots (the
issue 6 workload's mapping). Times are medians per call in CUDA-graph replay, ours and vLLM's
replayed in turn (`time_interleaved`); the dense floor is x read once plus y read and written
once, over the copy rate measured in the same run; a sum's floor is its buffers read once and
the output written once. Writes JSON rows (machine, commit, config) and prints a table.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch
import vllm._custom_ops  # loads torch.ops._moe_C; its moe_sum is what ours replaces
from vllm.lora.ops.triton_ops import LoRAKernelMeta
from vllm.lora.ops.triton_ops.lora_expand_op import _lora_expand
from vllm.lora.ops.triton_ops.lora_shrink_op import _lora_shrink

from bench.common import append_rows
from bench.kernels.moe_lora_workload import copy_bandwidth, default_block_m, time_interleaved
from loraplex.kernels.ops.lora_dense.tiled import lora_dense_tiled
from loraplex.kernels.ops.moe_lora.configs import gpu_slug
from loraplex.kernels.ops.moe_lora_align.op import moe_lora_align_block_size
from loraplex.kernels.ops.moe_lora_align.reference import sorted_form_size
from loraplex.kernels.ops.moe_lora_sum.op import moe_sum_with_delta

SLOTS, RANK, REQUESTS = 8, 32, 16
ROUTING = {"qwen3-30b-a3b": (128, 8), "gpt-oss-20b": (32, 4)}  # experts, top-k
DENSE = {  # layer: (K, slice widths)
    "qwen3-30b-a3b qkv": (2048, [4096, 512, 512]),
    "qwen3-30b-a3b o": (4096, [2048]),
    "gpt-oss-20b qkv": (2880, [4096, 512, 512]),
    "gpt-oss-20b o": (4096, [2880]),
}
SUM = {"qwen3-30b-a3b": (2048, 8), "gpt-oss-20b": (2880, 4)}  # hidden, top-k
ALIGN_TOKENS = (64, 256, 512, 1024, 4096, 16384)
DENSE_TOKENS = (128, 1024, 4096, 16384)
SUM_TOKENS = (9216, 16384)  # the e2e workload's prefill steps


def slot_mapping(tokens: int) -> torch.Tensor:
    request = torch.arange(tokens, device="cuda") * REQUESTS // tokens
    return (request % SLOTS).to(torch.int32)


def bench_align(name: str, tokens: int) -> dict:
    experts, top_k = ROUTING[name]
    block = default_block_m(tokens)
    pairs = tokens * top_k
    padded, blocks = sorted_form_size(pairs, experts, block)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    topk = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k]
                        for _ in range(tokens)]).int()  # fmt: skip
    tlm = slot_mapping(tokens)
    enabled = torch.ones(SLOTS + 1, dtype=torch.int32, device="cuda")
    lora_ids = torch.full((SLOTS + 1,), -1, dtype=torch.int32, device="cuda")
    lora_ids[:SLOTS] = torch.arange(SLOTS, dtype=torch.int32)

    def outputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (torch.empty(SLOTS * padded, dtype=torch.int32, device="cuda"),
                torch.full((SLOTS * blocks,), -1, dtype=torch.int32, device="cuda"),
                torch.empty(SLOTS, dtype=torch.int32, device="cuda"))  # fmt: skip

    theirs_out, ours_out = outputs(), outputs()
    theirs = functools.partial(torch.ops._moe_C.moe_lora_align_block_size, topk, tlm, experts,
                               block, SLOTS, padded, blocks, *theirs_out, enabled, lora_ids,
                               None)  # fmt: skip
    ours = functools.partial(moe_lora_align_block_size, topk, tlm, experts, block, SLOTS, padded,
                             blocks, *ours_out, enabled)  # fmt: skip
    theirs()
    ours()
    agrees = torch.equal(theirs_out[2], ours_out[2]) and torch.equal(theirs_out[1], ours_out[1])
    if agrees:  # the same pairs in each (slot, expert) group, in any order within it
        pos = torch.arange(SLOTS * padded, device="cuda")
        slot, block_of = pos // padded, (pos % padded) // block
        inside = (pos % padded) < theirs_out[2][slot]
        group = theirs_out[1].view(SLOTS, blocks)[slot, block_of] + slot * experts

        def grouped(ids: torch.Tensor) -> torch.Tensor:
            return torch.sort((group * (pairs + 1) + ids)[inside]).values

        agrees = torch.equal(grouped(theirs_out[0]), grouped(ours_out[0]))
    vllm_us, ours_us = time_interleaved([[theirs], [ours]])
    return {"part": "align", "shape": name, "tokens": tokens, "block_m": block,
            "vllm_us": vllm_us, "ours_us": ours_us, "speedup": vllm_us / ours_us,
            "agrees_with_vllm": bool(agrees)}  # fmt: skip


def bench_dense(layer: str, tokens: int, bw: float) -> dict:
    k, widths = DENSE[layer]
    dtype = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, k, device="cuda", generator=gen).to(dtype)
    a = [(torch.randn(SLOTS, 1, RANK, k, device="cuda", generator=gen) / k**0.5).to(dtype)
         for _ in widths]  # fmt: skip
    b = [(torch.randn(SLOTS, 1, n, RANK, device="cuda", generator=gen) / 8).to(dtype)
         for n in widths]  # fmt: skip
    meta = LoRAKernelMeta.make(SLOTS, tokens, device="cuda")
    meta.prepare_tensors(slot_mapping(tokens))
    args = meta.meta_args(tokens, False)
    y_theirs = torch.zeros(tokens, sum(widths), device="cuda", dtype=dtype)
    y_ours = y_theirs.clone()
    buffer = torch.empty((len(widths), tokens, RANK), dtype=torch.float32, device="cuda")

    def theirs() -> None:
        _lora_shrink(x, a, buffer, *args, 1.0)
        _lora_expand(buffer, b, y_theirs, *args, offset_start=0, add_inputs=True)

    sorted_ids, per_lora, starts, lora_ids = args[1], args[2], args[3], args[4]
    ours = functools.partial(lora_dense_tiled, y_ours, x, a, b, 1.0, sorted_ids, per_lora, starts,
                             lora_ids, True)  # fmt: skip
    theirs()
    ours()
    err = float((y_ours.float() - y_theirs.float()).norm() / y_theirs.float().norm())
    vllm_us, ours_us = time_interleaved([[theirs], [ours]])
    floor_us = (x.numel() + 2 * y_ours.numel()) * 2 / bw * 1e6
    return {"part": "dense", "shape": layer, "tokens": tokens, "vllm_us": vllm_us,
            "ours_us": ours_us, "speedup": vllm_us / ours_us, "floor_us": floor_us,
            "ours_over_floor": ours_us / floor_us, "rel_err_vs_vllm": err}  # fmt: skip


def bench_sum(name: str, tokens: int, bw: float) -> dict:
    hidden, top_k = SUM[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    experts_out, delta = (torch.randn(tokens, top_k, hidden, device="cuda", generator=gen)
                          .to(torch.bfloat16) for _ in range(2))  # fmt: skip
    enabled = torch.ones(SLOTS + 1, dtype=torch.int32, device="cuda")
    out_theirs = torch.empty(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    out_ours = torch.empty_like(out_theirs)
    theirs = functools.partial(vllm._custom_ops.moe_sum, experts_out, out_theirs)
    ours = functools.partial(moe_sum_with_delta, experts_out, delta, slot_mapping(tokens),
                             enabled, SLOTS, out_ours)  # fmt: skip
    theirs()
    ours()
    want = (experts_out.float() + delta.float()).sum(dim=1)
    err = float((out_ours.float() - want).norm() / want.norm())
    vllm_us, ours_us = time_interleaved([[theirs], [ours]])
    out_bytes = out_ours.numel() * 2
    vllm_floor_us = (experts_out.numel() * 2 + out_bytes) / bw * 1e6
    floor_us = (2 * experts_out.numel() * 2 + out_bytes) / bw * 1e6
    return {"part": "sum", "shape": name, "tokens": tokens, "vllm_us": vllm_us,
            "ours_us": ours_us, "speedup": vllm_us / ours_us, "floor_us": floor_us,
            "ours_over_floor": ours_us / floor_us, "vllm_over_its_floor": vllm_us / vllm_floor_us,
            "rel_err_vs_fp32": err}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--parts", nargs="+", choices=["align", "dense", "sum"],
                        default=["align", "dense", "sum"])  # fmt: skip
    ns = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    print(f"{gpu}: copy {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    if "align" in ns.parts:
        rows += [bench_align(name, t) for name in ROUTING for t in ALIGN_TOKENS]
    if "dense" in ns.parts:
        rows += [bench_dense(layer, t, bw) for layer in DENSE for t in DENSE_TOKENS]
    if "sum" in ns.parts:
        rows += [bench_sum(name, t, bw) for name in SUM for t in SUM_TOKENS]
    for row in rows:
        row.update(machine=gpu, commit=ns.commit, copy_tb_s=bw / 1e12, rank=RANK, slots=SLOTS,
                   dtype="bfloat16")  # fmt: skip
        if row["part"] == "align":
            extra = f"agrees {row['agrees_with_vllm']}"
        elif row["part"] == "sum":
            extra = (
                f"ours/floor {row['ours_over_floor']:5.2f} vllm/its floor "
                f"{row['vllm_over_its_floor']:5.2f} err {row['rel_err_vs_fp32']:.1e}"
            )
        else:
            extra = f"ours/floor {row['ours_over_floor']:5.2f} err {row['rel_err_vs_vllm']:.1e}"
        print(f"{row['part']:5s} {row['shape']:18s} T={row['tokens']:6d} vllm "
              f"{row['vllm_us']:8.1f} ours {row['ours_us']:8.1f} x{row['speedup']:5.2f} {extra}",
              flush=True)  # fmt: skip
    print("wrote", append_rows(f"lora_prefill_{gpu_slug(gpu)}", rows, ns.out))


if __name__ == "__main__":
    main()
