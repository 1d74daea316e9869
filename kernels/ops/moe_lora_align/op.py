"""The sorted routing form of the MoE-LoRA op, built on the GPU in four launches.

Same arguments and outputs as vLLM 0.26's `moe_lora_align_block_size` CUDA op (spec:
`reference.moe_lora_align_reference`): per adapter slot, the flat pair ids grouped by
expert, each group padded with the pair count P to a multiple of `block_size`, each block's
expert (-1 past the used length) and the used length. Within a group pairs come in the order
their atomics land, as in vLLM's op for large batches; every consumer reads a pair's row by its
id, so the order changes no result.

vLLM's op spends about 1 ms per layer at the issue 6 prefill (16 x 1600 tokens, top-8, 8 slots:
48 ms of the 0.69 s prefill on the H200). Here every pass is spread over the pairs or the slots:

1. `count_kernel`: per (slot, expert) pair counts, by atomics;
2. `layout_kernel` (one program per slot): padded group starts, the used length, every block's
   expert and the padding entries; the counts become each group's write cursor;
3. `place_kernel`: each pair takes the next place of its group, by atomics.
"""

from __future__ import annotations

import torch
import triton

from loraplex.kernels.ops.moe_lora_align.kernels import (
    PAIRS_PER_PROGRAM,
    count_kernel,
    layout_kernel,
    place_kernel,
)

BLOCK_SIZES = (16, 32, 64, 128, 256)  # the sorted form's block sizes these kernels take


def moe_lora_align_block_size(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_size: int,
    max_loras: int,
    max_num_tokens_padded: int,
    max_num_m_blocks: int,
    sorted_token_ids: torch.Tensor,
    experts_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    adapter_enabled: torch.Tensor,
) -> None:
    """Fill sorted_token_ids (L x EM), experts_ids (L x blocks) and num_tokens_post_pad (L,),
    flat or 2-D, for every enabled slot (the others get length 0 and no blocks)."""
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    if sorted_token_ids.numel() < max_loras * max_num_tokens_padded:
        raise ValueError(
            f"sorted_token_ids holds {sorted_token_ids.numel()} < max_loras x "
            f"max_num_tokens_padded = {max_loras * max_num_tokens_padded}"
        )
    if experts_ids.numel() < max_loras * max_num_m_blocks:
        raise ValueError(
            f"experts_ids holds {experts_ids.numel()} < max_loras x "
            f"max_num_m_blocks = {max_loras * max_num_m_blocks}"
        )
    counts = torch.zeros(max_loras * num_experts, dtype=torch.int32, device=topk_ids.device)
    topk = topk_ids.contiguous()
    pairs = (topk, token_lora_mapping, adapter_enabled)
    grid = (triton.cdiv(num_pairs, PAIRS_PER_PROGRAM),)
    if num_pairs:
        count_kernel[grid](*pairs, counts, num_pairs, top_k, num_experts, max_loras,
                            BLOCK=PAIRS_PER_PROGRAM)  # fmt: skip
    e_pad = triton.next_power_of_2(num_experts)
    layout_kernel[(max_loras,)](
        counts, sorted_token_ids, experts_ids, num_tokens_post_pad, num_pairs, num_experts,
        max_num_tokens_padded, max_num_m_blocks, BLOCK_SIZE=block_size, E_PAD=e_pad,
        BLOCKS_PER_ITER=max(16, 16384 // e_pad),
    )  # fmt: skip
    if num_pairs:
        place_kernel[grid](*pairs, counts, sorted_token_ids, num_pairs, top_k, num_experts,
                            max_loras, max_num_tokens_padded, BLOCK=PAIRS_PER_PROGRAM)  # fmt: skip
