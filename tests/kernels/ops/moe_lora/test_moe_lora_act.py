"""The gate/up expand fused into the activation against the spec (CPU interpreter, fp32 and
fp16): SiLU-and-mul for two slices side by side (Qwen3's call), swigluoai for one slice with gate
and up interleaved (GPT-OSS's, the cases named `interleaved`).

Each case defers the op's expand (`defer_gate_up_expand`), then runs it fused; the LoRA programs
and the plain programs (pairs without LoRA) both have to write their rows. bf16 runs in
test_moe_lora_gpu.py on the device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.kernels.ops.moe_lora import act
from loraplex.kernels.ops.moe_lora.act import (
    SWIGLUOAI_ALPHA,
    SWIGLUOAI_LIMIT,
    expand_silu_and_mul,
    expand_swigluoai_and_mul,
)
from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig
from loraplex.kernels.ops.moe_lora.op import defer_gate_up_expand, fused_moe_lora
from loraplex.kernels.ops.moe_lora.reference import swigluoai_and_mul_reference
from tests.support.moe_lora_cases import Case, check_expand_activation, make_inputs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPLIT = MoeLoraConfig("split", block_k=32, block_n=32, split_k=3)
# Half-block programs with slices fused in the shrink, as the H200's prefill config.
SPLIT_PARTS = MoeLoraConfig(
    "split", block_k=32, block_n=32, split_k=2, fuse_slices=True, expand_parts=2
)
FUSED = MoeLoraConfig("fused", block_k=32, block_n=32)
GEMV = MoeLoraConfig("split", block_k=32, block_n=32, split_k=2, gemv_shrink=True)


def _sorted(case: Case, block_m: int) -> Case:
    return dataclasses.replace(case, sorted_form=True, block_m=block_m)


# N = 63 and 100 leave a partial tile; pairs past 64 need two plain programs. The interleaved
# cases are one slice of 2I columns: I = 63 and 48 (two 32-column tiles).
CASES = {
    "naive_t7_k4_e8_r8_a3_none": Case(7, 4, 8, 8, 3, "uniform", no_adapter=0.4, n=63),
    "naive_t5_k2_e8_r16_a2_all_none": Case(5, 2, 8, 16, 2, no_adapter=1.0),
    "naive_t9_k8_e16_r32_a4_disabled": Case(9, 8, 16, 32, 4, "distinct", disabled_slot=True),
    "sorted_t70_k2_e8_r16_a3_none_bm32": _sorted(
        Case(70, 2, 8, 16, 3, "zipf", no_adapter=0.2, n=100), 32
    ),
    "sorted_t40_k4_e8_r32_a2_disabled_bm16": _sorted(
        Case(40, 4, 8, 32, 2, "skewed", disabled_slot=True, expert_skew=True), 16
    ),
    "naive_t7_k4_e8_r8_a3_none_interleaved": Case(
        7, 4, 8, 8, 3, "uniform", no_adapter=0.4, n=126, slices=1
    ),
    "sorted_t40_k4_e8_r32_a2_disabled_bm16_interleaved": _sorted(
        Case(40, 4, 8, 32, 2, "skewed", disabled_slot=True, expert_skew=True, n=96, slices=1), 16
    ),
}


@pytest.mark.parametrize("config", [SPLIT, SPLIT_PARTS], ids=["split", "split_parts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name: str, dtype: torch.dtype, config: MoeLoraConfig) -> None:
    err = check_expand_activation(CASES[name], config, dtype, DEVICE, seed=len(name))
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if not CASES[n].sorted_form])
def test_gemv_shrink_feeds_the_fused_activation(name: str, dtype: torch.dtype) -> None:
    """The GEMV shrink writes the workspace cells the fused SiLU-and-mul reads."""
    err = check_expand_activation(CASES[name], GEMV, dtype, DEVICE, seed=len(name))
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("chunk", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if CASES[n].sorted_form])
def test_sorted_programs_chunk_their_rows_over_n_tiles(
    name: str, dtype: torch.dtype, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LoRA programs of one unit and N tile walk the unit's rows in chunks. With 32-column tiles
    N = 100 takes four (the last partial) and N = 48 two; 16-row chunks split a 32-row block
    in two, of which the second may be all padding, and 32-row chunks are capped at the block."""
    monkeypatch.setattr(act, "SORTED_BLOCK_N", 32)
    monkeypatch.setattr(act, "SORTED_CHUNK", chunk)
    err = check_expand_activation(CASES[name], SPLIT_PARTS, dtype, DEVICE, seed=len(name))
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_calls_that_are_not_split_gate_up_run_whole() -> None:
    """Inside the deferral, a down-projection call, a fused-variant call and a one-slice call
    into an output wider than it (make_inputs adds columns) still update their output at once
    and leave nothing behind."""
    down = Case(6, 2, 8, 16, 2, slices=1, mul_routed_weight=True)
    narrow = Case(6, 2, 8, 16, 2, n=64, slices=1)
    for case, config in [(down, SPLIT), (Case(6, 2, 8, 16, 2), FUSED), (narrow, SPLIT)]:
        args = make_inputs(case, torch.float32, DEVICE, seed=5)
        before = args["output"].clone()
        with defer_gate_up_expand() as deferred:
            fused_moe_lora(
                **args, shrink_block_size_m=16, config=config,
                mul_routed_weight=case.mul_routed_weight,
            )  # fmt: skip
        assert deferred == []
        assert not torch.equal(args["output"], before)


