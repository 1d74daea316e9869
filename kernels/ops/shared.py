"""Helpers that the kernels of more than one file call: one rule each, stated once.

- Routing (MoE LoRA, its fused SiLU-and-mul and `moe_lora_sum`): `active_slots` is the one rule
  for "this token has a LoRA" (`is_active_slot` is the same rule for the plain-torch
  references); a *unit* is the work of one program row, one (token, expert) pair in the naive
  routing form or one block of BLOCK_M pairs of one (adapter slot, expert) in the sorted form
  (`locate_unit`, `unit_rows`).
- Tiles (MoE LoRA and its fused SiLU-and-mul): a slice's weights, B's tile, the output tile and
  the shrink's partial products in the workspace; the GEMV forms of the last two.
- Slices (dense LoRA, decode and prefill kernels): up to three (q, k, v) by index.

Triton helpers here import nothing but triton; `@triton.jit` bodies elsewhere call them.
"""

import torch
import triton
import triton.language as tl


def is_active_slot(slot: int, num_slots: int, adapter_enabled: torch.Tensor) -> bool:
    """`active_slots` for one slot id, on the host (the references)."""
    return 0 <= slot < num_slots and bool(adapter_enabled[slot] != 0)


# The lengths that change with the batch, not specialised on (a new batch size compiles nothing).
MOE_BATCH_ARGS = [
    "num_pairs", "num_m_blocks", "em", "num_units", "lora_dim", "stride_sl", "stride_el"
]  # fmt: skip


@triton.jit
def active_slots(slots, enabled_ptr, max_loras):
    """(slots, active) for adapter slot ids read from a mapping (-1, or a masked load's other=-1,
    for none): active where the id is one of the max_loras slots and its adapter is enabled.
    Inactive ids come back as 0, so they index without a mask. The one rule for "this token has
    a LoRA", shared by the op, the fused activation and the sum with the delta."""
    active = (slots >= 0) & (slots < max_loras)
    slots = tl.where(active, slots, 0)
    active = active & (tl.load(enabled_ptr + slots, mask=active, other=0) != 0)
    return slots, active


@triton.jit
def sorted_unit(unit, lora_ids_ptr, enabled_ptr, ntpp_ptr, lora_dim, max_loras, num_m_blocks,
                 BLOCK_M: tl.constexpr, LORA_PAD: tl.constexpr):  # fmt: skip
    """Map a compact unit index onto (slot, block, valid) in the sorted form (block 0 if not).

    Units enumerate only the blocks actually present: slot i's blocks, cdiv(used_i, BLOCK_M),
    follow slot i - 1's. vLLM's grid walks every slot x every possible block instead, most of it
    padding (at 16 x 1600 tokens, 30k programs for 4.4k real blocks).
    """
    offs = tl.arange(0, LORA_PAD)
    slots, ok = active_slots(tl.load(lora_ids_ptr + offs, mask=offs < lora_dim, other=-1),
                              enabled_ptr, max_loras)  # fmt: skip
    used = tl.load(ntpp_ptr + slots, mask=ok, other=0)
    blocks = tl.where(ok, tl.minimum(tl.cdiv(used, BLOCK_M), num_m_blocks), 0)
    ends = tl.cumsum(blocks, 0)
    idx = tl.sum((ends <= unit).to(tl.int32), 0)
    mine = offs == idx
    slot = tl.sum(tl.where(mine, slots, 0), 0)
    valid = idx < LORA_PAD
    blk = tl.where(valid, unit - tl.sum(tl.where(mine, ends - blocks, 0), 0), 0)
    return slot, blk, valid


