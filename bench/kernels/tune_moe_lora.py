"""Tuner: time candidate launch configs of our MoE-LoRA op on this GPU and write the best as JSON.

    python -m bench.kernels.tune_moe_lora [--shapes qwen3-30b-a3b gpt-oss-20b] [--ops w13 w2]
        [--batches 1 4]

For every model shape, call (w13, w2) and batch it builds the call as vLLM 0.26 makes it for
that model (`moe_lora_workload`: GPT-OSS's gate/up in the 3D layout, one slice of 2 x inter
columns; Qwen3's in two slices), times each candidate in CUDA-graph replay, checks the winner
against the first candidate's output, and merges the winners into
`kernels/configs/moe_lora_<gpu>.json` under the key the op looks up for that call
(`kernels/ops/moe_lora/configs.lookup`). Needs a CUDA GPU; torch and triton only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import torch

from bench.kernels.moe_lora_workload import (
    BATCHES,
    SHAPES,
    CallSpec,
    MoeShape,
    make_sets,
    make_weights,
    served_block_m,
    served_naive,
    time_interleaved,
    time_per_call,
)
from loraplex.kernels.dispatch import REGIMES
from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig, ShapeKey, gpu_of, write_configs
from loraplex.kernels.ops.moe_lora.op import fused_moe_lora

# The split variant's fp32 workspace (slices x units x split x rows x rank) must stay modest.
WORKSPACE_MAX_BYTES = 512 * 2**20
# Candidates re-timed against each other before one is kept: those within this factor of the
# fastest first timing, at most FINALISTS of them.
FINALIST_MARGIN = 1.10
FINALISTS = 4
# Columns a GEMV expand program takes. The wide ones for GPT-OSS gate/up (two slices of 2,880
# columns): at 16 tokens 16.07 us over 1,024 columns against 17.40 over 256 (H200, the tuned
# config otherwise); elsewhere within 2%.
GEMV_EXPAND_COLUMNS = (128, 256, 512, 1024)


def candidates(
    k: int, num_pairs: int, slices: int, naive: bool = False, fused_activation: bool = False
) -> list[MoeLoraConfig]:
    """A short list (each candidate costs a compile per shape). Fused: narrow and wide N tiles,
    N split over programs, more warps, both slices in one program; at prefill sizes also narrower
    K tiles and fewer stages (less shared memory, more programs per SM), and expands of half or
    quarter blocks over several N tiles, also under a register cap. Split: 1 to 16 K ranges,
    for a two-slice gate/up a shrink that does both slices at the two smallest splits (also with
    an expand over two N tiles), an expand over two N tiles at the largest split, and expands of
    half blocks at the two smallest splits. In the naive routing form (decode) also the GEMV shrink
    over 2 to 16 K ranges of at least 64, with 4 or 8 warps, and the GEMV expand after it or
    after the tl.dot shrink; in the sorted form at decode sizes also expands of half and
    quarter blocks over 4, 8 and 16 N tiles.

    `fused_activation`: a gate/up call whose activation the plugin fuses with the expand of a
    split config (`fused_experts`). At prefill sizes that fusion saves the activation's own pass,
    far more than any variant gains on the op alone, so fused variants are left out there. H200,
    Qwen3-30B-A3B gate/up with SiLU-and-mul at 8,192, 12,288 and 16,384 tokens: 236.0, 286.8
    and 367.3 us fused against 337.1, 438.7 and 562.7 us with vLLM's SiLU-and-mul after the op,
    while a fused variant tuned at blocks of 64 won the op alone by at most 12 us. At decode
    sizes both kinds stay: beside the base GEMM on a side stream, split and fused configs took
    what they take alone (Qwen3 gate/up at 64 tokens 142.6 us split against 141.4 fused). In
    order on the main stream, as decode runs now, a fused config also gives up the fusion;
    not re-timed (`bench_moe_lora` times the op with the activation).
    """
    out = _all_candidates(k, num_pairs, slices, naive)
    if fused_activation and REGIMES.prefill(num_pairs):
        out = [c for c in out if c.variant != "fused"]
    return out


def _all_candidates(k: int, num_pairs: int, slices: int, naive: bool) -> list[MoeLoraConfig]:
    """`candidates` before the activation's filter."""
    bk = 128 if k >= 256 else 64
    out = [
        MoeLoraConfig("fused", bk, 128),
        MoeLoraConfig("fused", bk, 64),
        MoeLoraConfig("fused", bk, 128, npid=4),
        MoeLoraConfig("fused", bk, 128, num_warps=8),
    ]
    if slices == 2:
        out += [
            MoeLoraConfig("fused", bk, 128, fuse_slices=True),
            MoeLoraConfig("fused", bk, 128, num_warps=8, fuse_slices=True),
        ]
    splits = [s for s in (1, 2, 4, 8, 16) if s * bk <= k]
    if not _workspace_fits(num_pairs, max(splits)):
        splits = [1]
    both = slices == 2
    if REGIMES.prefill(num_pairs):
        out += [
            MoeLoraConfig("fused", 64, 128, fuse_slices=both),
            MoeLoraConfig("fused", 64, 128, num_warps=8, fuse_slices=both),
            MoeLoraConfig("fused", bk, 128, num_stages=2, fuse_slices=both),
            MoeLoraConfig("split", bk, 128, num_warps=8),
            MoeLoraConfig("split", 64, 128, num_stages=2),
            # Half-block expand programs over one to four N tiles: the prefill winners of a
            # sweep of expand variants on the H200 (docs/kernels.md).
            MoeLoraConfig("split", 64, 128, fuse_slices=both, expand_parts=2, expand_tiles=2),
            MoeLoraConfig("split", 64, 128, fuse_slices=both, expand_parts=2, expand_tiles=4),
            MoeLoraConfig("split", 64, 128, fuse_slices=both, expand_parts=2),
            MoeLoraConfig("split", 64, 256, fuse_slices=both, expand_parts=2),
            # Quarter-block programs over 8 or 16 N tiles: the H200's prefill winners for the
            # Qwen3 down projection (447 and 286 us at 16,384 and 9,216 tokens, against 518
            # and 322 for the best fused variant, which then prefetched its next N tile).
            MoeLoraConfig("split", 64, 128, fuse_slices=both, expand_parts=4, expand_tiles=8),
            MoeLoraConfig("split", 64, 128, fuse_slices=both, expand_parts=4, expand_tiles=16),
            # Half blocks over 8 tiles of 128 or 16 of 64 columns: with the expand's tile loop
            # pipelined (moe_lora_expand_kernel), GPT-OSS down at 16 x 1600 tokens took 589 us
            # over 16 tiles of 64 (x1.18 vLLM) where one tile had taken 654.
            MoeLoraConfig("split", bk, 128, fuse_slices=both, expand_parts=2, expand_tiles=8),
            MoeLoraConfig("split", bk, 64, fuse_slices=both, expand_parts=2, expand_tiles=16),
        ]
        # The same expands held to 128 registers (a program of 4 warps at 130-150 fits one more
        # per SM). H200 at 16 x 1600 tokens, before the expand's tile loop was pipelined:
        # GPT-OSS down 654 -> 624 us with half blocks over 16 tiles of 64 columns (x1.06 ->
        # x1.11 vLLM), Qwen3 down 669 -> 657 with quarter blocks (x1.14 -> x1.16). A cap of 112
        # was on par, 96 and 104 slower; 8-warp expands of whole blocks were 1.1-1.6x slower.
        out += [
            MoeLoraConfig("split", block_k, block_n, fuse_slices=both, expand_parts=parts,
                          expand_tiles=16, max_registers=128)
            for block_n, parts in ((128, 4), (64, 2)) for block_k in dict.fromkeys((64, bk))
        ]  # fmt: skip
    for split in splits:
        out += [MoeLoraConfig("split", bk, bn, split_k=split) for bn in (64, 128)]
    out.append(MoeLoraConfig("split", bk, 128, split_k=splits[-1], expand_tiles=2))
    # Sorted decode blocks hold one or two pairs in 32 or more rows: with two row parts the
    # second part's programs leave at once, and the first multiplies half the rows.
    out += [MoeLoraConfig("split", bk, 128, split_k=split, fuse_slices=slices == 2,
                          expand_parts=2, expand_tiles=tiles)
            for split in splits[:2] for tiles in (1, 2)]  # fmt: skip
    if slices == 2:  # gate and up from one gather of x: at prefill x is a third of the bytes
        out += [MoeLoraConfig("split", bk, bn, split_k=split, fuse_slices=True)
                for split in splits[:2] for bn in (64, 128)]  # fmt: skip
        # Half as many expand programs, each over two N tiles: GPT-OSS gate/up in two slices at
        # 64 tokens (blocks of one or two pairs, 23 N tiles per slice) launched ~7,800 one-tile
        # programs.
        out += [MoeLoraConfig("split", bk, 128, split_k=split, fuse_slices=True, expand_tiles=2)
                for split in splits[:2]]  # fmt: skip
    if naive:
        gemv_splits = [s for s in (2, 4, 8, 16) if k >= 64 * s and _workspace_fits(num_pairs, s)]
        out += [MoeLoraConfig("split", bk, 128, split_k=split, num_warps=warps, gemv_shrink=True)
                for split in gemv_splits for warps in (4, 8)]  # fmt: skip
        # The GEMV expand after either shrink: one row a program, not tl.dot's 16.
        out += [MoeLoraConfig("split", bk, bn, split_k=split, gemv_expand=True)
                for split in splits for bn in GEMV_EXPAND_COLUMNS]  # fmt: skip
        # The same after a tl.dot shrink of two stages (less shared memory a program, more
        # programs an SM) over one or two K ranges. H200, the tuned naive configs with only the
        # stages changed, two interleaved runs: GPT-OSS gate/up in two slices at 64 tokens 42.6
        # us against 44.3 with three; at the other 25 naive points three stages won or tied
        # (within 1%).
        out += [MoeLoraConfig("split", bk, bn, split_k=split, num_stages=2, gemv_expand=True)
                for split in splits[:2] for bn in GEMV_EXPAND_COLUMNS]  # fmt: skip
        if slices == 2:
            out += [MoeLoraConfig("split", bk, 128, split_k=split, fuse_slices=True,
                                  gemv_expand=True) for split in splits[:2]]  # fmt: skip
        out += [MoeLoraConfig("split", bk, bn, split_k=split, gemv_shrink=True, gemv_expand=True)
                for split in gemv_splits[:3] for bn in GEMV_EXPAND_COLUMNS]  # fmt: skip
    elif not REGIMES.prefill(num_pairs):
        # Sorted decode blocks hold a few pairs in 16 to 64 rows: expands over more N tiles
        # each, of half or quarter blocks. H200, GPT-OSS gate/up in two slices at 256 tokens in
        # blocks of 64 (the default reference align, not vLLM's): 4 tiles of half blocks 74.6 us
        # against 90.7 for 2 tiles.
        out += [MoeLoraConfig("split", bk, 128, split_k=split, fuse_slices=slices == 2,
                              expand_parts=parts, expand_tiles=tiles)
                for split in splits[:2] for parts in (2, 4) for tiles in (4, 8, 16)]  # fmt: skip
    return list(dict.fromkeys(out))


