"""Triton bodies of the dense LoRA op for prefill batches (launcher: `tiled`).

Tokens arrive grouped by adapter, as vLLM's `LoRAKernelMeta` sorts them: group g holds
`num_tokens_per_lora[g]` token ids from `lora_token_start_loc[g]` on in
`token_indices_sorted_by_lora_ids`, all of adapter slot `lora_ids[g]`. A *unit* is a block of up
to BLOCK_M tokens of one group; units enumerate only the blocks present (`_group_block`), so a
prefill of T tokens runs cdiv(T, BLOCK_M) + groups programs per slice, not T/BLOCK_M per slot.

- `lora_dense_tiled_shrink_kernel` (grid units x slices, slices fastest): mid = scale *
  x[rows] @ A[s][slot].T, rounded to the weights' dtype (as vLLM's expand rounds its fp32
  buffer), into a workspace row per sorted position.
- `lora_dense_tiled_expand_kernel` (grid units x N tiles x slices): y[rows, cols] (+)= mid @ B.

vLLM 0.26's prefill path tiles the shrink 32 x 16 with split-K 8 and fp32 atomics, and spends
1.8 ms per layer of the issue 6 prefill on it (88 ms of 16 x 1600 tokens on the H200); here each
x row is read once per slice and each y cell once.
"""

import triton
import triton.language as tl

from loraplex.kernels.ops.shared import pick, slice_b

_BATCH_ARGS = ["num_tokens", "num_units"]


@triton.jit
def _unit_tokens(unit, sorted_ptr, lora_ids_ptr, num_per_lora_ptr, start_loc_ptr, max_loras,
                 BLOCK_M: tl.constexpr, GROUP_PAD: tl.constexpr,
                 NUM_GROUPS: tl.constexpr):  # fmt: skip
    """(slot, first sorted position, rows, row mask, token ids) of a unit, 0 rows past the last
    block: group g's cdiv(n_g, BLOCK_M) blocks follow group g - 1's; groups of no adapter have
    none."""
    offs = tl.arange(0, GROUP_PAD)
    in_range = offs < NUM_GROUPS
    slots = tl.load(lora_ids_ptr + offs, mask=in_range, other=-1)
    ok = (slots >= 0) & (slots < max_loras)
    counts = tl.load(num_per_lora_ptr + offs, mask=in_range, other=0)
    blocks = tl.where(ok, tl.cdiv(counts, BLOCK_M), 0)
    ends = tl.cumsum(blocks, 0)
    idx = tl.sum((ends <= unit).to(tl.int32), 0)
    mine = offs == idx
    valid = idx < GROUP_PAD
    blk = unit - tl.sum(tl.where(mine, ends - blocks, 0), 0)
    slot = tl.sum(tl.where(mine, slots, 0), 0)
    start = tl.load(start_loc_ptr + idx, mask=valid, other=0) + blk * BLOCK_M
    rows = tl.where(valid, tl.sum(tl.where(mine, counts, 0), 0) - blk * BLOCK_M, 0)
    offs_m = tl.arange(0, BLOCK_M)
    mmask = offs_m < rows
    tokens = tl.load(sorted_ptr + start + offs_m, mask=mmask, other=0)
    return slot, start, rows, mmask, tokens


@triton.jit(do_not_specialize=_BATCH_ARGS)
def lora_dense_tiled_shrink_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    mid_ptr,
    sorted_ptr,
    lora_ids_ptr,
    num_per_lora_ptr,
    start_loc_ptr,
    scale,
    K,
    num_tokens,
    num_units,
    max_loras,
    stride_xm,
    stride_al,
    stride_ar,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    SLICES: tl.constexpr,
):
    """mid[s, pos, :] = round(scale * x[token(pos)] @ A[s][slot].T) for the unit's positions.
    The slice varies fastest over the grid, so a unit's slices run side by side and read its x
    rows from L2: x at 16,384 tokens (67 MB for Qwen3's qkv) does not fit in it. On the H200
    the qkv shrink took 19.4 and 26.7 us at 9,216 and 16,384 tokens this way, 21.6 and 29.9
    with the slices outermost."""
    pid = tl.program_id(0)
    s = pid % SLICES
    unit = pid // SLICES
    slot, start, rows, mmask, tokens = _unit_tokens(
        unit, sorted_ptr, lora_ids_ptr, num_per_lora_ptr, start_loc_ptr, max_loras, BLOCK_M,
        GROUP_PAD, NUM_GROUPS,
    )  # fmt: skip
    if rows <= 0:
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    a_base = pick(s, a0_ptr, a1_ptr, a2_ptr) + slot.to(tl.int64) * stride_al
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    a_ptrs = a_base + offs_k[:, None] + tl.where(rmask, offs_r, 0)[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
            a = tl.load(a_ptrs, mask=rmask[None, :], other=0.0)
        else:
            kmask = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            a = tl.load(a_ptrs, mask=kmask[:, None] & rmask[None, :], other=0.0)
        acc += tl.dot(x, a)
        x_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    pos = (s * num_tokens + start + offs_m).to(tl.int64)
    ptrs = mid_ptr + pos[:, None] * BLOCK_R + offs_r[None, :]
    tl.store(ptrs, (acc * scale).to(mid_ptr.dtype.element_ty), mask=mmask[:, None])


@triton.jit(do_not_specialize=_BATCH_ARGS)
def lora_dense_tiled_expand_kernel(
    mid_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    sorted_ptr,
    lora_ids_ptr,
    num_per_lora_ptr,
    start_loc_ptr,
    n0,
    n1,
    n2,
    num_tokens,
    num_units,
    max_loras,
    stride_ym,
    stride_bl0,
    stride_bl1,
    stride_bl2,
    stride_bn,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
):
    """y[token(pos), col(s) + n tile] (+)= mid[s, pos] @ B[s][slot][n tile].T."""
    unit = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    slot, start, rows, mmask, tokens = _unit_tokens(
        unit, sorted_ptr, lora_ids_ptr, num_per_lora_ptr, start_loc_ptr, max_loras, BLOCK_M,
        GROUP_PAD, NUM_GROUPS,
    )  # fmt: skip
    n, col0, b_base = slice_b(s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, stride_bl0, stride_bl1,
                               stride_bl2, slot)  # fmt: skip
    if (rows <= 0) | (pid_n * BLOCK_N >= n):
        return
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    pos = (s * num_tokens + start + offs_m).to(tl.int64)
    mid = tl.load(mid_ptr + pos[:, None] * BLOCK_R + offs_r[None, :], mask=mmask[:, None],
                  other=0.0)  # fmt: skip
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < n
    rmask = offs_r < RANK
    b = tl.load(b_base + tl.where(rmask, offs_r, 0)[:, None] + offs_n[None, :] * stride_bn,
                mask=rmask[:, None] & nmask[None, :], other=0.0)  # fmt: skip
    ptrs = y_ptr + tokens.to(tl.int64)[:, None] * stride_ym + (col0 + offs_n)[None, :]
    mask = mmask[:, None] & nmask[None, :]
    # Rounded to y's dtype before the add, as vLLM's expand does (same numbers as stock).
    delta = tl.dot(mid, b).to(y_ptr.dtype.element_ty)
    if ADD_INPUTS:
        delta += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, delta, mask=mask)
