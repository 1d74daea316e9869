"""`fused_experts`'s five methods on a stand-in for vLLM 0.26's TritonExperts (the CPU's vLLM is
0.32, whose experts differ). The stand-in's methods do what TritonExperts' originals do with the
same tensors: `apply` runs the flow, `apply_w13_lora` and `apply_w2_lora` call our op on the
gate/up and the down buffers, as PunicaWrapperGPU does; `activation` is SiLU-and-mul (or
GELU-and-mul) on two slices side by side, or swigluoai on gate and up interleaved (GPT-OSS's
one slice, `GPT_OSS`); `moe_sum` sums each token's experts. `_apply` calls them in
`TritonExperts.apply`'s order. The kernels are the real ones, interpreted; on the CPU the "side
stream" is the current one, in order; the gpu-marked tests here run it on a real second stream,
eagerly and inside a captured CUDA graph, and a decode batch in order on the main stream,
eagerly and captured."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

from loraplex.kernels.dispatch import REGIMES
from loraplex.kernels.ops.moe_lora.act import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT
from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig
from loraplex.kernels.ops.moe_lora.op import fused_moe_lora
from loraplex.kernels.ops.moe_lora.reference import (
    fused_moe_lora_reference,
    swigluoai_and_mul_reference,
)
from loraplex.kernels.vllm import side_stream
from loraplex.kernels.vllm.batch_metadata import fill_kernel_meta
from loraplex.kernels.vllm.fused_experts import GATE_UP_SIDE, PENDING, install
from tests.support.moe_lora_cases import Case, gate_up_call

# The side stream's size rule, taking every call as a prefill.
BESIDE_AT_ANY_SIZE = dataclasses.replace(REGIMES, prefill_min_pairs=1)
SPLIT = MoeLoraConfig("split", block_k=32, block_n=32, split_k=2)
FUSED = MoeLoraConfig("fused", block_k=32, block_n=32)
CASE = Case(6, 2, 8, 16, 3, "uniform", no_adapter=0.3)
# vLLM's 3D layout (FusedMoE3DWithLoRA): one slice of 2 x 48 columns, gate and up interleaved.
GPT_OSS = dataclasses.replace(CASE, slices=1, n=96)
HIDDEN = 40  # the down projection's output width


class Act(enum.Enum):
    SILU = "silu"
    GELU = "gelu"
    SWIGLUOAI = "swigluoai"


def _act(kind: Act, gate_up: torch.Tensor) -> torch.Tensor:
    """vLLM's activation of that kind on (rows, 2I), in gate_up's dtype."""
    if kind is Act.SWIGLUOAI:
        return swigluoai_and_mul_reference(gate_up, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT).to(gate_up)
    gate, up = gate_up.chunk(2, dim=1)
    act = torch.nn.functional.silu if kind is Act.SILU else torch.nn.functional.gelu
    return act(gate) * up


# (activation, call) pairs: the two fused ones (Qwen3's SiLU on two slices, GPT-OSS's swigluoai
# on one interleaved) and one that gets the expand first.
FLOWS = [(Act.SILU, CASE), (Act.GELU, CASE), (Act.SWIGLUOAI, GPT_OSS)]
FLOW_IDS = ["silu", "gelu", "gpt_oss_swigluoai"]


class QuantConfig:
    gemm1_clamp_limit: float | None = None


@dataclasses.dataclass
class LoraContext:
    """The fields of vLLM's MoELoRAContext that the methods read; the punica wrapper holds only
    the step's LoRA metadata (vLLM's LoRAKernelMeta, filled as the plugin fills it)."""

    adapter_enabled: torch.Tensor
    max_loras: int
    punica_wrapper: Any
    fully_sharded: bool = False
    aux_stream: Any = None

    def no_adapter(self) -> bool:
        """The step has no token on an adapter: vLLM's LoRA calls then return before any kernel
        (PunicaWrapperGPU.add_lora_fused_moe reads this flag)."""
        return bool(self.punica_wrapper.token_mapping_meta.no_lora_flag_cpu[0])


class StockExperts:
    """TritonExperts' LoRA methods as its `apply` calls them, recording what ran."""

    def __init__(self, w13_args: dict[str, Any], w2_weights: tuple[torch.Tensor, torch.Tensor]):
        self.quant_config = QuantConfig()
        self.w13_args = w13_args
        self.w2_weights = w2_weights
        self.activations: list[Act] = []
        self.down_calls: list[tuple[bool, torch.Tensor]] = []  # (add_inputs, y) per call
        self.down_streams: list[Any] = []  # the CUDA stream each down call ran on
        self.w13_streams: list[Any] = []  # and each gate/up call
        self.w13_config = SPLIT  # FUSED: one launch that writes the buffer, nothing deferred
        self.w13_sleep_cycles = 0
        self.sums = 0
        self.main_stream: Any = None  # the stream a CUDA graph was captured on

    def apply(self, *, hidden_states: torch.Tensor, topk_ids: torch.Tensor,
              flow: Callable[[], Any]) -> Any:  # fmt: skip
        """TritonExperts.apply: `flow` stands for its body (GEMMs and the methods below)."""
        del hidden_states, topk_ids
        return flow()

    def apply_w13_lora(self, lora_context: Any, *, y: torch.Tensor, add_inputs: bool,
                       **kwargs: Any) -> tuple[Any, ...]:  # fmt: skip
        del kwargs
        self.w13_streams.append(torch.cuda.current_stream() if y.is_cuda else None)
        if y.is_cuda and self.w13_sleep_cycles:
            torch.cuda._sleep(self.w13_sleep_cycles)  # an activation that did not wait: junk
        if not lora_context.no_adapter():
            fused_moe_lora(y, **self.w13_args, shrink_block_size_m=16, config=self.w13_config,
                           add_inputs=add_inputs)  # fmt: skip
        args = self.w13_args
        return (args["sorted_token_ids"], args["expert_ids"], args["num_tokens_post_padded"],
                args["token_lora_mapping"])  # fmt: skip

    def activation(self, kind: Act, output: torch.Tensor, input: torch.Tensor) -> None:
        self.activations.append(kind)
        if output.is_cuda:
            torch.cuda._sleep(50_000_000)  # ~25 ms: a down LoRA that did not wait would see junk
        output.copy_(_act(kind, input))

    def apply_w2_lora(
        self, lora_context: Any, *, y: torch.Tensor, x: torch.Tensor,
        topk_weights: torch.Tensor, sorted_token_ids_lora: Any, expert_ids_lora: Any,
        num_tokens_post_padded_lora: Any, token_lora_mapping: torch.Tensor, num_tokens: int,
        w1: Any, w2: Any, top_k_num: int, add_inputs: bool = True,
    ) -> None:  # fmt: skip
        del num_tokens, w1, w2
        self.down_calls.append((add_inputs, y))
        if not add_inputs:
            y.fill_(float("nan"))  # poison: rows the op skips must not reach the sum
        if y.is_cuda:
            self.down_streams.append(torch.cuda.current_stream())
            torch.cuda._sleep(50_000_000)  # ~25 ms: a moe_sum that did not wait would see NaN
        if lora_context.no_adapter():
            return
        args = self.w13_args
        fused_moe_lora(
            y, x, [self.w2_weights[0]], [self.w2_weights[1]], topk_weights,
            sorted_token_ids_lora, expert_ids_lora, num_tokens_post_padded_lora,
            token_lora_mapping, CASE.rank, top_k_num, args["lora_ids"], args["num_active_loras"],
            lora_context.adapter_enabled, shrink_block_size_m=16, config=SPLIT,
            mul_routed_weight=True, add_inputs=add_inputs,
        )  # fmt: skip

    def moe_sum(self, input: torch.Tensor, output: torch.Tensor) -> None:
        self.sums += 1
        output.copy_(input.sum(dim=1))


