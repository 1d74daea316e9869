"""Where the MoE-LoRA op's decode time goes, beside what merely reading its bytes costs.

    PYTHONPATH=/tmp/site:. python3 bench/kernels/bench_decode_anatomy.py --commit SHA --out DIR

At the kernel bench's decode points (1, 4, 16, 64 and 256 tokens) of both model shapes (rank 32,
8 adapters, bf16), each call in the layout vLLM serves the model with (GPT-OSS's gate/up one
slice of 2 x inter columns, Qwen3's two slices) and in the routing form the plugin serves it
(`served_naive`, `served_block_m`), in one interleaved CUDA-graph replay per point over the
kernel bench's cold sets (`moe_lora_workload`):

- ours: the op with its tuned config; where that is a split config of a two-slice gate/up call
  (the op defers only that expand) also its shrink alone (expand deferred and dropped) and its
  expand launched without PDL;
- in the naive form, the tuner's candidates with a GEMV kernel (`label` names them: shrink, K
  ranges, warps, and the GEMV expand's columns), and for a two-slice gate/up with the GEMV
  shrink that shrink alone;
- read_only: one Triton kernel (under PDL, as ours) that only reads the A and B bytes of every
  routed pair, 16 programs per pair and slice, each loading its chunk at once: the bytes the
  naive form reads, a (slot, expert) routed twice read twice;
- read_distinct: the same kernel over each distinct (slot, expert) once: the floor's bytes;
- empty: one PDL launch of as many programs as read_only's that store a word each;
- copy_floor: a torch device copy moving the floor's bytes (half read, half written).

The floor is the adapter bytes over the copy rate of a 2 GiB copy, as in bench_moe_lora. Rows
(machine, commit, config, layout, form) go to DIR/decode_anatomy_<gpu>.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.common import append_rows
from bench.kernels.moe_lora_workload import (
    SHAPES,
    CallSpec,
    copy_bandwidth,
    distinct_slot_experts,
    make_sets,
    make_weights,
    served_block_m,
    served_naive,
    time_interleaved,
)
from bench.kernels.tune_moe_lora import candidates, shape_key
from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig, gpu_of, gpu_slug, lookup
from loraplex.kernels.ops.moe_lora.op import defer_gate_up_expand, fused_moe_lora

READ_CHUNKS = 16  # chunks per (pair, slice) of the read-only kernel: 8 was 1.7x slower on GPT-OSS


@triton.jit
def read_only_kernel(a0, a1, b0, b1, tlm_ptr, eids_ptr, out_ptr, top_k, K, N, stride_al,
                     stride_ae, stride_bl, stride_be, RANK: tl.constexpr, CHUNKS: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Sums chunk c of A[s][slot, expert] and of B[s][slot, expert] for pair p (A rows of K,
    B rows of RANK, both contiguous), so that every byte the op must read is read once."""
    p = tl.program_id(0)
    s = tl.program_id(1)
    c = tl.program_id(2)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(tlm_ptr + p // top_k).to(tl.int64)
    expert = tl.load(eids_ptr + p).to(tl.int64)
    a_base = a0
    b_base = b0
    if s == 1:
        a_base = a1
        b_base = b1
    offs_r = tl.arange(0, RANK)
    offs_k = c * BLOCK_K + tl.arange(0, BLOCK_K)
    a_ptrs = a_base + slot * stride_al + expert * stride_ae + offs_r[:, None] * K + offs_k[None, :]
    a = tl.load(a_ptrs, mask=offs_k[None, :] < K, other=0.0)
    offs_n = c * BLOCK_N + tl.arange(0, BLOCK_N)
    b_ptrs = (
        b_base + slot * stride_bl + expert * stride_be + offs_n[:, None] * RANK + offs_r[None, :]
    )
    b = tl.load(b_ptrs, mask=offs_n[:, None] < N, other=0.0)
    total = tl.sum(tl.sum(a.to(tl.float32), 1), 0) + tl.sum(tl.sum(b.to(tl.float32), 1), 0)
    tl.store(out_ptr + (p * 2 + s) * CHUNKS + c, total)


@triton.jit
def empty_kernel(out_ptr):
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + tl.program_id(0), 1.0)


def read_only(args: dict, out: torch.Tensor) -> None:
    a, b = args["lora_a_stacked"], args["lora_b_stacked"]
    rank, k, n = a[0].shape[2], a[0].shape[3], b[0].shape[2]
    read_only_kernel[(args["expert_ids"].numel(), len(a), READ_CHUNKS)](
        a[0], a[-1], b[0], b[-1], args["token_lora_mapping"], args["expert_ids"], out,
        args["top_k_num"], k, n, a[0].stride(0), a[0].stride(1), b[0].stride(0), b[0].stride(1),
        RANK=rank, CHUNKS=READ_CHUNKS, BLOCK_K=triton.next_power_of_2(triton.cdiv(k, READ_CHUNKS)),
        BLOCK_N=triton.next_power_of_2(triton.cdiv(n, READ_CHUNKS)), num_warps=8, launch_pdl=True,
    )  # fmt: skip


