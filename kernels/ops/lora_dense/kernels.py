"""Triton bodies of the dense (attention) LoRA op for decode batches (launcher: `op`).

One program per token and work item, as GEMVs (a decode batch has one to a few dozen tokens, so
a matrix tile would be mostly padding): `lora_dense_shrink_kernel` (grid tokens x slices x SPLIT_K)
writes scale * x[t, K range] @ A[s][slot].T for one K range to a fp32 workspace;
`lora_dense_expand_kernel` (grid tokens x N tiles x slices) sums the K ranges, rounds to the
weights' dtype as vLLM does, multiplies by its B tile and adds into its columns of y. Up to three
slices (q, k, v) with their own widths; one shrink launch and one expand launch per layer call,
both under Programmatic Dependent Launch: the shrink's launch overlaps the tail of the kernel
before it, and the expand starts while the shrink runs. vLLM 0.26 spends three launches (shrink,
a memset of its buffer, expand) per call.
"""

import triton
import triton.language as tl

from loraplex.kernels.ops.shared import pick, slice_b


@triton.jit(do_not_specialize=["num_tokens"])
def lora_dense_shrink_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    ws_ptr,
    tlm_ptr,
    scale,
    K,
    num_tokens,
    max_loras,
    stride_xm,
    stride_al,
    stride_ar,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """ws[s, t, ks, :] = scale * x[t, K range ks] @ A[s][slot(t)][:, K range ks].T (fp32)."""
    t = tl.program_id(0)
    s = tl.program_id(1)
    ks = tl.program_id(2)
    if USE_PDL:
        # Launched under PDL as well, after whatever kernel came before: wait for its writes
        # (x, the routing, the output the expand loads before its own wait), then let the
        # expand launch. The launch itself overlaps the previous kernel's tail.
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    slot = tl.load(tlm_ptr + t)
    if (slot < 0) | (slot >= max_loras):
        return
    a_base = pick(s, a0_ptr, a1_ptr, a2_ptr) + slot.to(tl.int64) * stride_al
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < RANK
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = ks * k_per
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k in range(k_lo, tl.minimum(k_lo + k_per, K), BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        x = tl.load(x_ptr + t.to(tl.int64) * stride_xm + offs_k, mask=kmask, other=0.0)
        a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    cell = ((s * num_tokens + t).to(tl.int64) * SPLIT_K + ks) * BLOCK_R
    tl.store(ws_ptr + cell + offs_r, acc * scale)


@triton.jit(do_not_specialize=["num_tokens"])
def lora_dense_expand_kernel(
    ws_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    tlm_ptr,
    n0,
    n1,
    n2,
    num_tokens,
    max_loras,
    stride_ym,
    stride_bl0,
    stride_bl1,
    stride_bl2,
    stride_bn,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[t, col(s) + n tile] (+)= (sum_ks ws[s, t, ks]) @ B[s][slot(t)][n tile].T."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    slot = tl.load(tlm_ptr + t)
    n, col0, b_base = slice_b(s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, stride_bl0, stride_bl1,
                               stride_bl2, slot)  # fmt: skip
    if (slot < 0) | (slot >= max_loras) | (pid_n * BLOCK_N >= n):
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    nmask = offs_n < n
    b = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=nmask[:, None] & (offs_r < RANK)[None, :], other=0.0)  # fmt: skip
    ptrs = y_ptr + t.to(tl.int64) * stride_ym + col0 + offs_n
    # y was written before the shrink let this grid launch, so it loads before the wait too.
    prior = tl.load(ptrs, mask=nmask, other=0.0) if ADD_INPUTS else 0.0
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    cell = (s * num_tokens + t).to(tl.int64) * SPLIT_K * BLOCK_R
    tmp = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for ks in tl.static_range(SPLIT_K):
        tmp += tl.load(ws_ptr + cell + ks * BLOCK_R + offs_r)
    tmp = tmp.to(b.dtype).to(tl.float32)
    out = tl.sum(b.to(tl.float32) * tmp[None, :], axis=1)
    # Rounded to y's dtype before the add, as vLLM's expand does, so that greedy decoding
    # follows stock vLLM's numbers (an fp32 add flipped a near-tie token in the e2e check).
    tl.store(ptrs, out.to(y_ptr.dtype.element_ty) + prior, mask=nmask)