@pytest.fixture
def classes() -> tuple[type[StockExperts], type[StockExperts]]:
    """(the patched class, a subclass of it), patched as `patch_triton_experts` does."""
    experts = type("Experts", (StockExperts,), {})
    install(experts, Act.SILU, Act.SWIGLUOAI)
    return experts, type("Subclass", (experts,), {})


@pytest.fixture
def side_at_any_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both LoRAs go beside the GEMMs at this test's few pairs, as at prefill sizes."""
    monkeypatch.setattr(side_stream, "REGIMES", BESIDE_AT_ANY_SIZE)


@dataclasses.dataclass
class Applied:
    experts: StockExperts
    act_error: float  # SiLU-and-mul's relative error against the float64 spec
    sum_error: float  # moe_sum's, with the down LoRA added, against the float64 spec
    down_buffer: torch.Tensor  # the base down GEMM's output buffer (intermediate_cache3)


def _apply(
    cls: type[StockExperts], kind: Act, add_inputs: bool = True, clamp: float | None = None,
    device: str = "cpu", dtype: torch.dtype = torch.float32, gemm_sleep_cycles: int = 0,
    configure: Callable[[StockExperts], None] = lambda experts: None, seed: int = 7,
    graph: bool = False, meta: LoRAKernelMeta | None = None, case: Case = CASE,
    poison: float | None = None, **context: Any,
) -> Applied:  # fmt: skip
    """The LoRA parts of TritonExperts.apply in its order, with the base GEMMs' outputs random;
    on a GPU the base gate/up GEMM writes its buffer after `gemm_sleep_cycles`. With `graph`
    (a GPU) `apply` is captured in a CUDA graph, as vLLM captures its decode batches, and the
    graph replayed once.

    `meta` is the step's LoRA metadata, kept across steps as vLLM keeps it: filled from the
    case's mapping (`batch_metadata.fill_kernel_meta`), and the mapping the routing hands on is
    its view, as vLLM's align returns it. `poison` is written over slot 0's weights, both
    calls, A and B (e.g. NaN); the spec then leaves slot 0's tokens out of the errors."""
    args = gate_up_call(case, dtype, device, seed=seed)
    buffer = args.pop("output").contiguous()
    width = buffer.shape[-1]
    inter = width // 2  # the activation's output width
    gen = torch.Generator().manual_seed(seed + 1)
    a2 = torch.randn(case.adapters, case.experts, case.rank, inter, generator=gen) / inter**0.5
    b2 = torch.randn(case.adapters, case.experts, HIDDEN, case.rank, generator=gen) / case.rank**0.5
    down_base = torch.randn(case.tokens, case.top_k, HIDDEN, generator=gen)
    a2, b2, down_base = (t.to(device, dtype) for t in (a2, b2, down_base))
    step_tlm = args["token_lora_mapping"]
    if meta is None:
        meta = LoRAKernelMeta.make(case.adapters, case.tokens, device)
    fill_kernel_meta(meta, step_tlm.cpu().numpy())
    args["token_lora_mapping"] = meta.token_lora_mapping[: case.tokens]
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    cpu["token_lora_mapping"] = step_tlm.cpu()
    cpu["lora_a_stacked"] = [t.cpu().clone() for t in args["lora_a_stacked"]]
    cpu["lora_b_stacked"] = [t.cpu().clone() for t in args["lora_b_stacked"]]
    a2_cpu, b2_cpu = a2.cpu().double(), b2.cpu().double()
    if poison is not None:
        for t in (*args["lora_a_stacked"], *args["lora_b_stacked"], a2, b2):
            t[0] = poison
    updated = buffer.double().cpu()
    if add_inputs:
        fused_moe_lora_reference(updated, **cpu, block_size=16)
    want_act = _act(kind, updated.view(-1, width))

    experts = cls(args, (a2, b2))
    experts.quant_config.gemm1_clamp_limit = clamp
    configure(experts)
    punica = SimpleNamespace(token_mapping_meta=meta)
    lora_context = LoraContext(args["adapter_enabled"], case.adapters, punica, **context)
    w2 = torch.empty(case.experts, HIDDEN, inter, device=device)  # only its shape is read
    shared = {"topk_weights": args["topk_weights"], "num_tokens": case.tokens, "w1": None,
              "w2": w2, "top_k_num": case.top_k}  # fmt: skip
    gemm_output = buffer.clone()
    act_out = torch.empty(buffer.shape[0] * buffer.shape[1], inter, device=device, dtype=dtype)
    down = down_base.clone()
    out = torch.full((case.tokens, HIDDEN), 777.0, device=device, dtype=dtype)

    def flow() -> None:
        buffer.fill_(float("nan"))  # until the base gate/up GEMM writes it
        if buffer.is_cuda and gemm_sleep_cycles:
            torch.cuda._sleep(gemm_sleep_cycles)
        buffer.copy_(gemm_output)
        lora_buffer = buffer if add_inputs else torch.zeros_like(buffer)
        routing = experts.apply_w13_lora(
            lora_context, y=lora_buffer, x=args["qcurr_hidden_states"], topk_ids=None,
            expert_map=None, add_inputs=add_inputs, **shared,
        )  # fmt: skip
        assert routing[3] is args["token_lora_mapping"]
        experts.activation(kind, act_out, buffer.view(-1, width))
        assert PENDING not in experts.__dict__
        assert GATE_UP_SIDE not in experts.__dict__
        names = ("sorted_token_ids_lora", "expert_ids_lora", "num_tokens_post_padded_lora",
                 "token_lora_mapping")  # fmt: skip
        down_routing = dict(zip(names, routing, strict=True))
        experts.apply_w2_lora(lora_context, y=down, x=act_out, **down_routing, **shared)
        experts.moe_sum(down, out)
        assert side_stream.LAUNCHED not in experts.__dict__

    def apply() -> None:
        # topk_weights has topk_ids' shape: the pairs, all that marking the inputs reads of it
        experts.apply(hidden_states=args["qcurr_hidden_states"], topk_ids=args["topk_weights"],
                      flow=flow)  # fmt: skip

    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            experts.main_stream = torch.cuda.current_stream()
            apply()
        captured.replay()  # the capture queued nothing: the replay does the work
    else:
        apply()

    # Tokens on a poisoned slot are left out; the others must match the spec of clean weights.
    kept = step_tlm.cpu() != 0 if poison is not None else torch.ones(case.tokens, dtype=torch.bool)
    kept_pairs = kept.repeat_interleave(case.top_k)
    want_down = down_base.double().cpu()
    fused_moe_lora_reference(
        want_down, act_out.double().cpu(), [a2_cpu], [b2_cpu],
        cpu["topk_weights"], cpu["sorted_token_ids"], cpu["expert_ids"],
        cpu["num_tokens_post_padded"], cpu["token_lora_mapping"], case.rank, case.top_k,
        cpu["lora_ids"], cpu["num_active_loras"], cpu["adapter_enabled"], block_size=16,
        mul_routed_weight=True,
    )  # fmt: skip
    want_sum = want_down.sum(dim=1)[kept]
    want_act = want_act[kept_pairs]
    return Applied(
        experts,
        float((act_out.double().cpu()[kept_pairs] - want_act).norm() / want_act.norm()),
        float((out.double().cpu()[kept] - want_sum).norm() / want_sum.norm()),
        down,
    )


