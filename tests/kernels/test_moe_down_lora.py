"""The down GEMM with the down LoRA in its epilogue, against the spec (CPU interpreter, fp32 and
fp16), reached as the plugin reaches it: the GEMM held (`down_gemm_held`), the MoE-LoRA op's
down call running its shrink and handing the rows to the GEMM. bf16 runs in
test_moe_lora_gpu.py on the device, against vLLM's own GEMM and op."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from moe_lora_cases import Case, make_inputs_and_routing

from loraplex.kernels.moe_down_lora import expert_gemm_with_lora
from loraplex.kernels.moe_lora_configs import MoeLoraConfig
from loraplex.kernels.moe_lora_op import DownLora, HeldDownGemm, down_gemm_held, fused_moe_lora
from loraplex.kernels.moe_lora_reference import (
    expert_gemm_with_lora_reference,
    moe_align_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = MoeLoraConfig("fused", block_k=32, block_n=32)
SPLIT = MoeLoraConfig("split", block_k=32, block_n=32, split_k=2)
GEMM_BLOCK_M = 16
GEMM_CONFIG = {"BLOCK_SIZE_M": GEMM_BLOCK_M, "BLOCK_SIZE_N": 32, "BLOCK_SIZE_K": 32,
               "GROUP_SIZE_M": 2, "num_warps": 4, "num_stages": 2}  # fmt: skip


def _down(case: Case) -> Case:
    return dataclasses.replace(case, slices=1, mul_routed_weight=True, sorted_form=True)


# N = 45 leaves a partial tile, K = 40 a partial K block; pairs land in the GEMM's blocks in a
# random order, so most blocks hold several slots (and pairs without adapter) at once.
CASES = {
    "t9_k4_e8_r16_a3_none": _down(Case(9, 4, 8, 16, 3, "uniform", no_adapter=0.3, k=40, n=45)),
    "t12_k2_e4_r32_a4_distinct": _down(Case(12, 2, 4, 32, 4, "distinct", k=64, n=32)),
    "t10_k2_e8_r8_a2_disabled_bm32": _down(
        Case(10, 2, 8, 8, 2, "skewed", disabled_slot=True, k=32, n=40, block_m=32)
    ),
    "t6_k2_e4_r16_a2_all_none": _down(Case(6, 2, 4, 16, 2, no_adapter=1.0, k=32, n=32)),
}


class Gemm:
    """The base down GEMM of one case as the plugin holds it: `launch(lora)` runs our kernel
    with the LoRA, or (lora None) a plain torch GEMM in the output's dtype; it records which."""

    def __init__(self, case: Case, dtype: torch.dtype, seed: int) -> None:
        args, topk_ids = make_inputs_and_routing(case, dtype, DEVICE, seed)
        args["output"] = args["output"][..., : case.n]  # a strided view, as vLLM's buffers are
        gen = torch.Generator().manual_seed(seed + 1)
        w = torch.randn(case.experts, case.n, case.k, generator=gen) / case.k**0.5
        self.w = w.to(DEVICE, dtype)
        order = torch.randperm(topk_ids.numel(), generator=gen)
        self.routing = moe_align_reference(topk_ids, case.experts, GEMM_BLOCK_M, order)
        self.case, self.args = case, args
        self.before = args["output"].clone()
        self.launched: list[bool] = []  # with LoRA, per launch

    def launch(self, lora: DownLora | None) -> None:
        self.launched.append(lora is not None)
        c, a = self.args["output"], self.args["qcurr_hidden_states"]
        weights = self.args["topk_weights"]
        if lora is not None:
            expert_gemm_with_lora(a, self.w, c, weights, *self.routing, GEMM_CONFIG, True, lora)
            return
        sorted_ids, expert_ids, ntpp = (t.cpu() for t in self.routing)
        flat = c.view(-1, c.shape[-1])
        for pos in range(int(ntpp[0])):
            pair = int(sorted_ids[pos])
            if pair < flat.shape[0]:
                expert = int(expert_ids[pos // GEMM_BLOCK_M])
                row = a[pair].double() @ self.w[expert].double().T
                flat[pair] = (row * weights.view(-1)[pair].double()).to(c.dtype)

    def relative_error(self) -> float:
        """Of the output against the spec; NaN-free and bit for bit unchanged where no block
        holds a pair (none here: every pair has an expert)."""
        cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in self.args.items()}
        for key in ("lora_a_stacked", "lora_b_stacked"):
            cpu[key] = [t.cpu() for t in self.args[key]]
        del cpu["output"]
        want = expert_gemm_with_lora_reference(
            self.before.cpu(), self.w.cpu(), tuple(t.cpu() for t in self.routing), GEMM_BLOCK_M,
            **cpu, block_size=self.case.block_m,
        )  # fmt: skip
        got = self.args["output"].double().cpu()
        assert not torch.isnan(got).any()
        return float((got - want).norm() / want.norm())


TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2}


