"""Triton body of the dense (attention) LoRA for decode batches (launcher: `op.lora_dense`).

One program per token and work item, as GEMVs (a decode batch has one to a few dozen tokens, so
a matrix tile would be mostly padding), all in one grid: its first tokens x slices x SPLIT_K
programs shrink, each writing scale * x[t, K range] @ A[s][slot].T for one K range to a fp32
workspace; the rest (tokens x N tiles x slices) expand, each summing its token and slice's K
ranges, rounding to the weights' dtype as vLLM does, multiplying by its B tile and adding into
its columns of y. Up to three slices (q, k, v) with their own widths. One launch per layer call,
under Programmatic Dependent Launch: it overlaps the tail of the kernel before it. vLLM 0.26
spends three launches (shrink, a memset of its buffer, expand) per call.

An expand program loads its B tile, then waits for the SPLIT_K shrink programs of its own
(token, slice) only, on a counter they raise as they finish. Waiting inside a grid is safe
because the shrink programs have the lower ids: the GPU hands out a grid's programs in id order,
so every shrink program has an SM before any expand program spins, and none of them waits on
anything but the kernel before (`gdc_wait`). The counters come in pairs per (slice, token): the
shrinks done, and the expand programs past their wait; the last of those puts both back to 0,
so the cells are zero between launches without a memset.
"""

import triton
import triton.language as tl

from loraplex.kernels.ops.shared import pick, slice_b


@triton.jit
def _shrink_part(x_ptr, a0_ptr, a1_ptr, a2_ptr, ws_ptr, done_ptr, slot, scale, K, t, s, ks,
                 num_tokens, stride_xm, stride_al, stride_ar, BLOCK_R: tl.constexpr,
                 RANK: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):  # fmt: skip
    """ws[s, t, ks, :] = scale * x[t, K range ks] @ A[s][slot][:, K range ks].T (fp32), then
    one more on (s, t)'s counter of finished shrinks."""
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
    # Every thread's store before the count: the barrier orders them before thread 0's
    # release, which publishes them to the program that sees the count.
    tl.debug_barrier()
    tl.atomic_add(done_ptr + s * num_tokens + t, 1, sem="release")


@triton.jit
def _expand_part(ws_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, done_ptr, passed_ptr, slot, t, pid_n, s,
                 n0, n1, n2, num_tokens, stride_ym, stride_bl0, stride_bl1, stride_bl2,
                 stride_bn, BLOCK_R: tl.constexpr, RANK: tl.constexpr, BLOCK_N: tl.constexpr,
                 SPLIT_K: tl.constexpr, ADD_INPUTS: tl.constexpr,
                 USE_PDL: tl.constexpr):  # fmt: skip
    """y[t, col(s) + n tile] (+)= (sum_ks ws[s, t, ks]) @ B[s][slot][n tile].T, once (s, t)'s
    SPLIT_K shrinks are done."""
    n, col0, b_base = slice_b(s, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, stride_bl0, stride_bl1,
                               stride_bl2, slot)  # fmt: skip
    if pid_n * BLOCK_N < n:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        nmask = offs_n < n
        # B first: its read overlaps the shrinks and the kernel before.
        b = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :],
                    mask=nmask[:, None] & (offs_r < RANK)[None, :], other=0.0)  # fmt: skip
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        ptrs = y_ptr + t.to(tl.int64) * stride_ym + col0 + offs_n
        prior = tl.load(ptrs, mask=nmask, other=0.0) if ADD_INPUTS else 0.0
        counter = s * num_tokens + t
        while tl.atomic_add(done_ptr + counter, 0, sem="acquire") < SPLIT_K:
            pass
        cell = (s * num_tokens + t).to(tl.int64) * SPLIT_K * BLOCK_R
        tmp = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for ks in tl.static_range(SPLIT_K):
            # From L2 (.cg): the shrinks wrote these cells from other SMs during this launch.
            tmp += tl.load(ws_ptr + cell + ks * BLOCK_R + offs_r, cache_modifier=".cg")
        tmp = tmp.to(b.dtype).to(tl.float32)
        out = tl.sum(b.to(tl.float32) * tmp[None, :], axis=1)
        # Rounded to y's dtype before the add, as vLLM's expand does, so that greedy decoding
        # follows stock vLLM's numbers (an fp32 add flipped a near-tie token in the e2e check).
        tl.store(ptrs, out.to(y_ptr.dtype.element_ty) + prior, mask=nmask)
        # The last of (s, t)'s expand programs past the wait zeroes both counters.
        readers = tl.cdiv(n, BLOCK_N)
        if tl.atomic_add(passed_ptr + counter, 1, sem="relaxed") == readers - 1:
            tl.atomic_xchg(done_ptr + counter, 0, sem="relaxed")
            tl.atomic_xchg(passed_ptr + counter, 0, sem="relaxed")


@triton.jit(do_not_specialize=["num_tokens", "n_tiles"])
def lora_dense_kernel(
    x_ptr,
    a0_ptr,
    a1_ptr,
    a2_ptr,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    y_ptr,
    ws_ptr,
    sync_ptr,
    tlm_ptr,
    scale,
    K,
    n0,
    n1,
    n2,
    num_tokens,
    n_tiles,
    max_loras,
    stride_xm,
    stride_al,
    stride_ar,
    stride_ym,
    stride_bl0,
    stride_bl1,
    stride_bl2,
    stride_bn,
    SLICES: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    ADD_INPUTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Programs [0, tokens x SLICES x SPLIT_K) shrink, the rest expand (module docstring).
    sync: 2 x SLICES x tokens int32 cells, zero at launch and again at exit."""
    pid = tl.program_id(0)
    shrinks = num_tokens * SLICES * SPLIT_K
    is_shrink = pid < shrinks
    q = tl.where(is_shrink, pid, pid - shrinks)
    t = tl.where(is_shrink, q // (SLICES * SPLIT_K), q // (n_tiles * SLICES))
    slot = tl.load(tlm_ptr + t)
    if (slot >= 0) & (slot < max_loras):
        done_ptr = sync_ptr
        if is_shrink:
            if USE_PDL:
                # Launched under PDL after whatever kernel came before: wait for its writes (x,
                # and the counters' reset by an earlier launch), then let the next launch.
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            _shrink_part(x_ptr, a0_ptr, a1_ptr, a2_ptr, ws_ptr, done_ptr, slot, scale, K, t,
                         (q // SPLIT_K) % SLICES, q % SPLIT_K, num_tokens, stride_xm, stride_al,
                         stride_ar, BLOCK_R, RANK, BLOCK_K, SPLIT_K)  # fmt: skip
        else:
            if USE_PDL:
                tl.extra.cuda.gdc_launch_dependents()
            _expand_part(ws_ptr, b0_ptr, b1_ptr, b2_ptr, y_ptr, done_ptr,
                         sync_ptr + SLICES * num_tokens, slot, t, (q // SLICES) % n_tiles,
                         q % SLICES, n0, n1, n2, num_tokens, stride_ym, stride_bl0, stride_bl1,
                         stride_bl2, stride_bn, BLOCK_R, RANK, BLOCK_N, SPLIT_K, ADD_INPUTS,
                         USE_PDL)  # fmt: skip
