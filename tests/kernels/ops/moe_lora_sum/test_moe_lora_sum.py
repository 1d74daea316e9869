"""moe_sum with the down LoRA's delta (`moe_lora_sum`) against the spec, CPU interpreter in fp32
and fp16; bf16 at prefill size runs in test_moe_lora_gpu.py on the device."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.ops.moe_lora_sum.op import moe_sum_with_delta
from loraplex.kernels.ops.moe_lora_sum.reference import moe_sum_with_delta_reference

SLOTS = 4


def _inputs(tokens: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple:
    """(experts_out, delta, token slots, adapter_enabled): slot -1, a disabled slot 1 and slot
    SLOTS (past the last) all mean no LoRA; their delta rows are NaN, which must not leak."""
    gen = torch.Generator().manual_seed(seed)
    experts_out = torch.randn(tokens, top_k, hidden, generator=gen).to(dtype)
    delta = torch.randn(tokens, top_k, hidden, generator=gen).to(dtype)
    slots = torch.randint(-1, SLOTS + 1, (tokens,), generator=gen, dtype=torch.int32)
    enabled = torch.ones(SLOTS + 1, dtype=torch.int32)
    enabled[1] = 0
    inactive = (slots < 0) | (slots >= SLOTS) | (slots == 1)
    delta[inactive] = float("nan")
    return experts_out, delta, slots, enabled


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "top_k", "hidden"),
    [(1, 1, 8), (7, 8, 700), (13, 4, 512), (33, 2, 1030)],  # odd tokens; columns past a block
)
def test_matches_reference(dtype: torch.dtype, tokens: int, top_k: int, hidden: int) -> None:
    experts_out, delta, slots, enabled = _inputs(tokens, top_k, hidden, dtype, seed=tokens)
    out = torch.full((tokens, hidden), 777.0, dtype=dtype)
    moe_sum_with_delta(experts_out, delta, slots, enabled, SLOTS, out)
    want = moe_sum_with_delta_reference(experts_out, delta, slots, enabled, SLOTS)
    assert not torch.isnan(out).any()
    tol = 1e-6 if dtype == torch.float32 else 2e-3  # fp16 rounds the sum once
    assert float((out.double() - want).norm() / want.norm()) < tol


def test_reads_only_the_first_tokens_of_a_longer_slot_map() -> None:
    """vLLM's token slot map is sized for the largest batch; only its first T entries count."""
    experts_out, delta, slots, enabled = _inputs(5, 2, 16, torch.float32, seed=3)
    longer = torch.cat([slots, torch.full((11,), 2, dtype=torch.int32)])
    out = torch.empty(5, 16)
    moe_sum_with_delta(experts_out, delta, longer, enabled, SLOTS, out)
    want = moe_sum_with_delta_reference(experts_out, delta, slots, enabled, SLOTS)
    assert torch.allclose(out.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"delta": torch.zeros(3, 2, 9)}, "delta"),
        ({"output": torch.zeros(3, 9)}, "output"),
        ({"output": torch.zeros(3, 8, dtype=torch.float16)}, "output"),
        ({"token_lora_mapping": torch.zeros(2, dtype=torch.int32)}, "fewer than"),
    ],
)
def test_mismatched_buffers_are_refused_by_name(kwargs: dict, message: str) -> None:
    args = {
        "experts_out": torch.zeros(3, 2, 8),
        "delta": torch.zeros(3, 2, 8),
        "token_lora_mapping": torch.zeros(3, dtype=torch.int32),
        "adapter_enabled": torch.ones(SLOTS + 1, dtype=torch.int32),
        "max_loras": SLOTS,
        "output": torch.zeros(3, 8),
    }
    with pytest.raises(ValueError, match=message):
        moe_sum_with_delta(**{**args, **kwargs})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_size_on_a_gpu(dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B's down output (top-8, hidden 2,048) at 4,099 tokens."""
    experts_out, delta, slots, enabled = _inputs(4099, 8, 2048, dtype, seed=1)
    gpu = [t.cuda() for t in (experts_out, delta, slots, enabled)]
    out = torch.full((4099, 2048), 777.0, dtype=dtype, device="cuda")
    moe_sum_with_delta(*gpu[:4], SLOTS, out)
    want = moe_sum_with_delta_reference(experts_out, delta, slots, enabled, SLOTS)
    got = out.double().cpu()
    assert not torch.isnan(got).any()
    assert float((got - want).norm() / want.norm()) < 1e-2  # one rounding to 8 bits
