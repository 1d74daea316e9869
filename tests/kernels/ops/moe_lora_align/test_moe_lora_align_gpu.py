"""Our align kernels against vLLM 0.26's own `moe_lora_align_block_size` CUDA op on the GPU, on
identical routing, group by group; and through the plugin's custom op, which serves large
batches with ours and small ones with vLLM's.

    PYTHONPATH=/tmp/site:. python3 -m pytest -m gpu tests/kernels/ops/moe_lora_align
"""

from __future__ import annotations

import pytest
import torch

from tests.support.moe_lora_cases import assert_same_groups

pytestmark = pytest.mark.gpu


def _buffers(pairs: int, experts: int, block: int, slots: int) -> tuple:
    from loraplex.kernels.ops.moe_lora_align.reference import sorted_form_size

    padded, blocks = sorted_form_size(pairs, experts, block)
    st = torch.full((slots * padded,), -7, dtype=torch.int32, device="cuda")
    eids = torch.full((slots * blocks,), -1, dtype=torch.int32, device="cuda")
    ntpp = torch.full((slots,), -7, dtype=torch.int32, device="cuda")
    return padded, blocks, st, eids, ntpp


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block"),
    [(64, 8, 128, 32), (1000, 8, 128, 64), (25600, 8, 128, 128), (6400, 4, 32, 128)],
)
@pytest.mark.parametrize("through", ["kernels", "plugin_op"])
def test_matches_vllm_align(tokens: int, top_k: int, experts: int, block: int,
                            through: str) -> None:  # fmt: skip
    from vllm import _custom_ops as vllm_ops

    from loraplex.kernels.ops.moe_lora_align.op import moe_lora_align_block_size
    from loraplex.kernels.vllm.plugin import PluginState, register

    assert register(enabled=True) in (PluginState.PATCHED, PluginState.ALREADY)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    slots = 8
    topk = torch.randint(0, experts, (tokens, top_k), device="cuda", generator=gen).int()
    # 16 requests in runs, round robin over the slots, one run without adapter.
    run = torch.arange(tokens, device="cuda") * 16 // tokens
    tlm = torch.where(run == 5, -1, run % slots).int()
    enabled = torch.ones(slots + 1, dtype=torch.int32, device="cuda")
    lora_ids = torch.full((slots + 1,), -1, dtype=torch.int32, device="cuda")
    active = torch.unique(tlm).int()
    lora_ids[: active.numel()] = active
    padded, blocks, st, eids, ntpp = _buffers(topk.numel(), experts, block, slots)
    # vLLM's CUDA op itself: its Python name is ours once the plugin has registered.
    torch.ops._moe_C.moe_lora_align_block_size(topk, tlm, experts, block, slots, padded, blocks,
                                               st, eids, ntpp, enabled, lora_ids, None)  # fmt: skip
    _, _, st2, eids2, ntpp2 = _buffers(topk.numel(), experts, block, slots)
    if through == "kernels":
        moe_lora_align_block_size(topk, tlm, experts, block, slots, padded, blocks, st2, eids2,
                                  ntpp2, enabled)  # fmt: skip
    else:  # vLLM's name, as punica_gpu calls it once the plugin has registered
        vllm_ops.moe_lora_align_block_size(topk, tlm, experts, block, slots, padded, blocks, st2,
                                           eids2, ntpp2, enabled, lora_ids, None)  # fmt: skip
    assert torch.equal(ntpp2, ntpp)
    assert torch.equal(eids2, eids)
    assert_same_groups(st2.view(slots, -1).cpu(), st.view(slots, -1).cpu(),
                       eids.view(slots, -1).cpu(), block)  # fmt: skip
