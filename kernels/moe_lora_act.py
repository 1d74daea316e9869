"""The gate/up LoRA expand fused into SiLU-and-mul: checks and launch (kernel:
`moe_lora_act_triton`; spec: `moe_lora_reference.expand_silu_and_mul_reference`).

Used by the vLLM plugin (`moe_act_fusion`): vLLM's fused experts call the MoE-LoRA op on their
gate/up buffer and SiLU-and-mul right after; inside `moe_lora_op.defer_gate_up_expand()` the op
leaves its expand as a `SplitExpand`, and the activation launches it here, fused.
"""

from __future__ import annotations

import torch
import triton

from .moe_lora_act_triton import moe_lora_expand_silu_and_mul_kernel
from .moe_lora_op import SplitExpand

# Launch shape in the sorted form (prefill), not the expand's config: rows per LoRA program,
# N tile, N tiles per program, warps, and pairs per plain program. From sweeps on the H200 at
# 16 x 1600 tokens (Qwen3-30B-A3B, 204,800 pairs in blocks of 128; vLLM's silu_and_mul alone
# 217 us). One tile per program: 32 rows x 128 columns on 8 warps took 562 us; 64 rows 627;
# 128 rows 936; 16 rows 715. Several tiles per program (a one-off sweep of 41 shapes at 9,216
# to 25,600 tokens, script not kept): 16 rows over all six 128-column tiles on 4 warps was
# fastest at every size, 1.19-1.26x the one-tile 32-row shape (503 against 635 us at 25,600
# tokens). With no pair on LoRA, the plain programs at 32 pairs took 310-338 us, at 64 pairs
# 344-383 us. Decode (naive form) keeps the expand's config.
SORTED_ROWS = 16
SORTED_BLOCK_N = 128
SORTED_TILES = 6
SORTED_WARPS = 4
PLAIN_ROWS = 32


def fits(expand: SplitExpand, gate_up: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether `expand_silu_and_mul(expand, out)` computes out = SiLU-and-mul(gate_up) with
    the LoRA added: gate_up is the expand's own output, (pairs, 2N), and out is (pairs, N) of
    the same dtype."""
    pairs, n = expand.out2d.shape[0], expand.n
    same = gate_up.data_ptr() == expand.out2d.data_ptr() and gate_up.stride() == (
        expand.out2d.stride()
    )
    return (
        expand.is_gate_up()
        and same
        and tuple(gate_up.shape) == (pairs, 2 * n)
        and tuple(out.shape) == (pairs, n)
        and out.dtype == gate_up.dtype
        and out.device == gate_up.device
    )


def expand_silu_and_mul(expand: SplitExpand, out: torch.Tensor) -> None:
    """out[p, :] = SiLU(gate[p] + dgate[p]) * (up[p] + dup[p]), where gate, up are the two halves
    of the expand's output (read, not written) and dgate, dup its LoRA deltas (zero for pairs
    without LoRA). out: (pairs, N) in the output's dtype. Raises ValueError unless `fits`."""
    gate_up = expand.out2d
    if not fits(expand, gate_up, out):
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must be (pairs, N) = ({gate_up.shape[0]}, "
            f"{expand.n}) {gate_up.dtype} for a gate/up expand into {tuple(gate_up.shape)}"
        )
    config = expand.config
    parts, block_n, warps, tiles = expand.parts, config.block_n, config.num_warps, 1
    if expand.sorted_form:
        parts = max(1, expand.block_m // SORTED_ROWS)
        block_n, warps, tiles = SORTED_BLOCK_N, SORTED_WARPS, SORTED_TILES
    num_pairs = expand.lengths[0]
    groups = triton.cdiv(triton.cdiv(expand.n, block_n), tiles)
    lora_programs = expand.lengths[4] * parts * groups
    grid = (lora_programs + triton.cdiv(num_pairs, PLAIN_ROWS),)
    pdl_kwargs = {"launch_pdl": True} if expand.use_pdl else {}
    moe_lora_expand_silu_and_mul_kernel[grid](
        expand.ws, expand.b0, expand.b1, gate_up, out, *expand.routing, expand.n,
        *expand.lengths, lora_programs, *expand.b0.stride(), *gate_up.stride(), *out.stride(),
        *expand.routing_strides,
        SORTED=expand.sorted_form, BLOCK_M=expand.block_m, LORA_PAD=expand.lora_pad,
        BLOCK_R=expand.block_r, RANK=expand.rank, BLOCK_N=block_n, SPLIT_K=config.split_k,
        WS_ROWS=expand.ws_rows, PARTS=parts, TILES=tiles, PLAIN_ROWS=PLAIN_ROWS,
        USE_PDL=expand.use_pdl, num_warps=warps, num_stages=2, **pdl_kwargs,
    )  # fmt: skip
