"""The gate/up LoRA expand fused into the activation: checks and launch (kernel:
`act_kernels`; spec: `reference.expand_silu_and_mul_reference` and
`reference.expand_swigluoai_and_mul_reference`).

Used by the vLLM plugin (`kernels/vllm/fused_experts.py`): vLLM's fused experts call the
MoE-LoRA op on their gate/up buffer and the activation right after; inside
`op.defer_gate_up_expand()` the op leaves its expand as a `SplitExpand`, and the activation
launches it here, fused: SiLU-and-mul for a call of two slices side by side (Qwen3),
swigluoai for one slice with gate and up interleaved (GPT-OSS).
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
SORTED_CHUNK = 16
SORTED_BLOCK_N = 128
SORTED_WARPS = 4
PLAIN_ROWS = 32
# Decode (naive form: one pair per unit) keeps the expand's warps and N tile, but at most this
# many columns a warp: the tile was tuned for the GEMV expand, whose program holds one B tile;
# this one holds two. ptxas for sm_90 (Triton 3.9) at 4 warps: swigluoai's program takes 229
# registers at 64 columns and spills nothing, 255 with 28 bytes spilled at 128, 7.2 KB of stack
# and ~19 KB of spill stores at GPT-OSS's tuned 1,024. GPT-OSS decode on an H100: 173.70 ->
# 180.81 tok/s per request (docs/kernels.md, "The activation's N tile at decode").
NAIVE_COLUMNS_PER_WARP = 16

# vLLM's swigluoai_and_mul takes alpha and limit as arguments with these defaults (its op
# schema), and vLLM 0.26's fused experts call it without them (fused_moe/activation.py,
# apply_moe_activation), whatever the quant config holds: GPT-OSS runs on these.
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def fits(expand: SplitExpand, gate_up: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the fused activation of the expand's layout (`expand_silu_and_mul` for two
    slices, `expand_swigluoai_and_mul` for one) computes out = act(gate_up) with the LoRA
    added: gate_up is the expand's own output, (pairs, 2I), and out is (pairs, I) of the same
    dtype, I = N for two slices of N columns and N / 2 for one."""
    pairs, width = expand.out2d.shape
    same = gate_up.data_ptr() == expand.out2d.data_ptr() and gate_up.stride() == (
        expand.out2d.stride()
    )
    return (
        expand.is_gate_up()
        and same
        and tuple(gate_up.shape) == (pairs, width)
        and tuple(out.shape) == (pairs, width // 2)
        and out.dtype == gate_up.dtype
        and out.device == gate_up.device
    )


def expand_silu_and_mul(expand: SplitExpand, out: torch.Tensor) -> None:
    """out[p, :] = SiLU(gate[p] + dgate[p]) * (up[p] + dup[p]), where gate, up are the two halves
    of the expand's output (read, not written) and dgate, dup its LoRA deltas (zero for pairs
    without LoRA). out: (pairs, N) in the output's dtype. Raises ValueError unless `fits` and
    the call has two slices."""
    _check(expand, out, slices=2)
    _launch(expand, out, swigluoai=False, alpha=0.0, limit=0.0)


def expand_swigluoai_and_mul(
    expand: SplitExpand, out: torch.Tensor, alpha: float = SWIGLUOAI_ALPHA,
    limit: float = SWIGLUOAI_LIMIT,
) -> None:  # fmt: skip
    """out[p, j] = swigluoai(gate_up[p, 2j] + d[p, 2j], gate_up[p, 2j + 1] + d[p, 2j + 1]) as
    vLLM's swigluoai_and_mul computes it (gate clamped to <= limit, up to [-limit, limit],
    gate * sigmoid(alpha * gate) * (up + 1)), where gate_up is the expand's output of one slice
    of 2I columns (read, not written) and d its LoRA delta (zero for pairs without LoRA).
    out: (pairs, I) in the output's dtype. Raises ValueError unless `fits` and the call has one
    slice."""
    _check(expand, out, slices=1)
    _launch(expand, out, swigluoai=True, alpha=alpha, limit=limit)


def _check(expand: SplitExpand, out: torch.Tensor, slices: int) -> None:
    gate_up = expand.out2d
    if expand.slices() != slices or not fits(expand, gate_up, out):
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must be (pairs, I) = ({gate_up.shape[0]}, "
            f"{gate_up.shape[1] // 2}) {gate_up.dtype} for a gate/up expand of {slices} "
            f"slice(s) into {tuple(gate_up.shape)}, got {expand.slices()} slice(s)"
        )


def _launch(
    expand: SplitExpand, out: torch.Tensor, swigluoai: bool, alpha: float, limit: float
) -> None:
    gate_up = expand.out2d
    n = gate_up.shape[1] // 2  # columns of gate (and of up) per pair
    config = expand.config
    block_n, warps = SORTED_BLOCK_N, SORTED_WARPS
    if not expand.sorted_form:
        warps = config.num_warps
        block_n = min(config.block_n, NAIVE_COLUMNS_PER_WARP * warps)
    num_pairs = expand.lengths[0]
    lora_programs = expand.lengths[4] * triton.cdiv(n, block_n)
    grid = (lora_programs + triton.cdiv(num_pairs, PLAIN_ROWS),)
    use_pdl = expand.pdl_here()
    pdl_kwargs = {"launch_pdl": True} if use_pdl else {}
    moe_lora_expand_silu_and_mul_kernel[grid](
        expand.ws, expand.b0, expand.b1, gate_up, out, *expand.routing, n, *expand.lengths,
        lora_programs, alpha, limit, *expand.b0.stride(), *gate_up.stride(), *out.stride(),
        *expand.routing_strides,
        SORTED=expand.sorted_form, BLOCK_M=expand.block_m, LORA_PAD=expand.lora_pad,
        BLOCK_R=expand.block_r, RANK=expand.rank, BLOCK_N=block_n, SPLIT_K=config.split_k,
        WS_ROWS=expand.ws_rows, CHUNK=min(SORTED_CHUNK, expand.block_m), PLAIN_ROWS=PLAIN_ROWS,
        USE_PDL=use_pdl, SWIGLUOAI=swigluoai, num_warps=warps, num_stages=2, **pdl_kwargs,
    )  # fmt: skip