@triton.jit
def naive_unit(unit, expert_ids_ptr, tlm_ptr, enabled_ptr, top_k, max_loras):
    """(slot, expert, valid 0/1) of pair `unit` in the naive form: its token's slot and its
    expert (0 where not valid)."""
    slot, valid = active_slots(tl.load(tlm_ptr + unit // top_k), enabled_ptr, max_loras)
    expert = tl.load(expert_ids_ptr + unit)
    valid = valid & (expert >= 0)
    return slot, tl.where(valid, expert, 0), valid.to(tl.int32)


@triton.jit
def locate_unit(unit, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr, top_k,
                 num_m_blocks, lora_dim, max_loras, stride_el, SORTED: tl.constexpr,
                 BLOCK_M: tl.constexpr, LORA_PAD: tl.constexpr):  # fmt: skip
    """(slot, block, expert, valid 0/1) of a unit: its sorted block, or in the naive form its
    pair (block is the unit)."""
    if SORTED:
        slot, blk, valid = sorted_unit(unit, lora_ids_ptr, enabled_ptr, ntpp_ptr, lora_dim,
                                        max_loras, num_m_blocks, BLOCK_M, LORA_PAD)  # fmt: skip
        expert = tl.load(expert_ids_ptr + slot * stride_el + blk)
        valid = valid & (expert >= 0)
        expert = tl.where(valid, expert, 0)
        valid = valid.to(tl.int32)
    else:
        blk = unit
        slot, expert, valid = naive_unit(unit, expert_ids_ptr, tlm_ptr, enabled_ptr, top_k,
                                          max_loras)  # fmt: skip
    return slot, blk, expert, valid


@triton.jit
def unit_rows(slot, blk, row0, sorted_ptr, num_pairs, em, stride_sl, SORTED: tl.constexpr,
               BLOCK_M: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Flat pair ids (ROWS,) of a located unit's rows row0 .. row0 + ROWS; ids >= num_pairs
    pad, as do rows past the block. The naive form has one pair per unit, in row 0."""
    offs = row0 + tl.arange(0, ROWS)
    if SORTED:
        pos = blk * BLOCK_M + offs
        inside = (offs < BLOCK_M) & (pos < em)
        return tl.load(sorted_ptr + slot * stride_sl + pos, mask=inside, other=num_pairs)
    else:
        return tl.where(offs == 0, blk, num_pairs)


@triton.jit
def slice_base(ptr0, ptr1, s, slot, expert, stride_l, stride_e):
    base = ptr0
    if s == 1:
        base = ptr1
    return base + slot.to(tl.int64) * stride_l + expert.to(tl.int64) * stride_e


@triton.jit
def load_b(b_base, offs_n, N, stride_bn, stride_br, BLOCK_R: tl.constexpr, RANK: tl.constexpr):
    """B[:, offs_n] as (BLOCK_R, BLOCK_N). Where the rank fills the block (rank 16, 32, 64, 128)
    the rank offsets stay a plain range: clamped ones (tl.where) hid their contiguity from the
    compiler, which then loaded B two bytes at a time (16 scalar loads per thread in the PTX)."""
    offs_r = tl.arange(0, BLOCK_R)
    if BLOCK_R == RANK:
        ptrs = b_base + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn
        return tl.load(ptrs, mask=(offs_n < N)[None, :], other=0.0)
    rmask = offs_r < RANK
    safe_r = tl.where(rmask, offs_r, 0)
    ptrs = b_base + safe_r[:, None] * stride_br + offs_n[None, :] * stride_bn
    return tl.load(ptrs, mask=rmask[:, None] & (offs_n < N)[None, :], other=0.0)


@triton.jit
def sum_partials(cell_ptr, offs_m, pmask, SPLIT_K: tl.constexpr, WS_ROWS: tl.constexpr,
                  BLOCK_R: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """The shrink's partial products for rows offs_m of a workspace cell (SPLIT_K blocks of
    WS_ROWS x BLOCK_R), summed over its K ranges in fp32. Only rows of real pairs (pmask) load:
    sorted decode blocks hold one or two pairs in BLOCK_M rows, and reading the padding rows
    would cost more than B itself."""
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = cell_ptr + offs_m[:, None] * BLOCK_R + offs_r[None, :]
    rows_mask = ((offs_m < WS_ROWS) & pmask)[:, None]
    acc = tl.zeros((ROWS, BLOCK_R), dtype=tl.float32)
    for _ks in tl.static_range(SPLIT_K):
        acc += tl.load(ptrs, mask=rows_mask, other=0.0)
        ptrs += WS_ROWS * BLOCK_R
    return acc


@triton.jit
def output_tile(tokens, tmask, offs_n, n_hi, col0, out_ptr, stride_om, stride_on):
    """Pointers and mask of output[tokens, col0 + offs_n]."""
    ptrs = out_ptr + tokens.to(tl.int64)[:, None] * stride_om + (col0 + offs_n)[None, :] * stride_on
    return ptrs, tmask[:, None] & (offs_n < n_hi)[None, :]


@triton.jit
def load_prior(ptrs, mask, ADD_INPUTS: tl.constexpr):
    """The output tile the delta adds to (0 where the op overwrites)."""
    if ADD_INPUTS:
        return tl.load(ptrs, mask=mask, other=0.0)
    else:
        return 0.0


@triton.jit
def gemv_partials(cell_ptr, SPLIT_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """A pair's shrink result (BLOCK_R,) fp32: its workspace cell's partial products (WS_ROWS
    1) summed over the K ranges (`sum_partials` for one row, unmasked)."""
    offs_r = tl.arange(0, BLOCK_R)
    tmp = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for ks in tl.static_range(SPLIT_K):
        tmp += tl.load(cell_ptr + ks * BLOCK_R + offs_r)
    return tmp


@triton.jit
def gemv_delta(b, tmp):
    """delta (BLOCK_N,) fp32 = tmp @ b for b (BLOCK_R, BLOCK_N) as `load_b` loads it; tmp is
    rounded to B's dtype first, as the tl.dot expand (and vLLM) round it."""
    return tl.sum(b.to(tl.float32) * tmp.to(b.dtype).to(tl.float32)[:, None], 0)


@triton.jit
def pick(s, v0, v1, v2):
    """Slice s's pointer (pointers are never constexpr, so both branches have one type)."""
    v = v0
    if s == 1:
        v = v1
    if s == 2:
        v = v2
    return v


@triton.jit
def slice_b(s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, stride_bl0, stride_bl1, stride_bl2, slot):
    """(width, first column in y, B[s][slot] base) of slice s; slices lie side by side in y."""
    n = tl.where(s == 0, n0, tl.where(s == 1, n1, n2))
    col0 = tl.where(s >= 1, n0, 0) + tl.where(s >= 2, n1, 0)
    stride_bl = tl.where(s == 0, stride_bl0, tl.where(s == 1, stride_bl1, stride_bl2))
    return n, col0, pick(s, b0_ptr, b1_ptr, b2_ptr) + slot.to(tl.int64) * stride_bl
