"""vLLM's down-projection expert GEMM with the down LoRA in its epilogue: checks and launch
(kernel: `moe_down_lora_triton`; spec: `moe_lora_reference.expert_gemm_with_lora_reference`).

Used by the vLLM plugin (`moe_down_fusion`): vLLM's fused experts run the base down GEMM into
their pair buffer, then the MoE-LoRA op adds the down LoRA into it. The plugin holds the GEMM
back (`moe_lora_op.down_gemm_held`); the op runs its shrink only and hands the rows here, and
the GEMM runs once with the LoRA added before its tiles are stored.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import triton

from .moe_down_lora_triton import expert_gemm_with_lora_kernel
from .moe_lora_op import DownLora

# The keys of vLLM's fused-MoE configs on CUDA; a config with others (ROCm's) is not ours.
# SPLIT_K is there and ignored, as vLLM's launcher sets it to 1.
CONFIG_KEYS = frozenset(
    {"BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "SPLIT_K", "num_warps",
     "num_stages"}
)  # fmt: skip


def expert_gemm_with_lora(
    a: torch.Tensor,
    w: torch.Tensor,
    c: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    config: Mapping[str, int],
    mul_routed_weight: bool,
    lora: DownLora,
) -> None:
    """c[p] = round(a[p] @ w[e].T * wt[p]) + round(rows[p] @ B[slot(p), e].T * wt[p]) for each
    pair p of vLLM's expert-sorted blocks (expert e), the LoRA term only for pairs with LoRA.

    a: (P, K) one row per (token, expert) pair; w: (E, N, K); c: (T, top_k, N) with P = T x
    top_k, written only at the sorted pairs; topk_weights (T, top_k) fp32; sorted_token_ids
    (EM,), expert_ids (EM / BLOCK_SIZE_M,), num_tokens_post_padded (1,): vLLM's
    `moe_align_block_size` for `config`'s BLOCK_SIZE_M; config: vLLM's fused-MoE config.
    Raises ValueError for shapes that do not fit together.
    """
    pairs, k = a.shape
    experts, n, _ = w.shape
    if w.shape[2] != k or w.stride(2) != 1 or a.dtype != w.dtype or c.dtype != w.dtype:
        raise ValueError(f"w {tuple(w.shape)} {w.dtype} must be (E, N, K={k}), K contiguous, of "
                         f"a's dtype {a.dtype} and c's {c.dtype}")  # fmt: skip
    if c.dim() != 3 or c.shape[0] * c.shape[1] != pairs or c.shape[2] != n:
        raise ValueError(f"c {tuple(c.shape)} must be (tokens, top_k, N={n}) for {pairs} pairs")
    if c.stride(0) != c.shape[1] * c.stride(1) or topk_weights.shape != c.shape[:2]:
        raise ValueError(
            f"c strides {c.stride()} must flatten (tokens, top_k), and topk_weights "
            f"{tuple(topk_weights.shape)} be (tokens, top_k)"
        )
    if not topk_weights.is_contiguous():
        raise ValueError(f"topk_weights strides {topk_weights.stride()} must be contiguous")
    lora_shape = (lora.max_loras, experts, n, lora.rank)
    if tuple(lora.b.shape) != lora_shape or lora.rows.shape[0] != pairs:
        raise ValueError(f"LoRA B {tuple(lora.b.shape)} must be {lora_shape} and its rows "
                         f"{tuple(lora.rows.shape)} one per pair ({pairs})")  # fmt: skip
    if not CONFIG_KEYS.issuperset(config):
        raise ValueError(f"config {dict(config)} has keys beyond a CUDA fused-MoE config's")
    block_m, block_n = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"]
    em = sorted_token_ids.numel()
    grid = (triton.cdiv(em, block_m) * triton.cdiv(n, block_n),)
    expert_gemm_with_lora_kernel[grid](
        a, w, c, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded,
        lora.rows, lora.b, lora.token_lora_mapping, lora.lora_ids, lora.adapter_enabled,
        n, k, em, pairs, lora.top_k, lora.lora_dim, lora.max_loras,
        a.stride(0), a.stride(1), w.stride(0), w.stride(2), w.stride(1), c.stride(1),
        c.stride(2), *lora.b.stride(),
        BLOCK_SIZE_M=block_m, BLOCK_SIZE_N=block_n, BLOCK_SIZE_K=config["BLOCK_SIZE_K"],
        GROUP_SIZE_M=config["GROUP_SIZE_M"], MUL_ROUTED_WEIGHT=mul_routed_weight,
        BLOCK_R=lora.rows.shape[1], RANK=lora.rank, LORA_PAD=lora.lora_pad,
        num_warps=config.get("num_warps", 4), num_stages=config.get("num_stages", 3),
    )  # fmt: skip