@pytest.mark.parametrize("config", [FUSED, SPLIT], ids=["fused", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_held_gemm_takes_the_down_lora(name: str, dtype: torch.dtype, config: Any) -> None:
    """The op's down call runs its shrink only and the GEMM adds the LoRA, whichever variant
    the op's config names for the call."""
    gemm = Gemm(CASES[name], dtype, seed=len(name))
    with down_gemm_held(HeldDownGemm(gemm.args["output"], gemm.launch)):
        fused_moe_lora(
            **gemm.args,
            shrink_block_size_m=gemm.case.block_m,
            config=config,
            mul_routed_weight=True,
        )
    assert gemm.launched == [True]
    assert gemm.relative_error() < TOLERANCE[dtype]


def test_another_call_gets_the_plain_gemm_first() -> None:
    """A down call in the naive form is not taken: the GEMM runs plain before the op adds."""
    case = dataclasses.replace(CASES["t9_k4_e8_r16_a3_none"])
    gemm = Gemm(case, torch.float32, seed=3)
    naive = dict(gemm.args, sorted_token_ids=None, num_tokens_post_padded=None)
    naive["expert_ids"] = _pair_experts(gemm)
    with down_gemm_held(HeldDownGemm(gemm.args["output"], gemm.launch)):
        fused_moe_lora(**naive, config=FUSED, mul_routed_weight=True)
        assert gemm.launched == [False]
    assert gemm.launched == [False]
    assert gemm.relative_error() < TOLERANCE[torch.float32]


def test_the_gemm_runs_on_leaving_when_no_call_came() -> None:
    gemm = Gemm(CASES["t6_k2_e4_r16_a2_all_none"], torch.float32, seed=4)
    with down_gemm_held(HeldDownGemm(gemm.args["output"], gemm.launch)):
        assert gemm.launched == []
    assert gemm.launched == [False]


def test_rejects_lora_weights_of_another_shape() -> None:
    gemm = Gemm(CASES["t12_k2_e4_r32_a4_distinct"], torch.float32, seed=5)
    args = gemm.args
    lora = DownLora(
        torch.zeros(args["topk_weights"].numel(), 32), args["lora_b_stacked"][0][:, :, :-1],
        args["token_lora_mapping"], args["lora_ids"], args["adapter_enabled"], 4, 4, 2, 32, 8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="LoRA B"):
        expert_gemm_with_lora(
            args["qcurr_hidden_states"], gemm.w, args["output"], args["topk_weights"],
            *gemm.routing, GEMM_CONFIG, True, lora,
        )  # fmt: skip


def _pair_experts(gemm: Gemm) -> torch.Tensor:
    """Each flat pair's expert, read back off the GEMM's sorting (the naive form's expert_ids)."""
    sorted_ids, expert_ids, ntpp = (t.cpu() for t in gemm.routing)
    experts = torch.full((gemm.args["topk_weights"].numel(),), -1, dtype=torch.int32)
    for pos in range(int(ntpp[0])):
        if int(sorted_ids[pos]) < experts.numel():
            experts[int(sorted_ids[pos])] = expert_ids[pos // GEMM_BLOCK_M]
    return experts.to(DEVICE)