def _down_ran_in_order(applied: Applied) -> bool:
    """Whether the down LoRA went vLLM's way: added into the GEMM's buffer, then moe_sum."""
    calls = applied.experts.down_calls
    stock = calls == [(True, applied.down_buffer)] and applied.experts.sums == 1
    beside = len(calls) == 1 and calls[0][0] is False and applied.experts.sums == 0
    assert stock or beside, f"neither flow: {calls}, {applied.experts.sums} sums"
    return stock


def test_silu_runs_the_fused_kernel_instead_of_the_original(classes: Any) -> None:
    applied = _apply(classes[0], Act.SILU)
    assert applied.experts.activations == []
    assert applied.act_error < 1e-5
    assert applied.sum_error < 1e-5
    assert _down_ran_in_order(applied), "a batch this small keeps vLLM's order"


@pytest.mark.parametrize("clamp", [None, 7.0], ids=["no_clamp", "clamp_in_config"])
def test_gpt_oss_swigluoai_runs_the_fused_kernel_instead_of_the_original(
    classes: Any, clamp: float | None
) -> None:
    """GPT-OSS's call: one slice, gate and up interleaved, swigluoai. vLLM calls its
    swigluoai_and_mul at the op's own alpha and limit whatever the quant config holds, so a
    clamp limit there does not keep it from the fused kernel."""
    applied = _apply(classes[0], Act.SWIGLUOAI, case=GPT_OSS, clamp=clamp)
    assert applied.experts.activations == []
    assert applied.act_error < 1e-5
    assert applied.sum_error < 1e-5


