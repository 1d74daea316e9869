"""GEMV kernels of the MoE-LoRA op for decode-sized units, on CUDA cores.

At decode sizes a unit holds one real row (the naive form's pair) or a few (a sorted block of
BLOCK_M rows, in which a slot-expert's one or two pairs are followed by padding), where the
tl.dot kernels of `moe_lora_triton` multiply 16-row tiles: the registers, shared memory and
layout changes of the padding rows cost programs per SM and latency, while at these sizes the
bytes in flight set the time. These kernels go over a unit's real rows one by one, each as a
vector. They fill, and read, the same workspace cells as the split variant's tl.dot kernels
(WS_ROWS cells of BLOCK_R a K range: 1 in the naive form, BLOCK_M in the sorted form), so
either pairs with the other's tl.dot half, the fused SiLU-and-mul and the side stream. A config
selects them with `gemv_shrink` and `gemv_expand`.

Sorted blocks are filled from row 0 (vLLM's align pads each slot-expert's pairs at the end), so
a program's row loop runs up to the block's last real pair; a padding row before it is skipped.
"""

import triton
import triton.language as tl

from .moe_lora_triton import (
    _BATCH_ARGS,
    _load_b,
    _load_prior,
    _locate_unit,
    _slice_base,
    _unit_rows,
)


