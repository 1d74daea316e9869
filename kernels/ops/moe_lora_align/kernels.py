"""Triton bodies of the sorted routing form's build (launcher: `op.moe_lora_align_block_size`).

A pair's key is its (adapter slot, expert); pairs without an enabled slot or an expert have
none and are left out. `count_kernel` counts the pairs per key, `layout_kernel` turns the counts
into padded group starts (and writes every block's expert and the padding), `place_kernel` puts
each pair at its group's next place.
"""

import triton
import triton.language as tl

PAIRS_PER_PROGRAM = 1024


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
def count_kernel(topk_ptr, tlm_ptr, enabled_ptr, counts_ptr, num_pairs, top_k, num_experts,
                  max_loras, BLOCK: tl.constexpr):  # fmt: skip
    _, _, key, ok = _pair_keys(topk_ptr, tlm_ptr, enabled_ptr, num_pairs, top_k, num_experts,
                               max_loras, BLOCK)  # fmt: skip
    tl.atomic_add(counts_ptr + key, 1, mask=ok, sem="relaxed")


@triton.jit(do_not_specialize=["num_pairs", "em", "num_blocks"])
def layout_kernel(counts_ptr, sorted_ptr, expert_ids_ptr, ntpp_ptr, num_pairs, num_experts,
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
def place_kernel(topk_ptr, tlm_ptr, enabled_ptr, cursor_ptr, sorted_ptr, num_pairs, top_k,
                  num_experts, max_loras, em, BLOCK: tl.constexpr):  # fmt: skip
    pair, slot, key, ok = _pair_keys(topk_ptr, tlm_ptr, enabled_ptr, num_pairs, top_k,
                                     num_experts, max_loras, BLOCK)  # fmt: skip
    place = tl.atomic_add(cursor_ptr + key, 1, mask=ok, sem="relaxed")
    tl.store(sorted_ptr + slot.to(tl.int64) * em + place, pair, mask=ok)
