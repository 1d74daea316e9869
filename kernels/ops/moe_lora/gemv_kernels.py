"""GEMV kernels of the MoE-LoRA op's naive routing form (decode), on CUDA cores.

In the naive form a unit is one (token, expert) pair, so the tl.dot kernels of
`kernels` multiply 16-row tiles of which one row is real (tl.dot needs 16): the
registers, shared memory and layout changes of the other 15 rows cost programs per SM and
latency, where at decode sizes the bytes in flight set the time. These kernels keep one row:
the shrink fills, and the expand reads, the same workspace cells as the split variant's
(WS_ROWS 1), so either pairs with the other's tl.dot half, the fused SiLU-and-mul and the side
stream. A config selects them with `gemv_shrink` and `gemv_expand`.
"""

import triton
import triton.language as tl

from loraplex.kernels.ops.shared import (
    MOE_BATCH_ARGS,
    gemv_delta,
    gemv_partials,
    load_b,
    load_prior,
    naive_unit,
    slice_base,
)


@triton.jit(do_not_specialize=MOE_BATCH_ARGS)
def moe_lora_gemv_shrink_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    ws_ptr,
    expert_ids_ptr,
    tlm_ptr,
    enabled_ptr,
    K,
    top_k,
    num_units,
    max_loras,
    stride_xm,
    stride_xk,
    stride_al,
    stride_ae,
    stride_ar,
    stride_ak,
    TOKEN_FACTOR: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The shrink of the naive form (one pair per unit) as a GEMV on CUDA cores: the same
    workspace cells as `moe_lora_shrink_kernel` with WS_ROWS 1, ws[s, pair, ks, 0, :] =
    x[row, K range ks] @ A[s][slot, expert][:, K range ks].T. The wrapper sizes BLOCK_K to the
    whole K range, so each program issues all its loads of A at once, where the tl.dot shrink
    streams its range in BLOCK_K steps through 16-row tiles of which one row is real: at decode
    sizes it is the bytes in flight, not the multiply, that set the time."""
    unit = tl.program_id(0)
    s = tl.program_id(1)
    ks = tl.program_id(2)
    if USE_PDL:  # as in moe_lora_shrink_kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot, expert, valid = naive_unit(unit, expert_ids_ptr, tlm_ptr, enabled_ptr, top_k, max_loras)
    if valid == 0:
        return
    a_base = slice_base(a0_ptr, a1_ptr, s, slot, expert, stride_al, stride_ae)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    safe_r = tl.where(rmask, offs_r, 0)
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), 64) * 64
    k_lo = ks * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    x_row = x_ptr + (unit // TOKEN_FACTOR).to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        kmask = offs_k < k_hi
        xv = tl.load(x_row + offs_k * stride_xk, mask=kmask, other=0.0)
        a = tl.load(a_base + safe_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                    mask=rmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(a.to(tl.float32) * xv.to(tl.float32)[None, :], 1)
    cell = ((s * num_units + unit).to(tl.int64) * SPLIT_K + ks) * BLOCK_R
    tl.store(ws_ptr + cell + offs_r, acc)


@triton.jit(do_not_specialize=MOE_BATCH_ARGS)
def moe_lora_gemv_expand_kernel(
    ws_ptr,
    b0_ptr,
    b1_ptr,
    out_ptr,
    topk_w_ptr,
    expert_ids_ptr,
    tlm_ptr,
    enabled_ptr,
    N,
    top_k,
    num_units,
    max_loras,
    col_offset,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    stride_om,
    stride_on,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SLICES: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """output[pair, col_offset + s*N + n] (+)= (sum_ks ws[s, pair, ks, 0, :]) @ B[s][slot,
    expert][n, :] (* the pair's routing weight) for the BLOCK_N columns n of this program.

    Programs of one pair are adjacent (N fastest, then slice), as in the tl.dot expand. Under
    PDL everything but the partial products loads before the wait: the pair's slot and expert,
    its B columns and output row. The product is rounded to the output's dtype before the add,
    as the tl.dot expand (and vLLM) round it.
    """
    groups = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    group = pid % groups
    rest = pid // groups
    s = rest % SLICES
    unit = rest // SLICES
    slot, expert, valid = naive_unit(unit, expert_ids_ptr, tlm_ptr, enabled_ptr, top_k, max_loras)
    if valid == 0:
        return
    offs_n = group * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    b_base = slice_base(b0_ptr, b1_ptr, s, slot, expert, stride_bl, stride_be)
    b = load_b(b_base, offs_n, N, stride_bn, stride_br, BLOCK_R, RANK)
    out_ptrs = out_ptr + unit.to(tl.int64) * stride_om + (col_offset + s * N + offs_n) * stride_on
    prior = load_prior(out_ptrs, nmask, ADD_INPUTS)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_w_ptr + unit).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    cell = ws_ptr + (s * num_units + unit).to(tl.int64) * SPLIT_K * BLOCK_R
    acc = gemv_delta(b, gemv_partials(cell, SPLIT_K, BLOCK_R))
    if MUL_ROUTED_WEIGHT:
        acc = acc * weight
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty) + prior, mask=nmask)
