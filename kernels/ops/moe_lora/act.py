"""The gate/up LoRA expand fused into SiLU-and-mul: checks and launch (kernel:
`act_kernels`; spec: `reference.expand_silu_and_mul_reference`).

Used by the vLLM plugin (`kernels/vllm/fused_experts.py`): vLLM's fused experts call the
MoE-LoRA op on their gate/up buffer and SiLU-and-mul right after; inside
`op.defer_gate_up_expand()` the op leaves its expand as a `SplitExpand`, and the activation
launches it here, fused.
"""

from __future__ import annotations

import torch
import triton

from loraplex.kernels.ops.moe_lora.act_kernels import moe_lora_expand_silu_and_mul_kernel
from loraplex.kernels.ops.moe_lora.op import SplitExpand

# Launch shape in the sorted form (prefill), not the expand's config: rows per chunk, N tile,
# warps, and pairs per plain program. H200, Qwen3-30B-A3B gate/up at 9,216 to 25,600 tokens:
# 16-row chunks of 128 columns on 4 warps took 152-355 us against 205-499 for programs over all
# six N tiles; none of 21 other shapes, nor a register cap, was faster (docs/kernels.md). With no
# pair on LoRA, plain programs of 32 pairs took 310-338 us at 25,600 tokens, of 64 344-383 us.
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
