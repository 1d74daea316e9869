"""Dense LoRA for prefill batches: `op`'s spec, tokens tiled by adapter.

Takes vLLM 0.26's `LoRAKernelMeta` view of the batch (tokens sorted by adapter slot, group
sizes and starts, the slot of each group), which vLLM prepares once per step for every layer;
`reference.lora_sort_meta` builds the same tensors in plain torch (tests, benchmarks). Two
launches per call: a tiled shrink into a workspace of rank-sized rows, then a tiled expand that
adds into y (see `tiled_kernels`). No host syncs and a grid from shapes alone.
"""

from __future__ import annotations

import torch
import triton

from loraplex.kernels.ops.lora_dense import tiled_kernels as kt
from loraplex.kernels.ops.lora_dense.op import call_shape, padded_slices

BLOCK_M = 64  # tokens per tile: a prefill group has hundreds; 64 keeps the x tile in registers
# Launch shape: on the H200 at 9,216 and 16,384 tokens (Qwen3-30B-A3B qkv and o, 8 rank-32
# slots) no other of 20 shapes (BLOCK_M 32-128, N tiles 64-256, 4 or 8 warps, 2-4 stages) was
# faster for all four calls; the best of each was within 3%, except shrink stages 4 for o at
# 9,216 tokens (61.0 against 67.1 us), which cost qkv at 16,384 more.
SHRINK_WARPS, SHRINK_STAGES = 4, 3
EXPAND_WARPS, EXPAND_STAGES = 4, 3


def lora_dense_tiled(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    scale: float,
    token_indices_sorted_by_lora_ids: torch.Tensor,
    num_tokens_per_lora: torch.Tensor,
    lora_token_start_loc: torch.Tensor,
    lora_ids: torch.Tensor,
    add_inputs: bool = True,
    block_n: int = 128,
) -> None:
    """y (+)= LoRA delta per `op`'s spec, for a batch sorted by adapter as above."""
    shape = call_shape(y, x, lora_a, lora_b)
    if shape is None:
        return
    num_tokens, k, slices, rank, block_r = shape
    num_groups = lora_ids.numel()
    num_units = triton.cdiv(num_tokens, BLOCK_M) + num_groups
    block_k = 64 if k >= 64 else 16
    mid = torch.empty((slices, num_tokens, block_r), dtype=lora_b[0].dtype, device=x.device)
    a, b, widths = padded_slices(lora_a, lora_b)
    meta = (token_indices_sorted_by_lora_ids, lora_ids, num_tokens_per_lora, lora_token_start_loc)
    groups = {"GROUP_PAD": max(2, triton.next_power_of_2(num_groups)), "NUM_GROUPS": num_groups}
    kt.lora_dense_tiled_shrink_kernel[(num_units * slices,)](
        x, *a, mid, *meta, scale, k, num_tokens, num_units, lora_a[0].shape[0],
        x.stride(0), lora_a[0].stride(0), lora_a[0].stride(2),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, RANK=rank, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
        SLICES=slices, **groups, num_warps=SHRINK_WARPS, num_stages=SHRINK_STAGES,
    )  # fmt: skip
    kt.lora_dense_tiled_expand_kernel[(num_units, triton.cdiv(max(widths), block_n), slices)](
        mid, *b, y, *meta, *widths, num_tokens, num_units, lora_b[0].shape[0],
        y.stride(0), *(t.stride(0) for t in b), lora_b[0].stride(2),
        BLOCK_M=BLOCK_M, BLOCK_R=block_r, RANK=rank, BLOCK_N=block_n, ADD_INPUTS=add_inputs,
        **groups, num_warps=EXPAND_WARPS, num_stages=EXPAND_STAGES,
    )  # fmt: skip
