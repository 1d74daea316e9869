"""The sorted routing form of the MoE-LoRA op, built on the GPU in four launches.

Same arguments and outputs as vLLM 0.26's `moe_lora_align_block_size` CUDA op (spec:
`moe_lora_reference.moe_lora_align_reference`): per adapter slot, the flat pair ids grouped by
expert, each group padded with the pair count P to a multiple of `block_size`, each block's
expert (-1 past the used length) and the used length. Within a group pairs come in the order
their atomics land, as in vLLM's op for large batches; every consumer reads a pair's row by its
id, so the order changes no result.

vLLM's op spends about 1 ms per layer at the issue 6 prefill (16 x 1600 tokens, top-8, 8 slots:
48 ms of the 0.69 s prefill on the H200). Here every pass is spread over the pairs or the slots:

1. `_count_kernel`: per (slot, expert) pair counts, by atomics;
2. `_layout_kernel` (one program per slot): padded group starts, the used length, every block's
   expert and the padding entries; the counts become each group's write cursor;
3. `_place_kernel`: each pair takes the next place of its group, by atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PAIRS_PER_PROGRAM = 1024
BLOCK_SIZES = (16, 32, 64, 128, 256)  # the sorted form's block sizes these kernels take


@triton.jit
def _pair_keys(topk_ptr, tlm_ptr, enabled_ptr, num_pairs, top_k, num_experts, max_loras,
               BLOCK: tl.constexpr):  # fmt: skip
    """(flat pair ids, slot, slot * E + expert, counts) of this program's pairs."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < num_pairs
    expert = tl.load(topk_ptr + offs, mask=inside, other=-1).to(tl.int32)
    slot = tl.load(tlm_ptr + offs // top_k, mask=inside, other=-1).to(tl.int32)
    ok = inside & (expert >= 0) & (expert < num_experts) & (slot >= 0) & (slot < max_loras)
    ok = ok & (tl.load(enabled_ptr + tl.where(ok, slot, 0), mask=ok, other=0) != 0)
    return offs, slot, slot * num_experts + expert, ok


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(topk_ptr, tlm_ptr, enabled_ptr, counts_ptr, num_pairs, top_k, num_experts,
                  max_loras, BLOCK: tl.constexpr):  # fmt: skip
    _, _, key, ok = _pair_keys(topk_ptr, tlm_ptr, enabled_ptr, num_pairs, top_k, num_experts,
                               max_loras, BLOCK)  # fmt: skip
    tl.atomic_add(counts_ptr + key, 1, mask=ok, sem="relaxed")


@triton.jit(do_not_specialize=["num_pairs", "em", "num_blocks"])
def _layout_kernel(counts_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr, num_pairs, num_experts,
                   em, num_blocks, BLOCK_SIZE: tl.constexpr, E_PAD: tl.constexpr,
                   BLOCKS_PER_ITER: tl.constexpr):  # fmt: skip
    slot = tl.program_id(0)
    offs_e = tl.arange(0, E_PAD)
    emask = offs_e < num_experts
    count = tl.load(counts_ptr + slot * num_experts + offs_e, mask=emask, other=0)
    padded = tl.cdiv(count, BLOCK_SIZE) * BLOCK_SIZE
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    used = tl.sum(padded, 0)
    tl.store(ntpp_ptr + slot, used)
    tl.store(counts_ptr + slot * num_experts + offs_e, starts, mask=emask)  # now write cursors
    row = sorted_ptr + slot.to(tl.int64) * em
    offs_j = tl.arange(0, BLOCK_SIZE)
    tail = (starts + count)[:, None] + offs_j[None, :]
    tl.store(row + tail, num_pairs, mask=emask[:, None] & (tail < ends[:, None]))
    # Block b's expert is the first whose group ends past the block's start.
    ends_or_max = tl.where(emask, ends, 2**30)
    for b0 in range(0, num_blocks, BLOCKS_PER_ITER):
        blocks = b0 + tl.arange(0, BLOCKS_PER_ITER)
        first = blocks * BLOCK_SIZE
        expert = tl.sum((ends_or_max[None, :] <= first[:, None]).to(tl.int32), 1)
        expert = tl.where(first < used, expert, -1)
        tl.store(expert_ids_ptr + slot * num_blocks + blocks, expert, mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs", "em"])
def _place_kernel(topk_ptr, tlm_ptr, enabled_ptr, cursor_ptr, sorted_ptr, num_pairs, top_k,
                  num_experts, max_loras, em, BLOCK: tl.constexpr):  # fmt: skip
    pair, slot, key, ok = _pair_keys(topk_ptr, tlm_ptr, enabled_ptr, num_pairs, top_k,
                                     num_experts, max_loras, BLOCK)  # fmt: skip
    place = tl.atomic_add(cursor_ptr + key, 1, mask=ok, sem="relaxed")
    tl.store(sorted_ptr + slot.to(tl.int64) * em + place, pair, mask=ok)


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
        _count_kernel[grid](*pairs, counts, num_pairs, top_k, num_experts, max_loras,
                            BLOCK=PAIRS_PER_PROGRAM)  # fmt: skip
    e_pad = triton.next_power_of_2(num_experts)
    _layout_kernel[(max_loras,)](
        counts, sorted_token_ids, experts_ids, num_tokens_post_pad, num_pairs, num_experts,
        max_num_tokens_padded, max_num_m_blocks, BLOCK_SIZE=block_size, E_PAD=e_pad,
        BLOCKS_PER_ITER=max(16, 16384 // e_pad),
    )  # fmt: skip
    if num_pairs:
        _place_kernel[grid](*pairs, counts, sorted_token_ids, num_pairs, top_k, num_experts,
                            max_loras, max_num_tokens_padded, BLOCK=PAIRS_PER_PROGRAM)  # fmt: skip
