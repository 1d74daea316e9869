"""A dense LoRA layer at decode sizes: the LoRA's shrink beside the base GEMM, on a side stream.

vLLM 0.26 runs a LoRA linear layer (attention's qkv and o) as the base GEMM, then the LoRA's
shrink (x @ A) and expand, added into the GEMM's output: at decode three kernels in a row on the
main stream. The shrink needs only x, so here it runs on `moe_lora_side_stream`'s side stream
while the main stream runs the GEMM; the main stream then waits for it and runs the expand.
A decode batch's GEMM leaves SMs idle (cuBLAS's 64 x 16 tiles: 80 programs for the qkv of
Qwen3-30B-A3B on 132 SMs), and the shrink (3.2 us per call in the H200 decode profile at
7406cf1, 96 calls per step) fits in them.

Decode sizes are served from CUDA graphs, where the fork and join are graph edges, paid once.
The eager calls vLLM makes before capturing each size run the same way, so they compile the
kernels the capture launches. Prefill sizes keep the serial order: the tiled shrink beside the
GEMM lost there (e84b910). Without CUDA (the CPU tests) the same steps run in order on the
current stream.

Neither launch uses Programmatic Dependent Launch here: the shrink follows an event, not the
kernel before it on its stream, and the expand reads the GEMM's output before its in-kernel
wait, which is safe only when the shrink, not the GEMM, launched it.

Memory: `ws` is allocated on the main stream before the side stream waits for it, so the side
stream's writes follow every earlier use of its block; x and `ws` stay referenced until the main
stream has waited for the side stream, so no later main-stream work reuses their blocks early.
"""

from __future__ import annotations

import torch

from .lora_dense_op import (
    UnsupportedDenseCall,
    check_layout,
    lora_dense_expand,
    lora_dense_shrink,
    shrink_workspace,
)
from .moe_lora_side_stream import side_stream


def takes_layout(
    x: torch.Tensor, weight: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]
) -> bool:
    """Whether `linear_with_shrink_beside` takes this call: weights in a layout our per-token
    kernels take, for an output of the GEMM's shape."""
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
    token_lora_mapping: torch.Tensor,
) -> torch.Tensor:
    """x @ weight.T (+ bias) with the LoRA delta of `lora_dense_op`'s spec added (tokens without
    adapter get the GEMM's output alone), for weights `takes_layout` accepts."""
    ws = shrink_workspace(x, lora_a)
    if not x.is_cuda:
        lora_dense_shrink(ws, x, lora_a, token_lora_mapping, scale)
        output = torch.nn.functional.linear(x, weight, bias)
    else:
        main, side = torch.cuda.current_stream(x.device), side_stream(x.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            lora_dense_shrink(ws, x, lora_a, token_lora_mapping, scale)
        output = torch.nn.functional.linear(x, weight, bias)
        main.wait_stream(side)
    lora_dense_expand(output, ws, lora_b, token_lora_mapping, add_inputs=True)
    return output