@pytest.mark.parametrize(
    ("kind", "case"), [(Act.SILU, GPT_OSS), (Act.SWIGLUOAI, CASE), (Act.GELU, GPT_OSS)],
    ids=["silu_one_slice", "swigluoai_two_slices", "gelu_one_slice"],
)  # fmt: skip
def test_an_activation_on_another_layout_gets_the_expand_first(
    classes: Any, kind: Act, case: Case
) -> None:
    """SiLU is fused on two slices side by side only, swigluoai on one slice interleaved only."""
    applied = _apply(classes[0], kind, case=case)
    assert applied.experts.activations == [kind]
    assert applied.act_error < 1e-5


def test_another_activation_gets_the_expand_first(classes: Any) -> None:
    applied = _apply(classes[0], Act.GELU)
    assert applied.experts.activations == [Act.GELU]
    assert applied.act_error < 1e-5


def test_clamped_silu_gets_the_expand_first(classes: Any) -> None:
    applied = _apply(classes[0], Act.SILU, clamp=7.0)
    assert applied.experts.activations == [Act.SILU]
    assert applied.act_error < 1e-5


def test_a_subclass_goes_the_stock_way(classes: Any, side_at_any_size: None) -> None:
    applied = _apply(classes[1], Act.SILU)
    assert applied.experts.activations == [Act.SILU]
    assert applied.act_error < 1e-5
    assert _down_ran_in_order(applied)