def test_swigluoai_spec_is_vllms_own() -> None:
    """The spec's swigluoai is vLLM's torch form (SwigluOAIAndMul.forward_native) at the alpha
    and limit vLLM's op defaults to, on values past the limit on both sides."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    with set_current_vllm_config(VllmConfig()):
        vllm_op = SwigluOAIAndMul()
    assert (vllm_op.alpha, vllm_op.limit) == (SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT)
    x = torch.randn(6, 20, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 5
    assert (x > SWIGLUOAI_LIMIT).any() and (x < -SWIGLUOAI_LIMIT).any()
    want = vllm_op.forward_native(x)
    assert torch.equal(swigluoai_and_mul_reference(x, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT), want)


def test_each_activation_takes_only_its_layout() -> None:
    """SiLU-and-mul reads two slices side by side, swigluoai one slice interleaved: neither
    launches on the other's call."""
    calls = {2: Case(4, 2, 8, 16, 2), 1: Case(4, 2, 8, 16, 2, n=64, slices=1)}
    for slices, case in calls.items():
        args = make_inputs(case, torch.float32, DEVICE, seed=2)
        args["output"] = args["output"][..., : slices * case.n]
        with defer_gate_up_expand() as deferred:
            fused_moe_lora(**args, shrink_block_size_m=16, config=SPLIT)
        out = torch.empty(case.tokens * case.top_k, slices * case.n // 2)
        wrong = expand_swigluoai_and_mul if slices == 2 else expand_silu_and_mul
        with pytest.raises(ValueError, match=f"got {slices} slice"):
            wrong(deferred[0], out)


def test_rejects_an_output_of_the_wrong_shape() -> None:
    case = Case(4, 2, 8, 16, 2)
    args = make_inputs(case, torch.float32, DEVICE, seed=2)
    args["output"] = args["output"][..., : 2 * case.n]
    with defer_gate_up_expand() as deferred:
        fused_moe_lora(**args, shrink_block_size_m=16, config=SPLIT)
    out = torch.empty(case.tokens * case.top_k, case.n + 1)
    with pytest.raises(ValueError, match=r"must be \(pairs, I\) = \(8, 48\)"):
        expand_silu_and_mul(deferred[0], out)


class _RecordingKernel:
    """The activation kernel, launched as it is, with each launch's N tile noted."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.block_ns: list[int] = []

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        def launch(*args: object, **kwargs: object) -> object:
            self.block_ns.append(int(kwargs["BLOCK_N"]))  # type: ignore[call-overload]
            return self.kernel[grid](*args, **kwargs)  # type: ignore[index]

        return launch


@pytest.fixture
def launched_block_ns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The N tile of each activation launch from now on (the real kernel runs)."""
    recorder = _RecordingKernel(act.moe_lora_expand_silu_and_mul_kernel)
    monkeypatch.setattr(act, "moe_lora_expand_silu_and_mul_kernel", recorder)
    return recorder.block_ns


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if not CASES[n].sorted_form])
def test_the_naive_form_caps_the_tile_and_keeps_the_numbers(
    name: str, dtype: torch.dtype, launched_block_ns: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the naive form the activation's N tile is the config's at most
    NAIVE_COLUMNS_PER_WARP a warp: at 4 a warp, 16-column tiles where the config tunes 32 (more
    programs), against the spec."""
    monkeypatch.setattr(act, "NAIVE_COLUMNS_PER_WARP", 4)
    err = check_expand_activation(CASES[name], GEMV, dtype, DEVICE, seed=len(name))
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    assert launched_block_ns == [16]


def test_the_sorted_form_keeps_its_tile_past_the_cap(
    launched_block_ns: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cap is the naive form's: the sorted form launches SORTED_BLOCK_N (128) under a cap of
    16 columns (its numbers: test_matches_reference)."""
    monkeypatch.setattr(act, "NAIVE_COLUMNS_PER_WARP", 4)
    name = "sorted_t40_k4_e8_r32_a2_disabled_bm16_interleaved"
    check_expand_activation(CASES[name], SPLIT_PARTS, torch.float32, DEVICE, seed=len(name))
    assert launched_block_ns == [act.SORTED_BLOCK_N]


def test_a_wide_tuned_tile_launches_at_16_columns_a_warp(launched_block_ns: list[int]) -> None:
    """As shipped: a config tuned at 256 columns on 4 warps (as GPT-OSS's 1,024) launches the
    naive form's activation at 64, against the spec."""
    wide = dataclasses.replace(GEMV, block_n=256)
    name = "naive_t7_k4_e8_r8_a3_none_interleaved"  # I = 63: one 64-column tile
    err = check_expand_activation(CASES[name], wide, torch.float32, DEVICE, seed=len(name))
    assert err < 1e-5, err
    assert launched_block_ns == [64]
