"""Isolation on a CUDA GPU (`kernel_isolation` says how): an adapter slot of NaN or 1e30 weights
changes no other token's output in bf16 and fp16, under Programmatic Dependent Launch at decode
sizes, at prefill sizes, and in CUDA graphs replayed for later steps. Run on the device machine:

    PYTHONPATH=/tmp/site:. python3 -m pytest -m gpu tests/kernels/test_lora_isolation_gpu.py
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from loraplex.kernels.ops.lora_dense.op import lora_dense
from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig
from loraplex.kernels.ops.moe_lora.op import fused_moe_lora
from loraplex.kernels.vllm.batch_metadata import fill_kernel_meta
from tests.support.kernel_isolation import (
    LATER,
    POISONS,
    check_dense,
    check_expand_activation,
    check_moe_op,
    poison,
)
from tests.support.moe_lora_cases import Case, make_inputs

pytestmark = pytest.mark.gpu

SPLIT = MoeLoraConfig("split", block_k=128, block_n=64, split_k=4, expand_tiles=2)
FUSED = MoeLoraConfig("fused", block_k=128, block_n=128, npid=2)
SPLIT_SLICES = MoeLoraConfig(
    "split", block_k=64, block_n=128, split_k=2, fuse_slices=True, expand_parts=2, expand_tiles=2
)
GEMV_BOTH = MoeLoraConfig("split", block_k=128, block_n=256, split_k=4, gemv_shrink=True,
                          gemv_expand=True)  # fmt: skip
CONFIGS = {"lookup": None, "split": SPLIT, "fused": FUSED, "split_slices": SPLIT_SLICES}
VALUES = {"bf16_nan": (torch.bfloat16, "nan"), "bf16_huge": (torch.bfloat16, "huge"),
          "fp16_nan": (torch.float16, "nan")}  # fmt: skip


def _e2e(tokens: int, call: str, **kw: Any) -> Case:
    """The e2e check's model (bench_e2e.make_small_model: hidden 512, experts 32 of inter 256,
    top-4) with its two slots, rank 32: slot 0 poisoned, slot 1 good, tokens on none."""
    dims = {"k": 512, "n": 256} if call == "w13" else {"k": 256, "n": 512, "slices": 1,
                                                       "mul_routed_weight": True}  # fmt: skip
    return Case(tokens, 4, 32, 32, 2, "distinct", no_adapter=0.4, **dims, **kw)


# Decode (naive form, under PDL) and prefill (sorted, the plugin's blocks) of the e2e check's
# model, and of Qwen3-30B-A3B's shape (3 of its 8 slots, to keep the draws small) at 8,192 pairs,
# the last size under PDL, and 16,384, the first without.
NAIVE = {
    "e2e_w13_t8": _e2e(8, "w13"),
    "e2e_w2_t8": _e2e(8, "w2"),
    "e2e_w2_t8_delta": _e2e(8, "w2", add_inputs=False),
    "qwen_w13_t16_zipf": Case(16, 8, 128, 32, 8, "zipf", no_adapter=0.25, k=2048, n=768),
}
SORTED = {
    "e2e_w13_t128_bm16": _e2e(128, "w13", sorted_form=True),
    "e2e_w2_t128_bm16_delta": _e2e(128, "w2", sorted_form=True, add_inputs=False),
}
PREFILL = {
    "qwen_w13_t1024_bm64": dataclasses.replace(
        Case(1024, 8, 128, 32, 3, "uniform", no_adapter=0.2, k=2048, n=768),
        sorted_form=True,
        block_m=64,
    ),
    "qwen_w2_t2048_bm64_plugin_order": dataclasses.replace(
        Case(2048, 8, 128, 32, 3, "zipf", no_adapter=0.2, k=768, n=2048, slices=1),
        mul_routed_weight=True,
        sorted_form=True,
        block_m=64,
        specialize_active=True,
    ),
}


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("config", [*CONFIGS, "gemv"])
@pytest.mark.parametrize("name", list(NAIVE))
def test_decode_sizes(name: str, config: str, value: str) -> None:
    dtype, poison_name = VALUES[value]
    chosen = GEMV_BOTH if config == "gemv" else CONFIGS[config]
    check_moe_op(NAIVE[name], chosen, dtype, "cuda", POISONS[poison_name])


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(SORTED))
def test_sorted_blocks(name: str, config: str, value: str) -> None:
    dtype, poison_name = VALUES[value]
    check_moe_op(SORTED[name], CONFIGS[config], dtype, "cuda", POISONS[poison_name])


@pytest.mark.parametrize("value", ["bf16_nan", "bf16_huge"])
@pytest.mark.parametrize("config", ["lookup", "split_slices"])
@pytest.mark.parametrize("name", list(PREFILL))
def test_prefill_sizes(name: str, config: str, value: str) -> None:
    dtype, poison_name = VALUES[value]
    check_moe_op(PREFILL[name], CONFIGS[config], dtype, "cuda", POISONS[poison_name])


# The gate/up call in vLLM's 3D layout (GPT-OSS's): one slice, gate and up interleaved, fused
# into swigluoai.
INTERLEAVED = {
    "e2e_w13_3d_t8": dataclasses.replace(_e2e(8, "w13"), n=512, slices=1),
    "e2e_w13_3d_t128_bm16": dataclasses.replace(
        _e2e(128, "w13", sorted_form=True), n=512, slices=1
    ),
}


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize(
    ("name", "config"),
    [("e2e_w13_t8", SPLIT), ("e2e_w13_t8", GEMV_BOTH), ("qwen_w13_t16_zipf", SPLIT_SLICES),
     ("e2e_w13_t128_bm16", SPLIT), ("qwen_w13_t1024_bm64", SPLIT_SLICES),
     ("e2e_w13_3d_t8", SPLIT), ("e2e_w13_3d_t8", GEMV_BOTH), ("e2e_w13_3d_t128_bm16", SPLIT)],
)  # fmt: skip
def test_gate_up_expand_fused_into_the_activation(
    name: str, config: MoeLoraConfig, value: str
) -> None:
    dtype, poison_name = VALUES[value]
    case = {**NAIVE, **SORTED, **PREFILL, **INTERLEAVED}[name]
    check_expand_activation(case, config, dtype, "cuda", POISONS[poison_name])


@pytest.mark.parametrize("value", list(VALUES))
@pytest.mark.parametrize("add_inputs", [True, False], ids=["add", "overwrite"])
@pytest.mark.parametrize(
    ("tokens", "order"),
    [(4, None), (64, None), (128, "vllm"), (128, "plugin"), (4000, "plugin")],
    ids=["gemv_t4", "gemv_t64", "tiled_t128_vllm_order", "tiled_t128", "tiled_t4000"],
)
def test_dense_lora(tokens: int, order: str | None, add_inputs: bool, value: str) -> None:
    """The e2e check's attention: q, k and v of 512, 128 and 128 columns from 512, rank 32."""
    dtype, poison_name = VALUES[value]
    check_dense(tokens, 512, 32, [512, 128, 128], 2, dtype, "cuda", POISONS[poison_name], order,
                add_inputs)  # fmt: skip


