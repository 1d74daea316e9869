"""vLLM's moe_sum with the down LoRA's delta added in the same pass (spec:
`moe_lora_reference.moe_sum_with_delta_reference`).

When the down LoRA runs beside the base down GEMM (`moe_lora_side_stream`) it writes its delta
into a buffer of its own rather than adding into the GEMM's output. This kernel then reads both
buffers once: out[t] = sum over the token's k experts of (experts_out + delta), the delta only
for tokens on an active adapter slot, whose pairs the op wrote (other rows hold garbage).
Sums run in float32 and round once to the output's dtype.

One pass on the main stream, not two: summing the deltas per token on the side stream first
(88ff7aa) left the main stream a pass of 170.2 us at 16,384 tokens (H200; this kernel took
261.6 us in the bench run at 5883637), but the side pass (159.7 us) slowed the base down GEMM
beside it more; the e2e prefill took 0.4353 and 0.4348 s against 0.4279 and 0.4320 s in an
interleaved A/B on one machine (rows in bench/e2e/results and bench/kernels/results).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraplex.kernels.moe_lora_triton import _active_slots

# Tokens x columns per program: 4 x 512 bf16 is 16 bytes per thread per load on 4 warps.
BLOCK_TOKENS = 4
BLOCK_COLS = 512


@triton.jit(do_not_specialize=["num_tokens"])
def moe_sum_with_delta_kernel(
    experts_ptr,
    delta_ptr,
    out_ptr,
    tlm_ptr,
    enabled_ptr,
    num_tokens,
    hidden,
    max_loras,
    stride_et,
    stride_ek,
    stride_dt,
    stride_dk,
    stride_ot,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_rows = rows < num_tokens
    mask = in_rows[:, None] & (cols < hidden)[None, :]
    _, on = _active_slots(tl.load(tlm_ptr + rows, mask=in_rows, other=-1), enabled_ptr, max_loras)
    delta_mask = mask & on[:, None]
    rows64 = rows.to(tl.int64)[:, None]
    experts = experts_ptr + rows64 * stride_et + cols[None, :]
    delta = delta_ptr + rows64 * stride_dt + cols[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(experts + k * stride_ek, mask=mask, other=0.0).to(tl.float32)
        acc += tl.load(delta + k * stride_dk, mask=delta_mask, other=0.0).to(tl.float32)
    out = out_ptr + rows64 * stride_ot + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_sum_with_delta(
    experts_out: torch.Tensor,
    delta: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    adapter_enabled: torch.Tensor,
    max_loras: int,
    output: torch.Tensor,
) -> None:
    """output[t] = sum_k experts_out[t, k] + (delta[t, k] if token t is on an active slot).

    experts_out, delta: (T, k, H) of one dtype, rows contiguous; output: (T, H) of that dtype;
    token_lora_mapping: (>= T,) slot per token; adapter_enabled: (> max_loras,).
    """
    tokens, top_k, hidden = experts_out.shape
    if delta.shape != experts_out.shape or delta.dtype != experts_out.dtype:
        raise ValueError(
            f"delta {tuple(delta.shape)} {delta.dtype} must match experts_out "
            f"{tuple(experts_out.shape)} {experts_out.dtype}"
        )
    if output.shape != (tokens, hidden) or output.dtype != experts_out.dtype:
        raise ValueError(
            f"output {tuple(output.shape)} {output.dtype} must be (tokens, hidden) = "
            f"({tokens}, {hidden}) {experts_out.dtype}"
        )
    if experts_out.stride(2) != 1 or delta.stride(2) != 1 or output.stride(1) != 1:
        raise ValueError("experts_out, delta and output need contiguous rows (last stride 1)")
    if token_lora_mapping.numel() < tokens:
        raise ValueError(
            f"token_lora_mapping has {token_lora_mapping.numel()} entries, fewer than the "
            f"{tokens} tokens"
        )
    if tokens == 0:
        return
    grid = (triton.cdiv(tokens, BLOCK_TOKENS), triton.cdiv(hidden, BLOCK_COLS))
    moe_sum_with_delta_kernel[grid](
        experts_out, delta, output, token_lora_mapping, adapter_enabled, tokens, hidden,
        max_loras, experts_out.stride(0), experts_out.stride(1), delta.stride(0),
        delta.stride(1), output.stride(0),
        TOP_K=top_k, BLOCK_T=BLOCK_TOKENS, BLOCK_H=BLOCK_COLS, num_warps=4,
    )  # fmt: skip
