"""vLLM's moe_sum with the down LoRA's delta added in the same pass (kernel: `kernels`;
spec: `reference.moe_sum_with_delta_reference`).

When the down LoRA runs beside the base down GEMM (`kernels/vllm/side_stream.py`) it writes its
delta into a buffer of its own rather than adding into the GEMM's output. This kernel then reads
both buffers once: out[t] = sum over the token's k experts of (experts_out + delta), the delta
only for tokens on an active adapter slot, whose pairs the op wrote (other rows hold garbage).
Sums run in float32 and round once to the output's dtype.

One pass on the main stream, not two: summing the deltas per token on the side stream first
slowed the base down GEMM beside it more than it saved (e2e prefill 0.435 s against 0.430 on
the H200; docs/kernels.md).
"""

from __future__ import annotations

import torch
import triton

from loraplex.kernels.ops.moe_lora_sum.kernels import moe_sum_with_delta_kernel

# Tokens x columns per program: 4 x 512 bf16 is 16 bytes per thread per load on 4 warps.
BLOCK_TOKENS = 4
BLOCK_COLS = 512


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
