"""The configs the tuner offers per call and batch."""

from __future__ import annotations

from bench.kernels.moe_lora_workload import SHAPES
from bench.kernels.tune_moe_lora import candidates, fuses_activation
from loraplex.kernels.dispatch import REGIMES


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


def test_prefill_gate_up_before_a_fused_silu_tunes_only_configs_that_fuse_it() -> None:
    # The plugin fuses a split config's gate/up expand into SiLU-and-mul; a fused variant
    # would lose that pass at prefill sizes. At decode sizes both kinds stay candidates.
    prefill = candidates(2048, REGIMES.prefill_min_pairs, 2, fused_activation=True)
    assert prefill and all(c.variant == "split" for c in prefill)
    assert any(c.variant == "fused" for c in candidates(2048, REGIMES.prefill_min_pairs, 2))
    assert any(c.variant == "fused" for c in candidates(2048, 2048, 2, fused_activation=True))
    assert fuses_activation(SHAPES["qwen3-30b-a3b"], "w13")
    assert not fuses_activation(SHAPES["qwen3-30b-a3b"], "w2")
    assert not fuses_activation(SHAPES["gpt-oss-20b"], "w13")  # clamped SwiGLU: vLLM's own