def test_a_delta_only_call_is_not_deferred(classes: Any, side_at_any_size: None) -> None:
    """vLLM's dual-stream option asks for the delta alone (add_inputs=False) into a buffer of
    its own; the activation then reads the base buffer, which the LoRA never touched."""
    applied = _apply(classes[0], Act.SILU, add_inputs=False)
    assert applied.experts.activations == [Act.SILU]
    assert applied.act_error < 1e-5
    assert _down_ran_in_order(applied)


@pytest.mark.parametrize(("kind", "case"), FLOWS, ids=FLOW_IDS)
def test_prefill_sized_down_lora_runs_beside_and_moe_sum_adds_it(
    classes: Any, side_at_any_size: None, kind: Act, case: Case
) -> None:
    """The down LoRA writes a delta buffer of its own (poisoned where it skips rows: tokens
    without adapter) and leaves the GEMM's buffer alone; moe_sum adds the delta."""
    applied = _apply(classes[0], kind, case=case)
    assert applied.experts.activations == ([Act.GELU] if kind is Act.GELU else [])
    assert not _down_ran_in_order(applied)
    assert applied.experts.down_calls[0][1] is not applied.down_buffer
    assert applied.act_error < 1e-5
    assert applied.sum_error < 1e-5


# A step with tokens on slot 0, on other slots and on none; then one of base-model tokens only.
MIXED = dataclasses.replace(CASE, tokens=12)
NO_ADAPTER = dataclasses.replace(MIXED, no_adapter=1.0)


@pytest.mark.parametrize("poison", [float("nan"), 1e30], ids=["nan", "huge"])
def test_beside_a_poisoned_adapter_and_in_a_step_without_adapters_after_it_others_keep_theirs(
    classes: Any, side_at_any_size: None, poison: float
) -> None:
    """Slot 0's weights NaN (or 1e30): the other tokens' activation and sum keep the spec of
    clean weights, in that step and in the next one, which has no adapter at all. There vLLM's
    LoRA calls return before any kernel (its no-LoRA flag), so no delta may go beside the GEMM:
    the one `moe_sum` added was never written (the stand-in poisons it with NaN), and a base
    token whose position held slot 0's token a step earlier read it through the stale mapping."""
    meta = LoRAKernelMeta.make(MIXED.adapters, MIXED.tokens, "cpu")
    poisoned = _apply(classes[0], Act.SILU, meta=meta, case=MIXED, poison=poison)
    assert set(meta.token_lora_mapping.tolist()) >= {-1, 0, 1}, "slot 0, another, none"
    assert not _down_ran_in_order(poisoned)
    assert poisoned.act_error < 1e-5 and poisoned.sum_error < 1e-5
    after = _apply(classes[0], Act.SILU, meta=meta, case=NO_ADAPTER, poison=poison, seed=8)
    assert after.act_error < 1e-6 and after.sum_error < 1e-6
    assert _down_ran_in_order(after), "a step without adapters keeps vLLM's order"


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda_graph"])
def test_on_a_gpu_a_step_without_adapters_after_a_poisoned_one_keeps_every_token(
    classes: Any, side_at_any_size: None, graph: bool
) -> None:
    """The test above in bf16 on the device, eagerly beside the GEMMs and in CUDA graphs, as
    vLLM captures one graph for steps with adapters and one for steps without: the memory a
    delta nobody wrote would hold is what the poisoned step left there."""
    meta = LoRAKernelMeta.make(MIXED.adapters, MIXED.tokens, "cuda")
    common: dict[str, Any] = {"meta": meta, "poison": float("nan"), "device": "cuda",
                              "dtype": torch.bfloat16, "graph": graph}  # fmt: skip
    _apply(classes[0], Act.SILU, case=MIXED, seed=3, **common)  # compiles, off the measure
    poisoned = _apply(classes[0], Act.SILU, case=MIXED, **common)
    after = _apply(classes[0], Act.SILU, case=NO_ADAPTER, seed=8, **common)
    torch.cuda.synchronize()
    assert poisoned.act_error < 2e-2 and poisoned.sum_error < 2e-2  # bf16 operands
    assert after.act_error < 2e-2 and after.sum_error < 2e-2
    assert _down_ran_in_order(after)