def distinct_pairs(args: dict) -> dict:
    """Naive-form `args` routing each distinct (slot, expert) of `args` once (top-k 1): what
    `read_only` reads of them is the floor's bytes (`floor_bytes`' pairs)."""
    experts = args["lora_a_stacked"][0].shape[1]
    keys = distinct_slot_experts(args["token_lora_mapping"], args["expert_ids"],
                                 args["top_k_num"], experts)  # fmt: skip
    return dict(args, token_lora_mapping=(keys // experts).to(torch.int32),
                expert_ids=(keys % experts).to(torch.int32), top_k_num=1)  # fmt: skip


def op(args: dict, config: MoeLoraConfig, block_m: int | None) -> None:
    """Our op on one set: the sorted form in blocks of block_m, or the naive form where None."""
    fused_moe_lora(**args, shrink_block_size_m=block_m or 16, config=config)


def shrink_only(args: dict, config: MoeLoraConfig, block_m: int | None) -> None:
    with defer_gate_up_expand():
        op(args, config, block_m)


def expand_without_pdl(args: dict, config: MoeLoraConfig, block_m: int | None) -> None:
    with defer_gate_up_expand() as deferred:
        op(args, config, block_m)
    dataclasses.replace(deferred[0], pdl_stream=None).launch()


def copy(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def label(cfg: MoeLoraConfig) -> str:
    """gemv_s4_w8 (GEMV shrink over 4 K ranges, 8 warps, tl.dot expand), dot_s2_fs_w4+gemv128
    (tl.dot shrink over 2 ranges, both slices a program, GEMV expand over 128 columns), ..."""
    shrink = "gemv" if cfg.gemv_shrink else "dot"
    slices = "_fs" if cfg.fuse_slices else ""
    expand = f"+gemv{cfg.block_n}" if cfg.gemv_expand else ""
    return f"{shrink}_s{cfg.split_k}{slices}_w{cfg.num_warps}{expand}"


def variants(sets: list[dict], reads: list[dict], spec: CallSpec, config: MoeLoraConfig,
             block_m: int | None, nbytes: int,
             out: torch.Tensor) -> dict[str, list[Callable[[], None]]]:  # fmt: skip
    """The timed calls of one point: ours in `sets` (the sorted form in blocks of `block_m`, or
    the naive form where it is None), the reads over `reads` (the same routing, naive form)."""

    def each(fn: Callable, *extra: object, over: list[dict] = sets) -> list[Callable[[], None]]:
        return [functools.partial(fn, a, *extra) for a in over]

    found = {"ours": each(op, config, block_m)}
    if spec.slices == 2 and config.variant == "split":  # a fused launch has no expand to defer
        found |= {"ours_shrink": each(shrink_only, config, block_m),
                  "ours_expand_no_pdl": each(expand_without_pdl, config, block_m)}  # fmt: skip
    pairs = reads[0]["expert_ids"].numel()
    if block_m is None:
        for cfg in candidates(spec.k, pairs, spec.slices, naive=True):
            if cfg.gemv_shrink or cfg.gemv_expand:
                found[label(cfg)] = each(op, cfg, None)
                if spec.slices == 2 and cfg.gemv_shrink and not cfg.gemv_expand:
                    found[label(cfg) + "_shrink"] = each(shrink_only, cfg, None)
    programs = pairs * spec.slices * READ_CHUNKS
    src = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in sets]
    dst = [torch.empty_like(t) for t in src]
    found["read_only"] = each(read_only, out, over=reads)
    found["read_distinct"] = each(read_only, out, over=[distinct_pairs(a) for a in reads])
    found["empty"] = [functools.partial(empty_kernel[(programs,)], out, launch_pdl=True)] * len(
        sets
    )
    found["copy_floor"] = [functools.partial(copy, s, d) for s, d in zip(src, dst, strict=True)]
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--commit", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ns = parser.parse_args()
    gpu = gpu_of(torch.cuda.get_device_properties(0))
    bw = copy_bandwidth()
    out = torch.empty(1 << 20, device="cuda")
    rows = []
    for shape in SHAPES.values():
        for op in ("w13", "w2"):
            spec = CallSpec.of(shape, op)
            weights = make_weights(shape, spec, 8, 32, torch.bfloat16, "cuda")
            for tokens in ns.batches:
                naive = served_naive(shape, tokens, 8)
                block_m = None if naive else served_block_m(shape, tokens, 8)
                made = make_sets(shape, spec, tokens, 8, weights, block_m or 16, torch.bfloat16,
                                 "cuda", naive=naive)  # fmt: skip
                sets, nbytes = [s for s, _ in made], made[0][1]
                reads = sets if naive else [
                    s for s, _ in make_sets(shape, spec, tokens, 8, weights, 16, torch.bfloat16,
                                            "cuda", naive=True)
                ]  # fmt: skip
                pairs = tokens * shape.top_k
                key = shape_key(shape, spec, 32, not naive, str(torch.bfloat16))
                config = lookup(gpu, key, pairs, block_m)
                timed = variants(sets, reads, spec, config, block_m, nbytes, out)
                times = dict(zip(timed, time_interleaved(list(timed.values())), strict=True))
                floor = sum(b for _, b in made) / len(made) / bw * 1e6
                form = "naive" if naive else f"sorted {block_m}"
                rows.append({"shape": shape.name, "layout": shape.layout, "op": op,
                             "tokens": tokens, "form": form,
                             "floor_us": floor, "us": times, "machine": gpu.name,
                             "commit": ns.commit, "copy_tb_s": bw / 1e12,
                             "config": config.to_json()})  # fmt: skip
                print(f"{shape.name:14s} {op:3s} M={tokens:3d} {form:9s} floor {floor:6.2f} "
                      f"ours {times['ours']:6.2f} ({times['ours'] / floor:.2f}x) "
                      f"read_only {times['read_only']:6.2f} "
                      f"read_distinct {times['read_distinct']:6.2f} "
                      f"({times['read_distinct'] / floor:.2f}x) "
                      f"copy_floor {times['copy_floor']:6.2f} empty {times['empty']:4.2f}",
                      flush=True)  # fmt: skip
                print("   ", " ".join(f"{n}={t:.2f}" for n, t in times.items()), flush=True)
    print("wrote", append_rows(f"decode_anatomy_{gpu_slug(gpu.name)}", rows, ns.out))


if __name__ == "__main__":
    main()
