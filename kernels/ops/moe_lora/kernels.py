"""Triton bodies of the fused MoE-LoRA op (spec: `reference`; launcher: `op`).

A *unit* is the work one program row owns: in the naive routing form one (token, expert) pair,
in the sorted form one block of BLOCK_M pairs of one (adapter slot, expert). Sorted units count
only the blocks present (`sorted_unit`), and every kernel leaves at once when its unit carries
no adapter, no expert or only padding, so absent slots cost one load, never a weight read.

Two shapes of work, chosen per shape and batch by the tuned configs:

- split: `moe_lora_shrink_kernel` (grid units x slices x SPLIT_K) writes fp32 partial products
  x @ A.T of one K range each to a workspace (no atomics, no zeroing: every cell read was
  written; relaxed fp32 atomics into one cell would need it zeroed first, 1.0-1.7 us a call at
  decode; with FUSE_SLICES one program per unit does gate and up from one gather of x). Then
  `moe_lora_expand_kernel` (one program per part of a unit's rows, slice and group of N tiles)
  sums the partials, multiplies by B and adds into the output. Many small programs keep
  enough loads in flight at decode sizes, where one program per pair would stream all of A
  alone. At decode sizes both launch under Programmatic Dependent Launch (at prefill sizes
  they do not: `REGIMES.pdl` says why): the shrink's launch overlaps the tail of the kernel
  before it (it waits for that kernel before reading anything), and the expand grid starts
  while the shrink runs, loads its B tile and output tile, and waits for the shrink only
  before it reads the partials (so the expand takes PDL only on the shrink's stream:
  `op.SplitExpand.pdl_here`). A shrink that also prefetched B into L2 for the expand was 1-29%
  slower at every decode point (docs/kernels.md has both probes). In the naive form a config
  may take the GEMV shrink or expand of `gemv_kernels` instead, on the same workspace cells.
- fused: `moe_lora_fused_kernel` (grid units x NPID x slices) keeps the rank-sized intermediate
  on chip and walks its share of N; with FUSE_SLICES one program does gate and up from one
  gather of x rows (at prefill the gathered x rows are a third of the traffic).

Lengths that change with the batch are `do_not_specialize`, so a new batch size compiles nothing.
"""

import triton
import triton.language as tl

from loraplex.kernels.ops.shared import (
    MOE_BATCH_ARGS,
    load_b,
    load_prior,
    locate_unit,
    output_tile,
    slice_base,
    sum_partials,
    unit_rows,
)


@triton.jit
def _resolve_unit(
    unit,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    tlm_ptr,
    lora_ids_ptr,
    enabled_ptr,
    num_pairs,
    top_k,
    num_m_blocks,
    em,
    lora_dim,
    max_loras,
    stride_sl,
    stride_el,
    row0,
    SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    LORA_PAD: tl.constexpr,
):
    """(slot, expert, flat pair ids (ROWS,), valid 0/1) of a unit's rows row0 .. row0 + ROWS
    (`locate_unit`, then `unit_rows`)."""
    slot, blk, expert, valid = locate_unit(
        unit, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr, top_k, num_m_blocks,
        lora_dim, max_loras, stride_el, SORTED, BLOCK_M, LORA_PAD,
    )  # fmt: skip
    tokens = unit_rows(slot, blk, row0, sorted_ptr, num_pairs, em, stride_sl, SORTED, BLOCK_M,
                        ROWS)  # fmt: skip
    return slot, expert, tokens, valid


@triton.jit
def _shrink(
    x_ptr,
    a_base,
    a2_base,
    rows,
    tmask,
    k_lo,
    k_hi,
    K,
    stride_xm,
    stride_xk,
    stride_ar,
    stride_ak,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    TWO: tl.constexpr,
):
    """acc (BLOCK_M, BLOCK_R) fp32 = x[rows, k_lo:k_hi] @ A[:, k_lo:k_hi].T; with TWO also acc2
    for a second A (gate and up) from the same x tiles, which are then gathered once, not twice.
    """
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    safe_r = tl.where(rmask, offs_r, 0)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_offs = offs_k[:, None] * stride_ak + safe_r[None, :] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=tmask[:, None], other=0.0)
            a_mask = rmask[None, :]
        else:
            kmask = (k + tl.arange(0, BLOCK_K)) < K
            x = tl.load(x_ptrs, mask=tmask[:, None] & kmask[None, :], other=0.0)
            a_mask = kmask[:, None] & rmask[None, :]
        acc += tl.dot(x, tl.load(a_base + a_offs, mask=a_mask, other=0.0))
        if TWO:
            acc2 += tl.dot(x, tl.load(a2_base + a_offs, mask=a_mask, other=0.0))
        x_ptrs += BLOCK_K * stride_xk
        a_offs += BLOCK_K * stride_ak
    return acc, acc2


