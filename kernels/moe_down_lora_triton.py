"""Triton body of vLLM's down-projection expert GEMM with the down LoRA added in its epilogue
(launcher: `moe_down_lora`; spec: `moe_lora_reference.expert_gemm_with_lora_reference`).

vLLM's fused experts write the down GEMM's output per (token, expert) pair into a buffer, and
the MoE-LoRA op then reads and writes that buffer again to add the LoRA: at a prefill of 16 x
1600 tokens (Qwen3-30B-A3B, 204,800 pairs x 2,048 columns) 1.68 GB of traffic per MoE layer,
the largest item of the LoRA's prefill time. Here the GEMM's tiles get the LoRA before they are
stored, and the buffer is written once.

The base part is vLLM 0.26's `fused_moe_kernel` for unquantized weights without bias: the same
tiles, grouping and rounding, launched with vLLM's own tuned config. A tile's rows share an
expert but not an adapter, so the epilogue takes the tile's active slots one by one: for each
present, one dot of the rows on that slot (the others zeroed) with that slot's B tile. The
rank-sized rows come from the MoE-LoRA shrink (`moe_lora_shrink_kernel` with PAIR_ROWS), one per
pair, already in the output dtype.

Rounding follows the unfused path: the base tile is scaled by the routing weight and rounded, as
vLLM stores it; the LoRA delta is scaled, rounded and added, as our expand adds it.
"""

import triton
import triton.language as tl

from .moe_lora_triton import _load_b, _pair_lora


@triton.jit(do_not_specialize=["EM", "num_valid_pairs", "lora_dim"])
def expert_gemm_with_lora_kernel(
    a_ptr,
    w_ptr,
    c_ptr,
    topk_w_ptr,
    sorted_ptr,
    expert_ids_ptr,
    ntpp_ptr,
    t_ptr,
    lora_b_ptr,
    tlm_ptr,
    lora_ids_ptr,
    enabled_ptr,
    N,
    K,
    EM,
    num_valid_pairs,
    lora_top_k,
    lora_dim,
    max_loras,
    stride_am,
    stride_ak,
    stride_we,
    stride_wk,
    stride_wn,
    stride_cm,
    stride_cn,
    stride_bl,
    stride_be,
    stride_bn,
    stride_br,
    BLOCK_SIZE_M: tl.constexpr,
    BLOCK_SIZE_N: tl.constexpr,
    BLOCK_SIZE_K: tl.constexpr,
    GROUP_SIZE_M: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    RANK: tl.constexpr,
    LORA_PAD: tl.constexpr,
):
    """c[p, n] = round(round(a[p] @ w[e].T * wt[p]) + round(t[p] @ B[slot(p), e].T * wt[p]))
    for the pairs p of each sorted block (expert e), where the delta is 0 for pairs no LoRA
    program covers (`_pair_lora`) and wt is 1 without MUL_ROUTED_WEIGHT.

    a (pairs, K), w (E, N, K), c rows of pairs with stride_cm, t (pairs, BLOCK_R) the shrink's
    rows, B (L, E, N, R); sorted_ptr, expert_ids_ptr, ntpp_ptr: vLLM's expert-sorted blocks.
    """
    pid = tl.program_id(axis=0)
    num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)
    num_pid_n = tl.cdiv(N, BLOCK_SIZE_N)
    num_pid_in_group = GROUP_SIZE_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_SIZE_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_SIZE_M >= tl.load(ntpp_ptr):
        return
    offs = tl.arange(0, BLOCK_SIZE_M).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_SIZE_M + offs).to(tl.int64)
    pmask = pairs < num_valid_pairs
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    offs_wn = (pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N).to(tl.int64)) % N
    offs_k = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = a_ptr + pairs[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_k[:, None] * stride_wk + offs_wn[None, :] * stride_wn
    acc = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_SIZE_K)):
        a = tl.load(a_ptrs, mask=pmask[:, None] & (offs_k[None, :] < K - k * BLOCK_SIZE_K),
                    other=0.0)  # fmt: skip
        w = tl.load(w_ptrs, mask=offs_k[:, None] < K - k * BLOCK_SIZE_K, other=0.0)
        acc += tl.dot(a, w)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        w_ptrs += BLOCK_SIZE_K * stride_wk
    if MUL_ROUTED_WEIGHT:
        weights = tl.load(topk_w_ptr + pairs, mask=pmask, other=0).to(tl.float32)
    else:
        weights = tl.full((BLOCK_SIZE_M,), 1.0, tl.float32)
    out = (acc * weights[:, None]).to(c_ptr.dtype.element_ty)

    slots, covered = _pair_lora(pairs, pmask, expert_ids_ptr, tlm_ptr, lora_ids_ptr, enabled_ptr,
                                lora_top_k, lora_dim, max_loras, True, LORA_PAD)  # fmt: skip
    offs_cn = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    c_mask = pmask[:, None] & (offs_cn[None, :] < N)
    if tl.sum(covered.to(tl.int32), 0) > 0:
        offs_r = tl.arange(0, BLOCK_R)
        t = tl.load(t_ptr + pairs[:, None] * BLOCK_R + offs_r[None, :], mask=covered[:, None],
                    other=0.0)  # fmt: skip
        delta = tl.zeros((BLOCK_SIZE_M, BLOCK_SIZE_N), dtype=tl.float32)
        left = covered
        for i in range(0, lora_dim):
            slot = tl.load(lora_ids_ptr + i)
            mine = left & (slots == slot)
            if tl.sum(mine.to(tl.int32), 0) > 0:
                b_base = lora_b_ptr + slot.to(tl.int64) * stride_bl + expert * stride_be
                b = _load_b(b_base, offs_cn, N, stride_bn, stride_br, BLOCK_R, RANK)
                delta += tl.dot(tl.where(mine[:, None], t, 0.0), b)
                left = left & ~mine  # a slot listed twice adds once
        out = (delta * weights[:, None]).to(c_ptr.dtype.element_ty) + out
    tl.store(c_ptrs, out, mask=c_mask)
