"""The fused MoE-LoRA kernels against the plain-torch spec, over hard grids (CPU interpreter).

Runs under TRITON_INTERPRET=1 in fp32 and fp16 (bf16 tl.dot is wrong in the interpreter; bf16
is covered by test_moe_lora_gpu.py on the device). Sizes are small in K and N so that the
interpreter stays fast, and odd (63, 100) so that no dimension is a multiple of its block.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig
from loraplex.kernels.ops.moe_lora.op import UnsupportedMoeLoraCall
from tests.support.moe_lora_cases import Case, check_against_reference

SPLIT = MoeLoraConfig("split", block_k=32, block_n=32, split_k=3)
FUSED = MoeLoraConfig("fused", block_k=32, block_n=32, npid=2)
FUSED_SLICES = MoeLoraConfig("fused", block_k=32, block_n=32, fuse_slices=True)
# Half-block expand programs over three N tiles (the last group runs past N in every case),
# under a register cap.
SPLIT_SLICES = MoeLoraConfig(
    "split",
    block_k=32,
    block_n=32,
    split_k=2,
    fuse_slices=True,
    expand_parts=2,
    expand_tiles=3,
    max_registers=128,
)
# The naive form's GEMV shrink: K ranges of 64 (K = 100: the second range is partial).
GEMV = MoeLoraConfig("split", block_k=32, block_n=32, split_k=2, gemv_shrink=True)
# The GEMV expand over 32 columns a program (N = 63 and 100 leave a partial tile): after the
# tl.dot shrink over 3 K ranges with both slices in one program, and after the GEMV shrink.
GEMV_EXPAND = MoeLoraConfig(
    "split", block_k=32, block_n=32, split_k=3, fuse_slices=True, gemv_expand=True
)
GEMV_BOTH = MoeLoraConfig(
    "split", block_k=32, block_n=32, split_k=2, gemv_shrink=True, gemv_expand=True
)
GEMV_CONFIGS = [GEMV, GEMV_EXPAND, GEMV_BOTH]
GEMV_IDS = ["gemv", "gemv_expand", "gemv_both"]
CONFIGS = [SPLIT, FUSED, FUSED_SLICES, SPLIT_SLICES]
CONFIG_IDS = ["split", "fused", "fused_slices", "split_slices"]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Each line covers one hard corner; together: tokens 1..2048 (odd too), top-k 1/2/4/8, experts
# 8..128, ranks 8/16/32/64, 1..16 adapters, every popularity, tokens without adapter, skewed
# expert load, disabled slots, both routing forms, both routed-weight layouts. Large token counts
# use the sorted form, as vLLM does (naive only while tokens x top-k x 8 <= experts x adapters):
# the interpreter runs programs one by one, so the naive form at 2048 pairs would take minutes.
CASES = {
    "t1_k8_e128_r32_a8": Case(1, 8, 128, 32, 8),
    "t7_k4_e8_r8_a1_distinct": Case(7, 4, 8, 8, 1, "distinct", k=100, n=63),
    "t31_k2_e63_r16_a16_zipf_none": Case(31, 2, 63, 16, 16, "zipf", no_adapter=0.3),
    "t9_k8_e128_r64_a4_skewed_skewload": Case(9, 8, 128, 64, 4, "skewed", expert_skew=True, k=100),
    "t63_k1_e16_r8_a3_identical": Case(63, 1, 16, 8, 3, "identical", n=63),
    "t15_k2_e8_r32_a5_disabled_none": Case(
        15, 2, 8, 32, 5, "uniform", no_adapter=0.5, disabled_slot=True
    ),
    "t9_k4_e32_r16_a16_distinct_down": Case(
        9, 4, 32, 16, 16, "distinct", mul_routed_weight=True, slices=1, k=63, n=100
    ),
    "t5_k2_e8_r8_a2_all_none": Case(5, 2, 8, 8, 2, no_adapter=1.0),
}


def _sorted(case: Case, **kw: Any) -> Case:
    return dataclasses.replace(case, sorted_form=True, **kw)


SORTED_CASES = {
    "t24_k8_e16_r32_a8_bm16": _sorted(Case(24, 8, 16, 32, 8), specialize_active=True),
    # One adapter beside tokens without one, counted as the plugin counts it: 1, not 2.
    "t24_k4_e16_r32_a1_none_bm16": _sorted(
        Case(24, 4, 16, 32, 1, no_adapter=0.5), specialize_active=True
    ),
    "t63_k4_e16_r64_a4_zipf_bm32": _sorted(Case(63, 4, 16, 64, 4, "zipf", k=100), block_m=32),
    "t300_k2_e8_r16_a3_skewload_none_bm64": _sorted(
        Case(300, 2, 8, 16, 3, "skewed", no_adapter=0.2, expert_skew=True), block_m=64
    ),
    "t2048_k2_e8_r8_a16_uniform_bm64": _sorted(
        Case(2048, 2, 8, 8, 16, k=32, n=16, slices=1), block_m=64, mul_routed_weight=True
    ),
    "t2047_k1_e32_r16_a2_bm128": _sorted(Case(2047, 1, 32, 16, 2, k=32, n=16), block_m=128),
    "t17_k2_e8_r32_a3_disabled_bm16": _sorted(Case(17, 2, 8, 32, 3, disabled_slot=True)),
    # 25 pairs per (slot, expert): both row parts of a 32-row block hold real pairs.
    "t200_k2_e8_r16_a2_bm32": _sorted(Case(200, 2, 8, 16, 2), block_m=32),
}


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


@pytest.mark.parametrize("config", [*CONFIGS, *GEMV_CONFIGS], ids=[*CONFIG_IDS, *GEMV_IDS])
@pytest.mark.parametrize("name", sorted(CASES))
def test_naive_form_matches_reference(name: str, config: MoeLoraConfig) -> None:
    err = check_against_reference(CASES[name], config, torch.float32, DEVICE, seed=hash(name) % 997)
    assert err < _tolerance(torch.float32), err


@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("name", sorted(SORTED_CASES))
def test_sorted_form_matches_reference(name: str, config: MoeLoraConfig) -> None:
    case = SORTED_CASES[name]
    err = check_against_reference(case, config, torch.float32, DEVICE, seed=len(name))
    assert err < _tolerance(torch.float32), err


@pytest.mark.parametrize(
    "case",
    [
        Case(6, 2, 8, 16, 3, offset=7, add_inputs=False),
        # 20 pairs per (slot, expert): the split_slices config's second row part has real rows.
        _sorted(
            Case(160, 4, 8, 32, 4, mul_routed_weight=True, add_inputs=False, offset=3), block_m=32
        ),
    ],
    ids=["naive_offset_overwrite", "sorted_down_overwrite"],
)
@pytest.mark.parametrize("config", CONFIGS, ids=CONFIG_IDS)
def test_fp16_offset_and_overwrite(case: Case, config: MoeLoraConfig) -> None:
    err = check_against_reference(case, config, torch.float16, DEVICE, seed=3)
    assert err < _tolerance(torch.float16), err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (GEMV, "gemv_shrink is for the naive routing form only"),
        (GEMV_EXPAND, "gemv_expand is for the naive routing form only"),
        (GEMV_BOTH, "gemv_shrink and gemv_expand are for the naive routing form only"),
    ],
    ids=GEMV_IDS,
)
def test_gemv_kernels_refuse_the_sorted_form(config: MoeLoraConfig, message: str) -> None:
    case = SORTED_CASES["t17_k2_e8_r32_a3_disabled_bm16"]
    with pytest.raises(ValueError, match=message):
        check_against_reference(case, config, torch.float32, DEVICE, seed=1)


@pytest.mark.parametrize(
    "case",
    [
        Case(6, 2, 8, 16, 3, offset=7, add_inputs=False, k=100),
        Case(5, 4, 8, 16, 3, mul_routed_weight=True, add_inputs=False, offset=3, slices=1, n=100),
    ],
    ids=["gate_up_offset_overwrite", "down_offset_overwrite"],
)
@pytest.mark.parametrize("config", GEMV_CONFIGS, ids=GEMV_IDS)
def test_gemv_kernels_fp16_overwrite_at_an_offset(case: Case, config: MoeLoraConfig) -> None:
    err = check_against_reference(case, config, torch.float16, DEVICE, seed=3)
    assert err < _tolerance(torch.float16), err


@pytest.mark.parametrize("name", ["t1_k8_e128_r32_a8", "t9_k4_e32_r16_a16_distinct_down"])
def test_tuned_lookup_path_matches_reference(name: str) -> None:
    """No config passed: the op looks one up (the fallback on a machine with no tuned file)."""
    err = check_against_reference(CASES[name], None, torch.float16, DEVICE, seed=11)
    assert err < _tolerance(torch.float16), err


def test_stock_config_declines_the_call() -> None:
    """Where the tuner measured vLLM's kernel faster, the op refuses and the plugin hands over."""
    stock = MoeLoraConfig("stock", block_k=64, block_n=64)
    with pytest.raises(UnsupportedMoeLoraCall, match="vLLM's own kernel is faster"):
        check_against_reference(CASES["t1_k8_e128_r32_a8"], stock, torch.float32, DEVICE, seed=1)
