"""The gate/up LoRA expand fused into SiLU-and-mul: checks and launch (kernel:
`moe_lora_act_triton`; spec: `moe_lora_reference.expand_silu_and_mul_reference`).

Used by the vLLM plugin (`moe_act_fusion`): vLLM's fused experts call the MoE-LoRA op on their
gate/up buffer and SiLU-and-mul right after; inside `moe_lora_op.defer_gate_up_expand()` the op
leaves its expand as a `SplitExpand`, and the activation launches it here, fused.
"""

from __future__ import annotations

import torch
import triton

from loraplex.kernels.moe_lora_act_triton import moe_lora_expand_silu_and_mul_kernel
from loraplex.kernels.moe_lora_op import SplitExpand

# Launch shape in the sorted form (prefill), not the expand's config: rows per chunk, N tile,
# warps, and pairs per plain program. On the H200 (Qwen3-30B-A3B gate/up, 8 rank-32 slots in
# vLLM's blocks of 128; vLLM's silu_and_mul alone 81, 140, 217 us at 9,216, 16,384 and 25,600
# tokens), programs of one unit and N tile that chunk its rows took 152, 240 and 355 us with
# 16-row chunks of 128 columns on 4 warps, against 205, 333 and 499 us for the earlier programs
# of 16 rows over all six N tiles, each reading all of B. Of 21 other shapes none was faster
# (times relative to it): 32-row chunks 1.2-1.6x, 64 rows 1.8-2.7x, 128 rows 3.3-3.9x; 32, 64
# or 256 columns 1.42x, 1.01-1.07x, 1.09-1.15x; 2 warps 1.25-1.33x; 8 warps, 1 or 3 stages
# within 0.3%; without the next chunk's prefetch 1.04-1.06x (a one-off sweep, not kept: its
# rows are in commit a2a717e's message). A cap on registers (maxnreg) for more programs per SM
# did not help: at 4 warps 96, 128, 80 and 64 took 1.02, 1.06, 1.12 and 1.41x; 8 warps with no
# cap, 64 and 48 took 1.07, 1.07 and 1.31x (H200, 2026-11-23, all bit-identical; rows in the
# message of the commit that added this sentence). With no pair on LoRA, the plain programs
# at 32 pairs took 310-338 us at 25,600 tokens, at 64 pairs 344-383 us.
# Decode (naive form: one pair per unit) keeps the expand's N tile and warps.
SORTED_CHUNK = 16
SORTED_BLOCK_N = 128
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
    block_n, warps = config.block_n, config.num_warps
    if expand.sorted_form:
        block_n, warps = SORTED_BLOCK_N, SORTED_WARPS
    num_pairs = expand.lengths[0]
    lora_programs = expand.lengths[4] * triton.cdiv(expand.n, block_n)
    grid = (lora_programs + triton.cdiv(num_pairs, PLAIN_ROWS),)
    use_pdl = expand.pdl_here()
    pdl_kwargs = {"launch_pdl": True} if use_pdl else {}
    moe_lora_expand_silu_and_mul_kernel[grid](
        expand.ws, expand.b0, expand.b1, gate_up, out, *expand.routing, expand.n,
        *expand.lengths, lora_programs, *expand.b0.stride(), *gate_up.stride(), *out.stride(),
        *expand.routing_strides,
        SORTED=expand.sorted_form, BLOCK_M=expand.block_m, LORA_PAD=expand.lora_pad,
        BLOCK_R=expand.block_r, RANK=expand.rank, BLOCK_N=block_n, SPLIT_K=config.split_k,
        WS_ROWS=expand.ws_rows, CHUNK=min(SORTED_CHUNK, expand.block_m), PLAIN_ROWS=PLAIN_ROWS,
        USE_PDL=use_pdl, num_warps=warps, num_stages=2, **pdl_kwargs,
    )  # fmt: skip
