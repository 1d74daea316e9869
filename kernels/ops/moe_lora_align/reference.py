"""Plain-torch spec of the sorted routing form, as vLLM 0.26's `moe_lora_align_block_size` CUDA
op writes it: what `op.moe_lora_align_block_size` is held to, and the routing the MoE-LoRA
references and benchmarks build (names as in `kernels/ops/moe_lora/reference.py`)."""

from __future__ import annotations

import torch


def sorted_form_size(num_pairs: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """(EM, blocks) of vLLM's sorted form per slot (`PunicaWrapperGPU.moe_lora_align_block_size`):
    EM = P + E * (block_size - 1), room for every expert group's padding, or P * block_size when
    P < E; blocks = cdiv(EM, block_size)."""
    em = (
        num_pairs * block_size
        if num_pairs < num_experts
        else num_pairs + num_experts * (block_size - 1)
    )
    return em, -(-em // block_size)


def moe_lora_align_reference(
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    num_experts: int,
    block_size: int,
    max_loras: int,
    adapter_enabled: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sorted routing form, as vLLM's `moe_lora_align_block_size` CUDA op writes it.

    topk_ids: (T, k) int32; token_lora_mapping: (T,) int32.
    Returns sorted_token_ids (L, EM) int32 (padding = P), expert_ids (L, EM // block_size) int32
    (-1 for unused blocks) and num_tokens_post_padded (L,) int32, with EM as in
    `sorted_form_size`.
    Per slot, pairs are grouped by expert in ascending expert order, each group padded to a
    multiple of block_size; within a group pairs keep ascending flat id order.
    """
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    em, num_blocks = sorted_form_size(num_pairs, num_experts, block_size)
    sorted_ids = torch.full((max_loras, em), num_pairs, dtype=torch.int32)
    block_experts = torch.full((max_loras, num_blocks), -1, dtype=torch.int32)
    used = torch.zeros(max_loras, dtype=torch.int32)
    flat = topk_ids.reshape(-1).cpu().long()
    pair_slot = token_lora_mapping.cpu().long().repeat_interleave(top_k)
    for slot in range(max_loras):
        if int(adapter_enabled[slot]) == 0:
            continue
        mine = torch.nonzero((pair_slot == slot) & (flat >= 0)).flatten()
        order = torch.sort(flat[mine], stable=True).indices
        pairs, experts = mine[order], flat[mine][order]
        pos, start = 0, 0
        groups = torch.unique_consecutive(experts, return_counts=True)
        for expert, count in zip(*groups, strict=True):
            n = int(count)
            sorted_ids[slot, pos : pos + n] = pairs[start : start + n].to(torch.int32)
            padded = -(-n // block_size) * block_size
            block_experts[slot, pos // block_size : (pos + padded) // block_size] = int(expert)
            pos, start = pos + padded, start + n
        used[slot] = pos
    dev = topk_ids.device
    return sorted_ids.to(dev), block_experts.to(dev), used.to(dev)
