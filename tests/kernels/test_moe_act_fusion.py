"""`moe_act_fusion`'s two methods on a stand-in for vLLM 0.26's TritonExperts (the CPU's vLLM is
0.32, whose experts differ). The stand-in's methods do what TritonExperts' originals do with the
same tensors: `apply_w13_lora` calls our op on the gate/up buffer, as PunicaWrapperGPU does, and
`activation` is SiLU-and-mul (or GELU-and-mul). The kernels are the real ones, interpreted."""

from __future__ import annotations

import enum
from typing import Any

import pytest
import torch
from moe_lora_cases import Case, make_inputs

from loraplex.kernels.moe_act_fusion import PENDING, fused_methods
from loraplex.kernels.moe_lora_configs import MoeLoraConfig
from loraplex.kernels.moe_lora_op import fused_moe_lora
from loraplex.kernels.moe_lora_reference import fused_moe_lora_reference

SPLIT = MoeLoraConfig("split", block_k=32, block_n=32, split_k=2)
CASE = Case(6, 2, 8, 16, 3, "uniform", no_adapter=0.3)


class Act(enum.Enum):
    SILU = "silu"
    GELU = "gelu"


class QuantConfig:
    gemm1_clamp_limit: float | None = None


class StockExperts:
    """TritonExperts' two methods as its `apply` calls them, recording the activations run."""

    def __init__(self, op_args: dict[str, Any]) -> None:
        self.quant_config = QuantConfig()
        self.op_args = op_args
        self.activations: list[Act] = []

    def apply_w13_lora(self, lora_context: Any, *, y: torch.Tensor, **kwargs: Any) -> str:
        del lora_context
        fused_moe_lora(y, **self.op_args, shrink_block_size_m=16, config=SPLIT,
                       add_inputs=kwargs["add_inputs"])  # fmt: skip
        return "routing"

    def activation(self, kind: Act, output: torch.Tensor, input: torch.Tensor) -> None:
        self.activations.append(kind)
        gate, up = input.chunk(2, dim=1)
        act = torch.nn.functional.silu if kind is Act.SILU else torch.nn.functional.gelu
        output.copy_(act(gate) * up)


@pytest.fixture
def classes() -> tuple[type[StockExperts], type[StockExperts]]:
    """(the patched class, a subclass of it), patched as `patch_triton_experts` does."""
    experts = type("Experts", (StockExperts,), {})
    apply_w13_lora, activation = fused_methods(
        experts, StockExperts.apply_w13_lora, StockExperts.activation, Act.SILU
    )
    experts.apply_w13_lora = apply_w13_lora  # type: ignore[attr-defined]
    experts.activation = activation  # type: ignore[attr-defined]
    return experts, type("Subclass", (experts,), {})


def _run(
    cls: type[StockExperts], kind: Act, add_inputs: bool = True, clamp: float | None = None
) -> tuple[StockExperts, float]:
    """One gate/up LoRA then the activation, as TritonExperts.apply runs them; returns the
    experts and the activation's relative error against the float64 spec."""
    args = make_inputs(CASE, torch.float32, "cpu", seed=7)
    buffer = args.pop("output")[..., : 2 * CASE.n].contiguous()
    updated = buffer.double().clone()
    if add_inputs:
        fused_moe_lora_reference(updated, **args, block_size=16)
    gate, up = updated.view(-1, 2 * CASE.n).chunk(2, dim=1)
    act = torch.nn.functional.silu if kind is Act.SILU else torch.nn.functional.gelu
    want = act(gate) * up
    experts = cls(args)
    experts.quant_config.gemm1_clamp_limit = clamp
    lora_buffer = buffer if add_inputs else torch.zeros_like(buffer)
    routing = experts.apply_w13_lora(None, y=lora_buffer, expert_map=None, add_inputs=add_inputs)
    assert routing == "routing"
    out = torch.empty(buffer.shape[0] * buffer.shape[1], CASE.n)
    experts.activation(kind, out, buffer.view(-1, 2 * CASE.n))
    assert PENDING not in experts.__dict__
    return experts, float((out.double() - want).norm() / want.norm())


def test_silu_runs_the_fused_kernel_instead_of_the_original(classes: Any) -> None:
    experts, err = _run(classes[0], Act.SILU)
    assert experts.activations == []
    assert err < 1e-5


def test_another_activation_gets_the_expand_first(classes: Any) -> None:
    experts, err = _run(classes[0], Act.GELU)
    assert experts.activations == [Act.GELU]
    assert err < 1e-5


def test_clamped_silu_gets_the_expand_first(classes: Any) -> None:
    experts, err = _run(classes[0], Act.SILU, clamp=7.0)
    assert experts.activations == [Act.SILU]
    assert err < 1e-5


def test_a_subclass_goes_the_stock_way(classes: Any) -> None:
    experts, err = _run(classes[1], Act.SILU)
    assert experts.activations == [Act.SILU]
    assert err < 1e-5


def test_a_delta_only_call_is_not_deferred(classes: Any) -> None:
    """vLLM's dual-stream option asks for the delta alone (add_inputs=False) into a buffer of
    its own; the activation then reads the base buffer, which the LoRA never touched."""
    experts, err = _run(classes[0], Act.SILU, add_inputs=False)
    assert experts.activations == [Act.SILU]
    assert err < 1e-5