@pytest.mark.parametrize("context", [{"fully_sharded": True}, {"aux_stream": "vLLM's own"}])
def test_sharded_or_dual_stream_lora_keeps_vllm_order(
    classes: Any, side_at_any_size: None, context: dict[str, Any]
) -> None:
    applied = _apply(classes[0], Act.SILU, **context)
    assert _down_ran_in_order(applied)
    assert applied.sum_error < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [Act.SILU, Act.GELU])
def test_on_a_gpu_the_down_lora_runs_on_a_second_stream_between_the_right_waits(
    classes: Any, side_at_any_size: None, kind: Act
) -> None:
    """The stand-in's down LoRA sleeps ~25 ms on its stream before writing: moe_sum on the main
    stream must wait for it (a sum that did not would read the NaN poison). Its GELU-and-mul
    sleeps as long before writing its output: the down LoRA must wait for that. A first run on
    other inputs compiles the kernels, whose seconds on the host would hide a missing wait."""
    main = torch.cuda.current_stream()
    _apply(classes[0], kind, device="cuda", dtype=torch.bfloat16, seed=3)
    applied = _apply(classes[0], kind, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    assert not _down_ran_in_order(applied)
    assert applied.experts.down_streams[0] != main
    assert applied.act_error < 2e-2  # bf16 operands
    assert applied.sum_error < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "case"), FLOWS, ids=FLOW_IDS)
def test_in_a_cuda_graph_prefill_sized_loras_run_on_a_second_stream(
    classes: Any, monkeypatch: pytest.MonkeyPatch, kind: Act, case: Case
) -> None:
    """Captured as vLLM captures a batch (a graph of prefill size, where capture sizes reach
    it: this test's few pairs count as one), the gate/up LoRA and the down LoRA go on one
    second stream, forked from and joined to the capture stream (the capture fails on a fork
    never joined), with the waits of the eager tests above: the gate/up LoRA sleeps on its
    stream before its shrink, whose partial products the activation (or, before GELU-and-mul,
    the expand) reads; GELU-and-mul sleeps before writing the output the down LoRA reads; the
    down LoRA sleeps before writing its NaN-poisoned delta. A first eager run, beside, compiles
    every kernel the flow launches."""

    def sleep_before_gate_up(experts: StockExperts) -> None:
        experts.w13_sleep_cycles = 50_000_000  # ~25 ms: an activation that did not wait: junk

    monkeypatch.setattr(side_stream, "REGIMES", BESIDE_AT_ANY_SIZE)
    _apply(classes[0], kind, device="cuda", dtype=torch.bfloat16, seed=3, case=case)
    applied = _apply(classes[0], kind, device="cuda", dtype=torch.bfloat16, graph=True,
                     configure=sleep_before_gate_up, case=case)  # fmt: skip
    torch.cuda.synchronize()
    assert not _down_ran_in_order(applied)
    experts = applied.experts
    assert experts.w13_streams == experts.down_streams
    assert experts.down_streams[0] != experts.main_stream
    assert experts.activations == ([Act.GELU] if kind is Act.GELU else [])  # others: fused
    assert applied.act_error < 2e-2  # bf16 operands
    assert applied.sum_error < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "case"), FLOWS, ids=FLOW_IDS)