@triton.jit
def _routing_weights(topk_w_ptr, tokens, tmask, MUL_ROUTED_WEIGHT: tl.constexpr):
    """The pairs' routing weights (fp32) where the op scales by them, else 1: loaded once per
    program, not per N tile (a gather of one scattered word per row each time)."""
    if MUL_ROUTED_WEIGHT:
        return tl.load(topk_w_ptr + tokens, mask=tmask, other=0.0).to(tl.float32)
    else:
        return tl.full(tokens.shape, 1.0, tl.float32)


@triton.jit
def _tile_inputs(b_base, offs_n, n_hi, tokens, tmask, col0, out_ptr, stride_bn, stride_br,
                 stride_om, stride_on, BLOCK_R: tl.constexpr, RANK: tl.constexpr,
                 ADD_INPUTS: tl.constexpr):  # fmt: skip
    """What one output tile's add needs besides the rank-sized intermediate: B's tile, the
    output tile's pointers and mask, and the prior values there."""
    b = load_b(b_base, offs_n, n_hi, stride_bn, stride_br, BLOCK_R, RANK)
    ptrs, mask = output_tile(tokens, tmask, offs_n, n_hi, col0, out_ptr, stride_om, stride_on)
    return b, ptrs, mask, load_prior(ptrs, mask, ADD_INPUTS)


@triton.jit
def _store_sum(acc, prior, weights, ptrs, mask, MUL_ROUTED_WEIGHT: tl.constexpr):
    """output tile = prior + acc (* routing weight); acc is (rows, BLOCK_N) fp32."""
    if MUL_ROUTED_WEIGHT:
        acc = acc * weights[:, None]
    # Rounded to the output dtype before the add, as vLLM's kernel does (same numbers as stock).
    tl.store(ptrs, acc.to(ptrs.dtype.element_ty) + prior, mask=mask)


@triton.jit(do_not_specialize=MOE_BATCH_ARGS)
def moe_lora_shrink_kernel(
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
    EVEN_K: tl.constexpr,
    WS_ROWS: tl.constexpr,
    USE_PDL: tl.constexpr,
    FUSE_SLICES: tl.constexpr,
):
    """ws[s, unit, ks, :WS_ROWS, :] = x[rows, K range ks] @ A[s][slot, expert][:, K range ks].T;
    with FUSE_SLICES one program does both slices (grid axis 1 is 1) from one gather of x."""
    unit = tl.program_id(0)
    s = tl.program_id(1)
    ks = tl.program_id(2)
    if USE_PDL:
        # Launched under PDL as well, after whatever kernel came before: wait for its writes
        # (x, the routing, the output the expand loads before its own wait), then let the
        # expand launch. The launch itself overlaps the previous kernel's tail.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot, expert, tokens, valid = _resolve_unit(
        unit, sorted_ptr, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr,
        num_pairs, top_k, num_m_blocks, em, lora_dim, max_loras, stride_sl, stride_el, 0, SORTED,
        BLOCK_M, BLOCK_M, LORA_PAD,
    )  # fmt: skip
    if valid == 0:
        return
    a_base = slice_base(a0_ptr, a1_ptr, s, slot, expert, stride_al, stride_ae)
    a2_base = slice_base(a0_ptr, a1_ptr, 1, slot, expert, stride_al, stride_ae)
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = ks * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    tmask = tokens < num_pairs
    acc, acc2 = _shrink(
        x_ptr, a_base, a2_base, tokens // TOKEN_FACTOR, tmask, k_lo, k_hi, K,
        stride_xm, stride_xk, stride_ar, stride_ak, BLOCK_M, BLOCK_R, RANK, BLOCK_K, EVEN_K,
        FUSE_SLICES,
    )  # fmt: skip
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    row_mask = ((offs_m < WS_ROWS) & tmask)[:, None]
    cell = ((s * num_units + unit).to(tl.int64) * SPLIT_K + ks) * (WS_ROWS * BLOCK_R)
    ptrs = ws_ptr + cell + offs_m[:, None] * BLOCK_R + offs_r[None, :]
    tl.store(ptrs, acc, mask=row_mask)
    if FUSE_SLICES:
        tl.store(ptrs + num_units.to(tl.int64) * SPLIT_K * WS_ROWS * BLOCK_R, acc2, mask=row_mask)


