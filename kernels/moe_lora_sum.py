"""vLLM's moe_sum with the down LoRA's delta added, in two passes (spec: both together,
`moe_lora_reference.moe_sum_with_delta_reference`).

When the down LoRA runs beside the base down GEMM (`moe_lora_side_stream`) it writes its delta
into a (T, k, H) buffer of its own rather than adding into the GEMM's output:
- `sum_delta`, on the side stream after the LoRA, sums each token's k delta rows into a (T, H)
  float32 buffer: 0 for tokens not on an active adapter slot, whose rows the op did not write
  (they hold garbage);
- `moe_sum_with_delta`, on the main stream in place of vLLM's moe_sum, sums each token's k
  expert outputs and its summed delta, in float32, rounded once to the output's dtype.
The main stream thus reads k + 2 bf16 rows' worth per token instead of 2k (k = 8 for
Qwen3-30B-A3B: 22 bytes per column against 34 for one pass over both (T, k, H) buffers; vLLM's
moe_sum alone reads and writes 18); the side pass reads the delta while the main stream runs
the base down GEMM, which is bound by its math, not by memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .moe_lora_triton import _active_slots

# Tokens x columns per program: 4 x 512 bf16 is 16 bytes per thread per load on 4 warps.
BLOCK_TOKENS = 4
BLOCK_COLS = 512


@triton.jit
def _tile(num_tokens, hidden, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """This program's token rows (int64, as a column), columns (as a row) and their mask."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (rows < num_tokens)[:, None] & (cols < hidden)[None, :]
    return rows, rows.to(tl.int64)[:, None], cols[None, :], mask


@triton.jit(do_not_specialize=["num_tokens"])
def moe_delta_sum_kernel(
    delta_ptr,
    sum_ptr,
    tlm_ptr,
    enabled_ptr,
    num_tokens,
    hidden,
    max_loras,
    stride_dt,
    stride_dk,
    stride_st,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows, rows64, cols, mask = _tile(num_tokens, hidden, BLOCK_T, BLOCK_H)
    slots = tl.load(tlm_ptr + rows, mask=rows < num_tokens, other=-1)
    _, on = _active_slots(slots, enabled_ptr, max_loras)
    delta = delta_ptr + rows64 * stride_dt + cols
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(delta + k * stride_dk, mask=mask & on[:, None], other=0.0).to(tl.float32)
    tl.store(sum_ptr + rows64 * stride_st + cols, acc, mask=mask)


@triton.jit(do_not_specialize=["num_tokens"])
def moe_sum_with_delta_kernel(
    experts_ptr,
    sum_ptr,
    out_ptr,
    num_tokens,
    hidden,
    stride_et,
    stride_ek,
    stride_st,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    _, rows64, cols, mask = _tile(num_tokens, hidden, BLOCK_T, BLOCK_H)
    acc = tl.load(sum_ptr + rows64 * stride_st + cols, mask=mask, other=0.0)
    experts = experts_ptr + rows64 * stride_et + cols
    for k in tl.static_range(TOP_K):
        acc += tl.load(experts + k * stride_ek, mask=mask, other=0.0).to(tl.float32)
    out = out_ptr + rows64 * stride_ot + cols
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _grid(tokens: int, hidden: int) -> tuple[int, int]:
    return triton.cdiv(tokens, BLOCK_TOKENS), triton.cdiv(hidden, BLOCK_COLS)


def sum_delta(
    delta: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    adapter_enabled: torch.Tensor,
    max_loras: int,
    out: torch.Tensor,
) -> None:
    """out[t] = sum_k delta[t, k] if token t is on an active slot, else 0.

    delta: (T, k, H), rows contiguous; out: (T, H) float32, rows contiguous;
    token_lora_mapping: (>= T,) slot per token; adapter_enabled: (> max_loras,).
    """
    tokens, top_k, hidden = delta.shape
    if out.shape != (tokens, hidden) or out.dtype != torch.float32:
        raise ValueError(
            f"out {tuple(out.shape)} {out.dtype} must be (tokens, hidden) = ({tokens}, "
            f"{hidden}) float32"
        )
    if delta.stride(2) != 1 or out.stride(1) != 1:
        raise ValueError("delta and out need contiguous rows (last stride 1)")
    if token_lora_mapping.numel() < tokens:
        raise ValueError(
            f"token_lora_mapping has {token_lora_mapping.numel()} entries, fewer than the "
            f"{tokens} tokens"
        )
    if tokens == 0:
        return
    moe_delta_sum_kernel[_grid(tokens, hidden)](
        delta, out, token_lora_mapping, adapter_enabled, tokens, hidden, max_loras,
        delta.stride(0), delta.stride(1), out.stride(0),
        TOP_K=top_k, BLOCK_T=BLOCK_TOKENS, BLOCK_H=BLOCK_COLS, num_warps=4,
    )  # fmt: skip


def moe_sum_with_delta(
    experts_out: torch.Tensor, delta_sum: torch.Tensor, output: torch.Tensor
) -> None:
    """output[t] = sum_k experts_out[t, k] + delta_sum[t], summed in float32.

    experts_out: (T, k, H), rows contiguous; delta_sum: (T, H) float32 (`sum_delta`'s out);
    output: (T, H) of experts_out's dtype.
    """
    tokens, top_k, hidden = experts_out.shape
    if delta_sum.shape != (tokens, hidden) or delta_sum.dtype != torch.float32:
        raise ValueError(
            f"delta_sum {tuple(delta_sum.shape)} {delta_sum.dtype} must be (tokens, hidden) = "
            f"({tokens}, {hidden}) float32"
        )
    if output.shape != (tokens, hidden) or output.dtype != experts_out.dtype:
        raise ValueError(
            f"output {tuple(output.shape)} {output.dtype} must be (tokens, hidden) = "
            f"({tokens}, {hidden}) {experts_out.dtype}"
        )
    if experts_out.stride(2) != 1 or delta_sum.stride(1) != 1 or output.stride(1) != 1:
        raise ValueError("experts_out, delta_sum and output need contiguous rows (last stride 1)")
    if tokens == 0:
        return
    moe_sum_with_delta_kernel[_grid(tokens, hidden)](
        experts_out, delta_sum, output, tokens, hidden, experts_out.stride(0),
        experts_out.stride(1), delta_sum.stride(0), output.stride(0),
        TOP_K=top_k, BLOCK_T=BLOCK_TOKENS, BLOCK_H=BLOCK_COLS, num_warps=4,
    )  # fmt: skip