def test_a_decode_batch_keeps_both_loras_in_order_eagerly_and_in_a_cuda_graph(
    classes: Any, kind: Act, case: Case
) -> None:
    """A decode batch, run eagerly and captured as vLLM captures it: both LoRAs stay on the
    main stream in vLLM's order (the down LoRA added into the GEMM's buffer, vLLM's moe_sum),
    the gate/up expand still fused into SiLU-and-mul or swigluoai (before GELU-and-mul:
    launched first), the numbers the spec's."""
    eager = _apply(classes[0], kind, device="cuda", dtype=torch.bfloat16, seed=3, case=case)
    assert _down_ran_in_order(eager)
    assert eager.experts.w13_streams == [torch.cuda.current_stream()]
    applied = _apply(classes[0], kind, device="cuda", dtype=torch.bfloat16, graph=True, case=case)
    torch.cuda.synchronize()
    assert _down_ran_in_order(applied)
    experts = applied.experts
    assert experts.w13_streams == experts.down_streams == [experts.main_stream]
    assert experts.activations == ([Act.GELU] if kind is Act.GELU else [])  # others: fused
    assert applied.act_error < 2e-2  # bf16 operands
    assert applied.sum_error < 2e-2


def _spy_on_gate_up_side(experts_cls: type[StockExperts]) -> list[bool]:
    """Per activation call from now on: whether a gate/up LoRA on the side awaited its join."""
    seen: list[bool] = []
    activation = experts_cls.activation

    def spying_activation(self: Any, *args: Any, **kwargs: Any) -> None:
        seen.append(GATE_UP_SIDE in self.__dict__)
        activation(self, *args, **kwargs)

    experts_cls.activation = spying_activation
    return seen


@pytest.mark.parametrize(("kind", "case"), [FLOWS[0], FLOWS[2]], ids=[FLOW_IDS[0], FLOW_IDS[2]])
def test_prefill_sized_gate_up_lora_goes_beside_the_gemm_and_is_joined(
    classes: Any, side_at_any_size: None, kind: Act, case: Case
) -> None:
    """On the CPU the side stream is the current one: the flow marks the call as beside (the
    activation finds and joins it, `_apply` asserts it is gone) and the results hold."""
    experts_cls = classes[0]
    seen = _spy_on_gate_up_side(experts_cls)
    applied = _apply(experts_cls, kind, case=case)
    assert seen == [True]
    assert applied.act_error < 1e-5 and applied.sum_error < 1e-5


@pytest.mark.parametrize("context", [{"fully_sharded": True}, {"aux_stream": "vLLM's own"}])
def test_small_sharded_or_dual_stream_gate_up_lora_stays_on_the_main_stream(
    classes: Any, context: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    experts_cls = classes[0]
    seen = _spy_on_gate_up_side(experts_cls)
    _apply(experts_cls, Act.SILU)  # few pairs
    monkeypatch.setattr(side_stream, "REGIMES", BESIDE_AT_ANY_SIZE)
    applied = _apply(experts_cls, Act.SILU, **context)
    assert seen == [False, False]
    assert applied.act_error < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("waits_for", ["the shrink", "the GEMM"])
def test_on_a_gpu_the_gate_up_lora_runs_on_a_second_stream_between_the_right_waits(
    classes: Any, side_at_any_size: None, waits_for: str
) -> None:
    """The gate/up LoRA runs on the side stream from `apply`'s entry, beside the base GEMM.
    "the shrink": it sleeps ~25 ms on the side stream before its shrink; SiLU-and-mul, which
    reads the shrink's partial products, must wait for it. "the GEMM": the GEMM stand-in sleeps
    ~25 ms before it writes its buffer, and the LoRA runs whole (one fused launch, nothing
    deferred); the LoRA's add into that buffer must wait for the GEMM, or the GEMM's write would
    erase it. Either miss loses the LoRA: over half of the activation's norm here. A first run
    on other inputs compiles the kernels (a compile's seconds on the host would hide a missing
    wait) and leaves other values in the memory that the second run's buffers reuse."""
    main = torch.cuda.current_stream()
    sleep = 50_000_000  # cycles, ~25 ms

    def configure(experts: StockExperts) -> None:
        if waits_for == "the shrink":
            experts.w13_sleep_cycles = sleep
        else:
            experts.w13_config = FUSED

    _apply(classes[0], Act.SILU, device="cuda", dtype=torch.bfloat16, configure=configure, seed=3)
    applied = _apply(
        classes[0], Act.SILU, device="cuda", dtype=torch.bfloat16, configure=configure,
        gemm_sleep_cycles=sleep if waits_for == "the GEMM" else 0,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert applied.experts.w13_streams == [applied.experts.down_streams[0]]
    assert applied.experts.w13_streams[0] != main
    assert applied.act_error < 2e-2  # bf16 operands
    assert applied.sum_error < 2e-2