@triton.jit(do_not_specialize=MOE_BATCH_ARGS)
def moe_lora_expand_kernel(
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
    PARTS: tl.constexpr,
    TILES: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """output[rows, s, n tiles] (+)= (sum_ks ws[s, unit, ks, rows]) @ B[s][slot, expert][n].T.

    A program owns 1/PARTS of a unit's rows, one slice and TILES adjacent N tiles; programs of
    the same rows are adjacent in launch order (N fastest, then slice), so the output rows they
    share are read and written while their DRAM pages are open. A program of several tiles
    loads the next output tile before it stores the current one (the loop says how). This
    tiling won a sweep on the H200 at prefill (Qwen3 down projection, 204,800 pairs): 829 ->
    625 us, where the same read-modify-write without the dot ran in 445 us, and a contiguous
    one over the output in 396.
    """
    ROWS: tl.constexpr = BLOCK_M // PARTS
    groups = tl.cdiv(tl.cdiv(N, BLOCK_N), TILES)
    pid = tl.program_id(0)
    group = pid % groups
    rest = pid // groups
    s = rest % SLICES
    rest = rest // SLICES
    part = rest % PARTS
    unit = rest // PARTS
    slot, expert, tokens, valid = _resolve_unit(
        unit, sorted_ptr, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr,
        num_pairs, top_k, num_m_blocks, em, lora_dim, max_loras, stride_sl, stride_el,
        part * ROWS, SORTED, BLOCK_M, ROWS, LORA_PAD,
    )  # fmt: skip
    if valid == 0:
        return
    tmask = tokens < num_pairs
    # A block's last part is often all padding: leave before loading anything. (The constexpr
    # test stays a separate `if`, so that it compiles away where PARTS is 1.)
    if PARTS > 1:  # noqa: SIM102
        if tl.sum(tmask.to(tl.int32), 0) == 0:
            return
    offs_n = group * TILES * BLOCK_N + tl.arange(0, BLOCK_N)
    b_base = slice_base(b0_ptr, b1_ptr, s, slot, expert, stride_bl, stride_be)
    col0 = col_offset + s * N
    # The output tile and the routing weights were written before the shrink let this grid
    # launch (it first waits for the kernel before it), so they load before the wait, and with
    # one tile B too: the wait is then the only latency left between the shrink and the add.
    out_ptrs, out_mask = output_tile(tokens, tmask, offs_n, N, col0, out_ptr, stride_om,
                                      stride_on)  # fmt: skip
    prior = load_prior(out_ptrs, out_mask, ADD_INPUTS)
    weights = _routing_weights(topk_w_ptr, tokens, tmask, MUL_ROUTED_WEIGHT)
    cell = ws_ptr + (s * num_units + unit).to(tl.int64) * SPLIT_K * (WS_ROWS * BLOCK_R)
    offs_m = part * ROWS + tl.arange(0, ROWS)
    if TILES == 1:
        b = load_b(b_base, offs_n, N, stride_bn, stride_br, BLOCK_R, RANK)
        tmp = _partials_after(cell, offs_m, tmask, SPLIT_K, WS_ROWS, BLOCK_R, ROWS, USE_PDL)
        _store_sum(tl.dot(tmp.to(b.dtype), b), prior, weights, out_ptrs, out_mask,
                   MUL_ROUTED_WEIGHT)  # fmt: skip
    else:
        tmp = _partials_after(cell, offs_m, tmask, SPLIT_K, WS_ROWS, BLOCK_R, ROWS, USE_PDL)
        tmp = tmp.to(b_base.dtype.element_ty)
        # A loop the compiler keeps (range, not static_range), so that its pipeliner loads B
        # tiles ahead into shared memory (num_stages), while the next output tile is loaded
        # here and carried: it moves into the dot's layout (through shared memory) at the next
        # iteration's start. Unrolled, that move followed each load at once and waited for it,
        # so the prefetch hid nothing. H200, 25,600 tokens: Qwen3 down 652.9 -> 612.4 us
        # (x1.16 -> x1.24 vLLM), GPT-OSS down 627.0 -> 588.7; the side stream's overwriting
        # down expand at 16,384 / 9,216 tokens 296 -> 279 / 201 -> 188. In one-tile programs
        # this form loads B after the wait: gate/up at prefill took 7% longer, hence the split.
        for i in range(TILES):
            b = load_b(b_base, offs_n, N, stride_bn, stride_br, BLOCK_R, RANK)
            next_n = offs_n + BLOCK_N
            next_ptrs, next_mask = output_tile(tokens, tmask, next_n, N, col0, out_ptr,
                                                stride_om, stride_on)  # fmt: skip
            next_prior = load_prior(next_ptrs, next_mask & (i + 1 < TILES), ADD_INPUTS)
            _store_sum(tl.dot(tmp, b), prior, weights, out_ptrs, out_mask, MUL_ROUTED_WEIGHT)
            offs_n, out_ptrs, out_mask, prior = next_n, next_ptrs, next_mask, next_prior


@triton.jit
def _partials_after(cell_ptr, offs_m, pmask, SPLIT_K: tl.constexpr, WS_ROWS: tl.constexpr,
                    BLOCK_R: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr):  # fmt: skip
    """`sum_partials` once the shrink that writes them is done (under PDL, a wait for it)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    return sum_partials(cell_ptr, offs_m, pmask, SPLIT_K, WS_ROWS, BLOCK_R, ROWS)


@triton.jit(do_not_specialize=MOE_BATCH_ARGS)
def moe_lora_fused_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
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
    K,
    N,
    num_pairs,
    top_k,
    num_m_blocks,
    em,
    num_units,
    lora_dim,
    max_loras,
    col_offset,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    stride_sl,
    stride_el,
    TOKEN_FACTOR: tl.constexpr,
    SORTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    LORA_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NPID: tl.constexpr,
    EVEN_K: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    FUSE_SLICES: tl.constexpr,
):
    """One program: tmp = x[rows] @ A.T over all of K on chip, then output (+)= tmp @ B.T over
    its 1/NPID share of N; with FUSE_SLICES one program does both slices (grid axis 1 is 1)."""
    unit = tl.program_id(0) // NPID
    n_part = tl.program_id(0) % NPID
    s = tl.program_id(1)
    slot, expert, tokens, valid = _resolve_unit(
        unit, sorted_ptr, expert_ids_ptr, ntpp_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr,
        num_pairs, top_k, num_m_blocks, em, lora_dim, max_loras, stride_sl, stride_el, 0, SORTED,
        BLOCK_M, BLOCK_M, LORA_PAD,
    )  # fmt: skip
    if valid == 0:
        return
    tmask = tokens < num_pairs
    a_base = slice_base(a0_ptr, a1_ptr, s, slot, expert, stride_al, stride_ae)
    a2_base = slice_base(a0_ptr, a1_ptr, 1, slot, expert, stride_al, stride_ae)
    acc, acc2 = _shrink(
        x_ptr, a_base, a2_base, tokens // TOKEN_FACTOR, tmask, 0, K, K,
        stride_xm, stride_xk, stride_ar, stride_ak, BLOCK_M, BLOCK_R, RANK, BLOCK_K, EVEN_K,
        FUSE_SLICES,
    )  # fmt: skip
    n_per = tl.cdiv(tl.cdiv(N, NPID), BLOCK_N) * BLOCK_N
    n_lo = n_part * n_per
    n_hi = tl.minimum(n_lo + n_per, N)
    weights = _routing_weights(topk_w_ptr, tokens, tmask, MUL_ROUTED_WEIGHT)
    _expand_range(
        acc.to(out_ptr.dtype.element_ty), slice_base(b0_ptr, b1_ptr, s, slot, expert, stride_bl,
        stride_be), tokens, tmask, n_lo, n_hi, col_offset + s * N, out_ptr, weights, stride_bn,
        stride_br, stride_om, stride_on, BLOCK_R, RANK, BLOCK_N, MUL_ROUTED_WEIGHT, ADD_INPUTS,
    )  # fmt: skip
    if FUSE_SLICES:
        _expand_range(
            acc2.to(out_ptr.dtype.element_ty), slice_base(b0_ptr, b1_ptr, 1, slot, expert,
            stride_bl, stride_be), tokens, tmask, n_lo, n_hi, col_offset + N, out_ptr, weights,
            stride_bn, stride_br, stride_om, stride_on, BLOCK_R, RANK, BLOCK_N, MUL_ROUTED_WEIGHT,
            ADD_INPUTS,
        )  # fmt: skip


@triton.jit
def _expand_range(
    tmp,
    b_base,
    tokens,
    tmask,
    n_lo,
    n_hi,
    col0,
    out_ptr,
    weights,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
):
    """output[tokens, col0 + n] (+)= tmp @ B[n].T for n in [n_lo, n_hi); tmp (BLOCK_M, BLOCK_R)
    already in the output dtype (cast once, as vLLM does, not per N tile)."""
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        b, ptrs, mask, prior = _tile_inputs(
            b_base, offs_n, n_hi, tokens, tmask, col0, out_ptr, stride_bn, stride_br, stride_om,
            stride_on, BLOCK_R, RANK, ADD_INPUTS,
        )  # fmt: skip
        _store_sum(tl.dot(tmp, b), prior, weights, ptrs, mask, MUL_ROUTED_WEIGHT)