def fuses_activation(shape: MoeShape, op: str) -> bool:
    """Whether the plugin fuses this call's expand into the activation after it (split
    configs of the gate/up call, `fused_experts`): SiLU-and-mul after two slices (the 2D
    layout), swigluoai after one interleaved slice (the 3D layout)."""
    fused = {("silu", False), ("swigluoai", True)}
    return op == "w13" and (shape.activation, shape.lora_3d) in fused


def _workspace_fits(num_pairs: int, split: int) -> bool:
    """Whether the split variant's workspace at rank 32 and 2 slices stays modest."""
    return num_pairs * 32 * 2 * 4 * split <= WORKSPACE_MAX_BYTES


def shape_key(
    shape: MoeShape, spec: CallSpec, rank: int, sorted_form: bool, dtype: str
) -> ShapeKey:
    return ShapeKey(
        spec.k, spec.n, spec.slices, rank, shape.experts, shape.top_k, sorted_form, dtype
    )


def tune_point(
    sets: list[dict], configs: list[MoeLoraConfig], block_m: int
) -> tuple[MoeLoraConfig, dict[MoeLoraConfig, float]]:
    """Time every config on the same sets; return the fastest that agrees with the first (the
    close ones timed again, interleaved)."""
    timings: dict[MoeLoraConfig, float] = {}
    outputs = [s["output"].clone() for s in sets]

    def call(cfg: MoeLoraConfig, s: dict) -> None:
        fused_moe_lora(**s, shrink_block_size_m=block_m, config=cfg)

    expected = None
    for cfg in configs:
        for s, o in zip(sets, outputs, strict=True):
            s["output"].copy_(o)
        call(cfg, sets[0])
        got = sets[0]["output"].float()
        if expected is None:
            expected = got.clone()
        err = float((got - expected).norm() / (expected - outputs[0].float()).norm())
        if not err < 2e-2:
            raise AssertionError(f"config {cfg} disagrees with {configs[0]}: rel err {err:.2e}")
        timings[cfg] = time_per_call([functools.partial(call, cfg, s) for s in sets], 5, 3)
    # One short timing per candidate is noisy: a finalist within FINALIST_MARGIN of the fastest
    # could have won as well, so the finalists run again, interleaved, and the medians decide.
    fastest = min(timings.values())
    finalists = sorted(
        (c for c in timings if timings[c] <= fastest * FINALIST_MARGIN), key=timings.__getitem__
    )[:FINALISTS]
    if len(finalists) > 1:
        calls = [[functools.partial(call, c, s) for s in sets] for c in finalists]
        timings.update(zip(finalists, time_interleaved(calls, 5, 7), strict=True))
    best = min(finalists, key=timings.__getitem__)
    return best, timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--ops", nargs="+", choices=["w13", "w2"], default=["w13", "w2"],
                        help="the calls to tune: gate/up (w13) and down (w2)")  # fmt: skip
    parser.add_argument("--batches", nargs="+", type=int, default=list(BATCHES))
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gpu = gpu_of(torch.cuda.get_device_properties(0))
    tuned: dict[str, dict[int, MoeLoraConfig]] = {}
    for name in args.shapes:
        shape = SHAPES[name]
        for op in args.ops:
            spec = CallSpec.of(shape, op)
            weights = make_weights(shape, spec, args.adapters, args.rank, dtype, "cuda")
            for tokens in args.batches:
                block_m = served_block_m(shape, tokens, args.adapters)
                sorted_form = not served_naive(shape, tokens, args.adapters)
                sets = [s for s, _ in make_sets(shape, spec, tokens, args.adapters, weights,
                                                block_m, dtype, "cuda",
                                                naive=not sorted_form)]  # fmt: skip
                num_pairs = tokens * shape.top_k
                cands = candidates(spec.k, num_pairs, spec.slices, naive=not sorted_form,
                                   fused_activation=fuses_activation(shape, op))  # fmt: skip
                best, timings = tune_point(sets, cands, block_m)
                key = shape_key(shape, spec, args.rank, sorted_form, str(dtype)).text()
                tuned.setdefault(key, {})[num_pairs] = (
                    dataclasses.replace(best, tuned_block_m=block_m) if sorted_form else best
                )
                worst = max(timings.values())
                print(f"{name:14s} {op:3s} T={tokens:6d} best {timings[best]:8.1f} us "
                      f"(worst {worst:8.1f}) {best}", flush=True)  # fmt: skip
            del weights
            torch.cuda.empty_cache()
    print("wrote", write_configs(gpu, tuned))


if __name__ == "__main__":
    main()
