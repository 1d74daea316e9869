"""The configs the tuner offers per call and batch, and the keys it files them under."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from bench.kernels.moe_lora_workload import SHAPES, CallSpec
from bench.kernels.tune_moe_lora import candidates, fuses_activation, shape_key
from loraplex.kernels.dispatch import REGIMES
from loraplex.kernels.ops.moe_lora import op
from loraplex.kernels.ops.moe_lora.configs import Gpu, ShapeKey


def test_gemv_shrink_is_a_candidate_of_the_naive_form_only() -> None:
    """Offered at decode in the naive form, over K ranges of at least 64 (K = 768: up to 8)."""
    naive = [c for c in candidates(768, 32, 1, naive=True) if c.gemv_shrink]
    assert sorted({c.split_k for c in naive}) == [2, 4, 8]
    assert {c.num_warps for c in naive} == {4, 8}
    assert not any(c.gemv_shrink for c in candidates(768, 32, 1))


def test_sorted_decode_candidates_expand_over_more_n_tiles() -> None:
    """Sorted decode (below the prefill pair count): half and quarter blocks over 4 to 16 N
    tiles; the naive form gets GEMV candidates instead."""
    wide = {(c.expand_parts, c.expand_tiles) for c in candidates(2880, 256, 2)}
    assert {(parts, tiles) for parts in (2, 4) for tiles in (4, 8, 16)} <= wide
    naive = {(c.expand_parts, c.expand_tiles) for c in candidates(2880, 16, 2, naive=True)}
    assert not naive & {(4, 4), (4, 8), (4, 16)}


def test_gemv_expand_is_a_candidate_of_the_naive_form_only() -> None:
    """Offered at decode in the naive form after both shrinks, over 128 to 1,024 columns, and
    after a tl.dot shrink of two stages over one or two K ranges."""
    naive = [c for c in candidates(2048, 32, 2, naive=True) if c.gemv_expand]
    assert {c.gemv_shrink for c in naive} == {False, True}
    assert {c.block_n for c in naive} == {128, 256, 512, 1024}
    two_stages = {(c.split_k, c.block_n) for c in naive if c.num_stages == 2}
    assert two_stages == {(s, n) for s in (1, 2) for n in (128, 256, 512, 1024)}
    assert not any(c.gemv_shrink for c in naive if c.num_stages == 2)
    assert not any(c.gemv_expand for c in candidates(2048, 32, 2))


def test_prefill_gate_up_before_a_fused_activation_tunes_only_configs_that_fuse_it() -> None:
    # The plugin fuses a split config's gate/up expand into the activation; a fused variant
    # would lose that pass at prefill sizes. At decode sizes both kinds stay candidates.
    prefill = candidates(2048, REGIMES.prefill_min_pairs, 2, fused_activation=True)
    assert prefill and all(c.variant == "split" for c in prefill)
    assert any(c.variant == "fused" for c in candidates(2048, REGIMES.prefill_min_pairs, 2))
    assert any(c.variant == "fused" for c in candidates(2048, 2048, 2, fused_activation=True))
    assert fuses_activation(SHAPES["qwen3-30b-a3b"], "w13")
    assert not fuses_activation(SHAPES["qwen3-30b-a3b"], "w2")
    assert fuses_activation(SHAPES["gpt-oss-20b"], "w13")  # swigluoai on one interleaved slice
    assert not fuses_activation(SHAPES["gpt-oss-20b"], "w2")
    # Each activation is fused on its own layout only.
    assert not fuses_activation(dataclasses.replace(SHAPES["gpt-oss-20b"], lora_3d=False), "w13")
    assert not fuses_activation(dataclasses.replace(SHAPES["qwen3-30b-a3b"], lora_3d=True), "w13")


class _LookedUp(Exception):
    """Raised by the stand-in lookup: the op has built its key, nothing is launched."""


@pytest.mark.parametrize(
    ("name", "slices", "n", "expected"),
    [
        # FusedMoE3DWithLoRA: one A (L, E, R, hidden), one B (L, E, 2 x inter, R)
        ("gpt-oss-20b", 1, 5760, ShapeKey(2880, 5760, 1, 32, 32, 4, False, "torch.bfloat16")),
        # FusedMoEWithLoRA: a gate and an up slice of inter rows
        ("qwen3-30b-a3b", 2, 768, ShapeKey(2048, 768, 2, 32, 128, 8, False, "torch.bfloat16")),
    ],
)
def test_gate_up_is_tuned_under_the_key_the_op_looks_up_for_vllms_call(
    monkeypatch: pytest.MonkeyPatch, name: str, slices: int, n: int, expected: ShapeKey
) -> None:
    """The tuner's key for a model's gate/up call is the one our op looks up when vLLM 0.26
    calls it with that model's buffers (16 decode tokens, naive form, 8 slots, rank 32; shapes
    only, on the meta device)."""
    shape = SHAPES[name]
    tuned = shape_key(shape, CallSpec.of(shape, "w13"), 32, False, str(torch.bfloat16))
    assert tuned == expected
    keys: list[ShapeKey] = []

    def lookup(gpu: Gpu, key: ShapeKey, *args: Any) -> None:
        keys.append(key)
        raise _LookedUp

    monkeypatch.setattr(op, "lookup", lookup)
    tokens, slots, rank, e, k = 16, 8, 32, shape.experts, shape.top_k

    def meta(*size: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device="meta")

    a = tuple(meta(slots, e, rank, shape.hidden) for _ in range(slices))
    b = tuple(meta(slots, e, n, rank) for _ in range(slices))
    lora_ids = torch.arange(slots + 1, dtype=torch.int32, device="meta")
    with pytest.raises(_LookedUp):
        op.fused_moe_lora(
            meta(tokens, k, 2 * shape.inter), meta(tokens, shape.hidden), a, b,
            meta(tokens, k, dtype=torch.float32), None, meta(tokens * k, dtype=torch.int32),
            None, meta(tokens, dtype=torch.int32), rank, k, lora_ids,
            torch.tensor([slots + 1], dtype=torch.int32), meta(slots + 1, dtype=torch.int32),
        )  # fmt: skip
    assert keys == [tuned]