def test_a_graph_captured_with_adapters_replays_later_steps_clean() -> None:
    """The decode kernels (naive MoE form under PDL, the dense GEMVs) captured in a CUDA graph on
    a step with slot 0 poisoned, then replayed as vLLM replays a graph for later steps, the
    metadata refilled by `lora_mapping.fill_kernel_meta`: the step itself (others as clean
    weights give them), a step with slot 0 loaded but unused (every row as clean weights give
    it), and a step without adapters (every row left as it was: the mapping alone tells, and a
    mapping left from the step before gave base-model tokens slot 0's NaN)."""
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    case = _e2e(8, "w13")
    meta = LoRAKernelMeta.make(case.adapters, 64, "cuda")
    steps = {"mixed": None, "later": LATER, "none": {0: -1, 1: -1}}
    draws = {step: make_inputs(case, torch.bfloat16, "cuda", 3, remap) for step, remap in
             steps.items()}  # fmt: skip
    base = draws["mixed"]["output"].clone()
    x_dense = torch.randn(case.tokens, 512, device="cuda", dtype=torch.bfloat16)
    dense_a = [torch.randn(2, 1, 32, 512, device="cuda", dtype=torch.bfloat16) / 23 for _ in "qkv"]
    dense_b = [torch.randn(2, 1, n, 32, device="cuda", dtype=torch.bfloat16) / 6
               for n in (512, 128, 128)]  # fmt: skip
    y_base = torch.randn(case.tokens, 768, device="cuda", dtype=torch.bfloat16)

    def run(inputs: dict[str, Any], y: torch.Tensor) -> None:
        fused_moe_lora(**inputs, config=SPLIT)
        lora_dense(y, x_dense, dense_a, dense_b, inputs["token_lora_mapping"], 1.0, True)

    want = {}
    for step, inputs in draws.items():  # eager, clean weights
        y = y_base.clone()
        run(inputs, y)
        want[step] = (inputs["output"].clone(), y)
    captured_inputs = dict(draws["mixed"], output=base.clone(),
                           token_lora_mapping=meta.token_lora_mapping[: case.tokens])  # fmt: skip
    poison([*captured_inputs["lora_a_stacked"], *captured_inputs["lora_b_stacked"], *dense_a,
            *dense_b], float("nan"))  # fmt: skip
    y = y_base.clone()
    fill_kernel_meta(meta, draws["mixed"]["token_lora_mapping"].cpu().numpy())
    side = torch.cuda.Stream()  # warm up (compiles) off the capture, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(dict(captured_inputs, output=base.clone()), y_base.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(captured_inputs, y)
    for step in steps:
        slots = draws[step]["token_lora_mapping"].cpu()
        fill_kernel_meta(meta, slots.numpy().astype(np.int64))
        captured_inputs["output"].copy_(base)
        y.copy_(y_base)
        graph.replay()
        torch.cuda.synchronize()
        out, want_out = captured_inputs["output"].flatten(0, 1), want[step][0].flatten(0, 1)
        others = slots.repeat_interleave(case.top_k) != 0
        assert torch.equal(out[others.cuda()], want_out[others.cuda()]), step
        assert torch.equal(y[(slots != 0).cuda()], want[step][1][(slots != 0).cuda()]), step
        if step == "none":
            assert torch.equal(captured_inputs["output"], base)
            assert torch.equal(y, y_base)


