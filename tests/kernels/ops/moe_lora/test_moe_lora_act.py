"""The gate/up expand fused into SiLU-and-mul against the spec (CPU interpreter, fp32 and fp16).

Each case defers the op's expand (`defer_gate_up_expand`), then runs it fused; the LoRA programs
and the plain programs (pairs without LoRA) both have to write their rows. bf16 runs in
test_moe_lora_gpu.py on the device.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loraplex.kernels.ops.moe_lora import act
from loraplex.kernels.ops.moe_lora.act import expand_silu_and_mul
from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig
from loraplex.kernels.ops.moe_lora.op import defer_gate_up_expand, fused_moe_lora
from tests.support.moe_lora_cases import Case, check_expand_silu_and_mul, make_inputs

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


# N = 63 and 100 leave a partial tile; pairs past 64 need two plain programs.
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
}


@pytest.mark.parametrize("config", [SPLIT, SPLIT_PARTS], ids=["split", "split_parts"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(name: str, dtype: torch.dtype, config: MoeLoraConfig) -> None:
    err = check_expand_silu_and_mul(CASES[name], config, dtype, DEVICE, seed=len(name))
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", [n for n in sorted(CASES) if not CASES[n].sorted_form])
def test_gemv_shrink_feeds_the_fused_activation(name: str, dtype: torch.dtype) -> None:
    """The GEMV shrink writes the workspace cells the fused SiLU-and-mul reads."""
    err = check_expand_silu_and_mul(CASES[name], GEMV, dtype, DEVICE, seed=len(name))
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
    err = check_expand_silu_and_mul(CASES[name], SPLIT_PARTS, dtype, DEVICE, seed=len(name))
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


def test_calls_that_are_not_split_gate_up_run_whole() -> None:
    """Inside the deferral, a down-projection call and a fused-variant call still update their
    output at once and leave nothing behind."""
    down = Case(6, 2, 8, 16, 2, slices=1, mul_routed_weight=True)
    for case, config in [(down, SPLIT), (Case(6, 2, 8, 16, 2), FUSED)]:
        args = make_inputs(case, torch.float32, DEVICE, seed=5)
        before = args["output"].clone()
        with defer_gate_up_expand() as deferred:
            fused_moe_lora(
                **args, shrink_block_size_m=16, config=config,
                mul_routed_weight=case.mul_routed_weight,
            )  # fmt: skip
        assert deferred == []
        assert not torch.equal(args["output"], before)


def test_rejects_an_output_of_the_wrong_shape() -> None:
    case = Case(4, 2, 8, 16, 2)
    args = make_inputs(case, torch.float32, DEVICE, seed=2)
    args["output"] = args["output"][..., : 2 * case.n]
    with defer_gate_up_expand() as deferred:
        fused_moe_lora(**args, shrink_block_size_m=16, config=SPLIT)
    out = torch.empty(case.tokens * case.top_k, case.n + 1)
    with pytest.raises(ValueError, match=r"must be \(pairs, N\) = \(8, 48\)"):
        expand_silu_and_mul(deferred[0], out)
