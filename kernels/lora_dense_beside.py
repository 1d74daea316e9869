"""A dense LoRA layer at prefill sizes: the LoRA's shrink beside the base GEMM, on a side stream.

vLLM 0.26 runs a LoRA linear layer (attention's qkv and o) as the base GEMM, then the LoRA's
shrink (x @ A) and its expand, added into the GEMM's output. The shrink needs only x, so here it
starts first, on `moe_lora_side_stream`'s side stream, while the main stream runs the GEMM; the
main stream then waits for it and runs the expand. In the H200 profile of the issue 6 prefill
(16 x 1600 tokens, steps of 16,384 and 9,216 tokens) our tiled shrink was 6.2 ms of the
prefill's critical path: 192 calls of 32 us each, beside GEMMs of 230-460 us.

Only eager calls from SIDE_MIN_TOKENS tokens on go beside, never a CUDA graph capture: vLLM's
own dual-stream option, which puts a layer's whole LoRA beside its GEMM, gained nothing at
decode (63.7 against 63.6 tok/s per request, H200, row in bench/e2e/results). Without CUDA (the
CPU tests) the same steps run in order on the current stream.

Memory: `shrunk` is allocated on the main stream before the side stream waits for it, so the
side stream's writes follow every earlier use of its block; x and `shrunk` stay referenced until
the main stream has waited for the side stream, so no later main-stream work can reuse their
blocks before the side stream is done with them.
"""

from __future__ import annotations

import torch

from .lora_dense_op import UnsupportedDenseCall, check_layout
from .lora_dense_tiled import lora_dense_tiled_expand, lora_dense_tiled_shrink, shrunk_shape
from .moe_lora_side_stream import side_stream

# Eager calls from this many tokens on (the e2e prefill steps have 9,216 and 16,384); below it
# the fork's host work (two event waits, a stream switch) would weigh on short GEMMs.
SIDE_MIN_TOKENS = 2048


def goes_beside(
    x: torch.Tensor, weight: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]
) -> bool:
    """Whether `linear_with_shrink_beside` takes this call: eager, SIDE_MIN_TOKENS tokens or more,
    and weights in a layout our tiled kernels take for an output of the GEMM's shape."""
    if x.shape[0] < SIDE_MIN_TOKENS or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    output = torch.empty((x.shape[0], weight.shape[0]), device="meta")  # the GEMM's, contiguous
    try:
        check_layout(output, x, lora_a, lora_b)
    except (UnsupportedDenseCall, ValueError):
        return False
    return True


def linear_with_shrink_beside(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scale: float,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
) -> torch.Tensor:
    """x @ weight.T (+ bias) with the LoRA delta of `lora_dense_op`'s spec added, for a call
    that `goes_beside`; the batch sorted by adapter as `lora_dense_tiled` takes it."""
    meta = (token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, lora_ids)
    shrunk = torch.empty(shrunk_shape(x, lora_a), dtype=lora_b[0].dtype, device=x.device)
    if not x.is_cuda:
        lora_dense_tiled_shrink(shrunk, x, lora_a, scale, *meta)
        output = torch.nn.functional.linear(x, weight, bias)
    else:
        main, side = torch.cuda.current_stream(x.device), side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            lora_dense_tiled_shrink(shrunk, x, lora_a, scale, *meta)
        output = torch.nn.functional.linear(x, weight, bias)
        main.wait_stream(side)
    lora_dense_tiled_expand(output, shrunk, lora_b, *meta, add_inputs=True)
    return output