@triton.jit
def _gemv_partials(cell_ptr, SPLIT_K: tl.constexpr, WS_ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
    """A row's shrink result (BLOCK_R,) fp32: its workspace cells' partial products summed over
    the K ranges (`_sum_partials` for one row, unmasked); cell_ptr is the row's cell in range 0."""
    offs_r = tl.arange(0, BLOCK_R)
    tmp = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for ks in tl.static_range(SPLIT_K):
        tmp += tl.load(cell_ptr + ks * (WS_ROWS * BLOCK_R) + offs_r)
    return tmp


@triton.jit
def _gemv_delta(b, tmp):
    """delta (BLOCK_N,) fp32 = tmp @ b for b (BLOCK_R, BLOCK_N) as `_load_b` loads it; tmp is
    rounded to B's dtype first, as the tl.dot expand (and vLLM) round it."""
    return tl.sum(b.to(tl.float32) * tmp.to(b.dtype).to(tl.float32)[:, None], 0)


@triton.jit
def _block_rows(slot, blk, sorted_ptr, num_pairs, em, stride_sl, BLOCK_M: tl.constexpr):
    """A sorted block's pair ids (BLOCK_M,) and how many rows to walk: up to its last real pair
    (0 for a block of padding only)."""
    pairs = _unit_rows(slot, blk, 0, sorted_ptr, num_pairs, em, stride_sl, True, BLOCK_M, BLOCK_M)
    last = tl.max(tl.where(pairs < num_pairs, tl.arange(0, BLOCK_M), -1), 0)
    return pairs, last + 1


@triton.jit
def _row_pair(pairs, row, BLOCK_M: tl.constexpr):
    """pairs[row], picked out of the registers that hold the block's ids."""
    return tl.sum(tl.where(tl.arange(0, BLOCK_M) == row, pairs, 0), 0)


@triton.jit
def _shrink_row(x_row, a_base, cell_ptr, k_lo, k_hi, stride_xk, stride_ar, stride_ak,
                BLOCK_R: tl.constexpr, RANK: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """cell[:] = x_row[k_lo:k_hi] @ A[:, k_lo:k_hi].T in fp32. BLOCK_K covers the whole range
    (`moe_lora_op.gemv_block_k`), so all of the program's loads of A issue at once."""
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    safe_r = tl.where(rmask, offs_r, 0)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    kmask = offs_k < k_hi
    xv = tl.load(x_row + offs_k * stride_xk, mask=kmask, other=0.0)
    a = tl.load(a_base + safe_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                mask=rmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
    tl.store(cell_ptr + offs_r, tl.sum(a.to(tl.float32) * xv.to(tl.float32)[None, :], 1))


@triton.jit(do_not_specialize=_BATCH_ARGS)
def moe_lora_gemv_shrink_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    ws_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    tlm_ptr,
    lora_ids_ptr,
    enabled_ptr,
    K,
    num_pairs,
    top_k,
    num_m_blocks,
    em,
    num_units,
    lora_dim,
    max_loras,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_sl,
    stride_el,
    TOKEN_FACTOR: tl.constexpr,
    SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LORA_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    WS_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The shrink as a GEMV per real row: the same workspace cells as `moe_lora_shrink_kernel`,
    ws[s, unit, ks, row, :] = x[pair, K range ks] @ A[s][slot, expert][:, K range ks].T. The
    wrapper sizes BLOCK_K to the whole K range, so each row issues all its loads of A at once,
    where the tl.dot shrink streams its range in BLOCK_K steps through 16-row tiles: at decode
    sizes it is the bytes in flight, not the multiply, that set the time. In a sorted block the
    second and later rows find A in the L1 or L2 cache."""
    unit = tl.program_id(0)
    s = tl.program_id(1)
    ks = tl.program_id(2)
    if USE_PDL:  # as in moe_lora_shrink_kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot, blk, expert, valid = _locate_unit(
        unit, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr, top_k, num_m_blocks,
        lora_dim, max_loras, stride_el, SORTED, BLOCK_M, LORA_PAD,
    )  # fmt: skip
    if valid == 0:
        return
    a_base = _slice_base(a0_ptr, a1_ptr, s, slot, expert, stride_al, stride_ae)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), 64) * 64
    k_lo = ks * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    cell = ws_ptr + ((s * num_units + unit).to(tl.int64) * SPLIT_K + ks) * (WS_ROWS * BLOCK_R)
    if SORTED:
        pairs, rows = _block_rows(slot, blk, sorted_ptr, num_pairs, em, stride_sl, BLOCK_M)
        for row in range(0, rows):
            pair = _row_pair(pairs, row, BLOCK_M)
            if pair < num_pairs:
                x_row = x_ptr + (pair // TOKEN_FACTOR).to(tl.int64) * stride_xm
                _shrink_row(x_row, a_base, cell + row * BLOCK_R, k_lo, k_hi, stride_xk,
                            stride_ar, stride_ak, BLOCK_R, RANK, BLOCK_K)  # fmt: skip
    else:
        tl.static_assert(WS_ROWS == 1)
        x_row = x_ptr + (unit // TOKEN_FACTOR).to(tl.int64) * stride_xm
        _shrink_row(x_row, a_base, cell, k_lo, k_hi, stride_xk, stride_ar, stride_ak, BLOCK_R,
                    RANK, BLOCK_K)  # fmt: skip


@triton.jit
def _store_row(out_ptrs, nmask, acc, prior, weight, MUL_ROUTED_WEIGHT: tl.constexpr):
    """output row = prior + acc (* routing weight), rounded to the output dtype before the add
    as the tl.dot expand (and vLLM) round it."""
    if MUL_ROUTED_WEIGHT:
        acc = acc * weight
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty) + prior, mask=nmask)


@triton.jit(do_not_specialize=_BATCH_ARGS)
def moe_lora_gemv_expand_kernel(
    ws_ptr,
    b0_ptr,
    b1_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    tlm_ptr,
    lora_ids_ptr,
    enabled_ptr,
    N,
    num_pairs,
    top_k,
    num_m_blocks,
    em,
    num_units,
    lora_dim,
    max_loras,
    col_offset,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    stride_sl,
    stride_el,
    SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LORA_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    WS_ROWS: tl.constexpr,
    SLICES: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """output[pair, col_offset + s*N + n] (+)= (sum_ks ws[s, unit, ks, row, :]) @ B[s][slot,
    expert][n, :] (* the pair's routing weight) for the BLOCK_N columns n of this program and
    each real row of its unit.

    Programs of one unit are adjacent (N fastest, then slice), as in the tl.dot expand. B's
    columns load once, before the PDL wait, and serve every row. In the naive form the pair's
    output row and weight load before the wait too (see moe_lora_expand_kernel); a sorted
    block's rows load theirs after it, in the row loop.
    """
    groups = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    group = pid % groups
    rest = pid // groups
    s = rest % SLICES
    unit = rest // SLICES
    slot, blk, expert, valid = _locate_unit(
        unit, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr, top_k, num_m_blocks,
        lora_dim, max_loras, stride_el, SORTED, BLOCK_M, LORA_PAD,
    )  # fmt: skip
    if valid == 0:
        return
    offs_n = group * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    b_base = _slice_base(b0_ptr, b1_ptr, s, slot, expert, stride_bl, stride_be)
    b = _load_b(b_base, offs_n, N, stride_bn, stride_br, BLOCK_R, RANK)
    cols = (col_offset + s * N + offs_n) * stride_on
    cell = ws_ptr + (s * num_units + unit).to(tl.int64) * SPLIT_K * (WS_ROWS * BLOCK_R)
    if SORTED:
        pairs, rows = _block_rows(slot, blk, sorted_ptr, num_pairs, em, stride_sl, BLOCK_M)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        for row in range(0, rows):
            pair = _row_pair(pairs, row, BLOCK_M)
            if pair < num_pairs:
                out_ptrs = out_ptr + pair.to(tl.int64) * stride_om + cols
                prior = _load_prior(out_ptrs, nmask, ADD_INPUTS)
                weight = 1.0
                if MUL_ROUTED_WEIGHT:
                    weight = tl.load(topk_w_ptr + pair).to(tl.float32)
                tmp = _gemv_partials(cell + row * BLOCK_R, SPLIT_K, WS_ROWS, BLOCK_R)
                _store_row(out_ptrs, nmask, _gemv_delta(b, tmp), prior, weight, MUL_ROUTED_WEIGHT)
    else:
        tl.static_assert(WS_ROWS == 1)
        out_ptrs = out_ptr + unit.to(tl.int64) * stride_om + cols
        prior = _load_prior(out_ptrs, nmask, ADD_INPUTS)
        weight = 1.0
        if MUL_ROUTED_WEIGHT:
            weight = tl.load(topk_w_ptr + unit).to(tl.float32)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        tmp = _gemv_partials(cell, SPLIT_K, WS_ROWS, BLOCK_R)
        _store_row(out_ptrs, nmask, _gemv_delta(b, tmp), prior, weight, MUL_ROUTED_WEIGHT)