@pytest.mark.parametrize("sorted_form", [False, True], ids=["naive", "sorted"])
def test_a_poisoned_slot_beside_others_through_vllms_methods(sorted_form: bool) -> None:
    """vLLM 0.26's own add_lora_w13 and add_lora_w2 with the plugin in, on the e2e check's model
    at decode (4 tokens: the plugin's naive form, where vLLM would sort) and at a 128-token
    prefill (sorted, the plugin's block of 16): slot 0 NaN, slot 1 good, tokens on none; the
    tokens not on slot 0 come out as with clean weights, bit for bit."""
    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    from bench.kernels.moe_lora_workload import CallSpec, MoeShape, make_weights
    from loraplex.kernels.vllm.plugin import PluginState, register

    assert register(enabled=True) in (PluginState.PATCHED, PluginState.ALREADY)
    shape = MoeShape("e2e-check", 512, 256, 32, 4, activation="silu", lora_3d=False)
    tokens, e, k, slots_n = (128 if sorted_form else 4), 32, 4, 2
    gen = torch.Generator().manual_seed(2)
    topk_ids = torch.rand(tokens, e, generator=gen).topk(k, dim=1).indices.to(torch.int32).cuda()
    topk_weights = torch.rand(tokens, k, generator=gen).cuda()
    tlm = torch.tensor([0, -1, 1, -1] * (tokens // 4), dtype=torch.int32).cuda()
    lora_ids = torch.tensor([0, 1, -1], dtype=torch.int32).cuda()  # the plugin's order
    width = torch.tensor([slots_n + 1], dtype=torch.int32)
    no_lora = torch.tensor([False])

    class StepMeta:  # vLLM's LoRAKernelMeta as the plugin fills it (lora_mapping)
        num_active_loras_cpu = torch.tensor([2], dtype=torch.int32)

        def meta_args(self, num_tokens: int, specialize: bool) -> tuple:
            return tlm[:num_tokens], None, None, None, lora_ids, no_lora, width

    punica: Any = PunicaWrapperGPU.__new__(PunicaWrapperGPU)
    punica.token_mapping_meta = StepMeta()
    punica.lora_config = type("LoRAConfig", (), {
        "fully_sharded_loras": False, "max_lora_rank": 32, "specialize_active_lora": False,
    })()  # fmt: skip
    w1 = torch.empty(e, 2 * 256, 512, device="meta")
    w2 = torch.empty(e, 512, 256, device="meta")
    enabled = torch.ones(slots_n + 1, dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, 512, generator=gen).to("cuda", torch.bfloat16)
    x2 = torch.randn(tokens * k, 256, generator=gen).to("cuda", torch.bfloat16)
    y13 = torch.randn(tokens, k, 512, generator=gen).to("cuda", torch.bfloat16) / 10
    y2 = torch.randn(tokens, k, 512, generator=gen).to("cuda", torch.bfloat16) / 10
    weights = {
        call: make_weights(shape, CallSpec.of(shape, call), slots_n, 32, torch.bfloat16, "cuda")
        for call in ("w13", "w2")
    }

    def run(value: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        (a13, b13), (a2, b2) = (([t.clone() for t in a], [t.clone() for t in b])
                                for a, b in (weights["w13"], weights["w2"]))  # fmt: skip
        if value is not None:
            poison([*a13, *b13, *a2, *b2], value)
        out13, out2 = y13.clone(), y2.clone()
        with torch.inference_mode():
            routing = punica.add_lora_w13(
                out13, x, tuple(a13), tuple(b13), topk_ids, topk_weights, None, w1, w2, tokens,
                k, slots_n, enabled, e, k, 2, False, False,
            )  # fmt: skip
            punica.add_lora_w2(
                out2, x2, tuple(a2), tuple(b2), topk_weights, *routing, tokens, w1, w2, k,
                slots_n, enabled, k, False, 0, False,
            )  # fmt: skip
        torch.cuda.synchronize()
        return out13, out2

    clean, poisoned = run(None), run(float("nan"))
    others = (tlm != 0).cpu()
    for got, want in zip(poisoned, clean, strict=True):
        assert torch.equal(got.cpu()[others], want.cpu()[others])
        assert torch.isnan(got.cpu()[~others]).any(), "slot 0's tokens took its NaN"


def test_cases_put_tokens_on_the_poisoned_slot_on_others_and_on_none() -> None:
    """What `kernel_isolation` asserts of each draw, checked once for every case here."""
    for name, case in {**NAIVE, **SORTED, **PREFILL}.items():
        slots = make_inputs(dataclasses.replace(case, sorted_form=False), torch.float32, "cpu",
                            3)["token_lora_mapping"]  # fmt: skip
        assert {0, -1} <= set(slots.tolist()) and (slots > 0).any(), name
