"""Our align kernels (`moe_lora_align`) against the spec of vLLM's CUDA op, on the CPU
interpreter: odd token counts, top-k 1 to 8, 8 to 128 experts, block sizes 16 to 64, disabled
slots, tokens without adapter and pairs without expert. Within a group the pair order is free
(the order atomics land), so each group is compared as a sorted segment."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.ops.moe_lora_align.op import moe_lora_align_block_size
from loraplex.kernels.ops.moe_lora_align.reference import moe_lora_align_reference, sorted_form_size
from tests.support.moe_lora_cases import assert_same_groups

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block", "slots", "skew"),
    [
        (1, 1, 8, 16, 1, False),
        (7, 2, 8, 16, 4, False),
        (33, 8, 128, 16, 8, False),
        (200, 4, 32, 32, 8, True),  # most pairs on two experts: long groups of many blocks
        (513, 8, 60, 64, 3, False),  # experts not a power of 2
        (1100, 8, 128, 64, 8, True),
    ],
)
def test_matches_reference(
    tokens: int, top_k: int, experts: int, block: int, slots: int, skew: bool
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    if skew:
        topk = torch.where(torch.rand(tokens, top_k, generator=gen) < 0.8,
                           torch.randint(0, 2, (tokens, top_k), generator=gen),
                           torch.randint(0, experts, (tokens, top_k), generator=gen))  # fmt: skip
    else:
        topk = torch.randint(0, experts, (tokens, top_k), generator=gen)
    topk[torch.rand(tokens, top_k, generator=gen) < 0.05] = -1  # pairs with no expert (EP)
    topk = topk.to(torch.int32)
    tlm = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    enabled = torch.ones(slots + 1, dtype=torch.int32)
    if slots > 2:
        enabled[1] = 0  # a slot whose adapter is switched off: no pairs, length 0
    em, blocks = sorted_form_size(tokens * top_k, experts, block)
    ref_sorted, ref_experts, ref_used = moe_lora_align_reference(
        topk, tlm, experts, block, slots, enabled
    )
    sorted_ids = torch.full((slots * em,), -7, dtype=torch.int32, device=DEVICE)
    expert_ids = torch.full((slots * blocks,), -7, dtype=torch.int32, device=DEVICE)
    used = torch.full((slots,), -7, dtype=torch.int32, device=DEVICE)
    moe_lora_align_block_size(topk.to(DEVICE), tlm.to(DEVICE), experts, block, slots, em, blocks,
                              sorted_ids, expert_ids, used, enabled.to(DEVICE))  # fmt: skip
    assert used.cpu().tolist() == ref_used.tolist()
    assert torch.equal(expert_ids.view(slots, blocks).cpu(), ref_experts)
    assert_same_groups(sorted_ids.view(slots, em).cpu(), ref_sorted, ref_experts, block)


def test_refuses_buffers_too_small() -> None:
    topk = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)
    tlm = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    small = torch.empty(10, dtype=torch.int32, device=DEVICE)
    ok = torch.empty(1000, dtype=torch.int32, device=DEVICE)
    enabled = torch.ones(3, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="sorted_token_ids holds 10 < max_loras x"):
        moe_lora_align_block_size(topk, tlm, 8, 16, 2, 128, 8, small, ok, ok, enabled)
    with pytest.raises(ValueError, match="block_size must be one of"):
        moe_lora_align_block_size(topk, tlm, 8, 24, 2, 128, 8, ok, ok, ok, enabled)
