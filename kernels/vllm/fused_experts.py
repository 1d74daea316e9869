"""vLLM 0.26's `TritonExperts` with the gate/up LoRA expand fused into the activation.

For a LoRA batch `TritonExperts.apply` (vllm/model_executor/layers/fused_moe/experts/
triton_moe.py) runs the base gate/up GEMM into `intermediate_cache1`, then `apply_w13_lora`
(the MoE-LoRA op, adding into that buffer), then `activation(intermediate_cache2,
intermediate_cache1)`. With these two methods in place, `apply_w13_lora` runs the op's shrink
only (`ops.moe_lora.op.defer_gate_up_expand`) and `activation` adds the LoRA on the fly into the
activation (`ops.moe_lora.act`): the buffer is read once, not read, written and read again. Two
calls are fused: plain SiLU on two slices side by side (`FusedMoEWithLoRA`, Qwen3:
`expand_silu_and_mul`), and swigluoai on one slice (`FusedMoE3DWithLoRA`, GPT-OSS, whose gate and
up are interleaved as swigluoai reads them: `expand_swigluoai_and_mul`, at the alpha and limit
vLLM's swigluoai_and_mul defaults to, which vLLM's fused experts call it with).

Everything else goes the stock way: subclasses of TritonExperts (their `apply` may differ),
vLLM's dual-stream option (it asks for the delta alone, add_inputs=False), expert parallelism,
swapped slices, steps without adapters (`_batch_has_adapters`), calls our op declines (vLLM's
kernel then adds as before), and any other activation or layout (clamped SiLU, SiLU on one
slice, swigluoai on two), before which the deferred expand is launched unfused.

At prefill sizes both LoRAs run on a side stream beside the base GEMMs (`side_stream`): the
gate/up LoRA's routing and shrink from `apply`'s entry, which marks its inputs ready (so `apply`
is patched too), and the down LoRA from the moment the activation's output is ready, its delta
added by `moe_sum` (the side-stream module supplies those two methods). At decode sizes, CUDA
graphs included, both run in order on the main stream.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loraplex.kernels.ops.moe_lora.act import (
    expand_silu_and_mul,
    expand_swigluoai_and_mul,
    fits,
)
from loraplex.kernels.ops.moe_lora.op import SplitExpand, defer_gate_up_expand
from loraplex.kernels.vllm.side_stream import (
    READY,
    SideGateUp,
    drop_side,
    gate_up_beside,
    keep_for_main,
    mark_inputs_ready,
    mark_ready,
    side_methods,
)

# On the experts object between its two calls in one `apply`: the deferred expands, and whether
# the down LoRA may go beside the down GEMM (the gate/up call went our way).
PENDING = "_loraplex_pending_gate_up"
BESIDE = "_loraplex_down_beside"
# From `apply`'s entry to its gate/up LoRA call: its inputs are ready (side_stream);
# from that call to the activation: the gate/up LoRA work launched on the side stream.
INPUTS_READY = "_loraplex_inputs_ready"
GATE_UP_SIDE = "_loraplex_gate_up_side"


def _batch_has_adapters(lora_context: Any) -> bool:
    """Whether a token of this step is on an adapter (vLLM's no-LoRA flag, a CPU tensor). On a
    step without, vLLM's LoRA calls return before their kernels, so the step goes vLLM's way:
    a down LoRA beside the GEMM would leave its delta unwritten, and `moe_sum` add it."""
    return not bool(lora_context.punica_wrapper.token_mapping_meta.no_lora_flag_cpu[0])


def _join_gate_up_side(experts: Any) -> None:
    side: SideGateUp | None = experts.__dict__.pop(GATE_UP_SIDE, None)
    if side is not None:
        side.join()


def fused_methods(
    experts_cls: type, apply: Callable[..., Any], apply_w13_lora: Callable[..., Any],
    activation: Callable[..., Any], apply_w2_lora: Callable[..., Any],
    moe_sum: Callable[..., Any], silu: object, swigluoai: object,
) -> tuple[Callable[..., Any], ...]:  # fmt: skip
    """(apply, apply_w13_lora, activation, apply_w2_lora, moe_sum) for `experts_cls`, wrapping
    its originals; `silu` and `swigluoai` are vLLM's MoEActivation.SILU and .SWIGLUOAI."""

    def marking_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        hidden_states, topk_ids = kwargs.get("hidden_states"), kwargs.get("topk_ids")
        inputs = None
        if hidden_states is not None and topk_ids is not None:
            inputs = mark_inputs_ready(hidden_states, topk_ids)
        self.__dict__[INPUTS_READY] = inputs
        return apply(self, *args, **kwargs)

    def deferring_apply_w13_lora(
        self: Any, lora_context: Any, *, add_inputs: bool = True, swap_w13_slices: bool = False,
        expert_map: Any = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        inputs = self.__dict__.pop(INPUTS_READY, None)
        for key in (PENDING, BESIDE, READY):
            self.__dict__.pop(key, None)
        _join_gate_up_side(self)
        drop_side(self)
        call = {"add_inputs": add_inputs, "swap_w13_slices": swap_w13_slices,
                "expert_map": expert_map, **kwargs}  # fmt: skip
        stock_flow = type(self) is not experts_cls or swap_w13_slices or expert_map is not None
        if stock_flow or not add_inputs or not _batch_has_adapters(lora_context):
            return apply_w13_lora(self, lora_context, **call)
        with (
            gate_up_beside(inputs, lora_context, kwargs["x"]) as (side, guard),
            defer_gate_up_expand(guard) as deferred,
        ):
            routing = apply_w13_lora(self, lora_context, **call)
        if side is not None:
            keep_for_main([*routing, *(expand.ws for expand in deferred)], side)
            self.__dict__[GATE_UP_SIDE] = side
        if deferred:
            self.__dict__[PENDING] = deferred
        self.__dict__[BESIDE] = True
        return routing

    def fused_activation(self: Any, kind: Any, expand: SplitExpand) -> Callable[..., None] | None:
        """The fused form of this activation on the expand's layout, if there is one."""
        if kind == silu and expand.slices() == 2:
            # SiLU with a clamp limit is another kernel; an unknown config is not unclamped.
            unclamped = getattr(self.quant_config, "gemm1_clamp_limit", "unknown") is None
            return expand_silu_and_mul if unclamped else None
        if kind == swigluoai and expand.slices() == 1:
            return expand_swigluoai_and_mul
        return None

    def fusing_activation(self: Any, kind: Any, output: Any, input: Any, **kwargs: Any) -> None:
        _join_gate_up_side(self)
        pending: list[SplitExpand] = self.__dict__.pop(PENDING, [])
        fused = None
        if len(pending) == 1 and fits(pending[0], input, output):
            fused = fused_activation(self, kind, pending[0])
        if fused is not None:
            fused(pending[0], output)
        else:
            for expand in pending:
                expand.launch()
            activation(self, kind, output, input, **kwargs)
        if self.__dict__.pop(BESIDE, False) and (ready := mark_ready(output)):
            self.__dict__[READY] = ready

    fusing_activation._loraplex = True  # type: ignore[attr-defined]  # marks the patch as done
    return (marking_apply, deferring_apply_w13_lora, fusing_activation,
            *side_methods(apply_w2_lora, moe_sum))  # fmt: skip


# fused_methods' order
METHODS = ("apply", "apply_w13_lora", "activation", "apply_w2_lora", "moe_sum")


def install(experts_cls: type, silu: object, swigluoai: object) -> None:
    """Replace experts_cls's five methods (METHODS) with ours wrapping them; `silu` and
    `swigluoai` are the activation kinds its `activation` is called with."""
    apply, w13, activation, w2, moe_sum = (getattr(experts_cls, name) for name in METHODS)
    ours = fused_methods(experts_cls, apply, w13, activation, w2, moe_sum, silu, swigluoai)
    for name, method in zip(METHODS, ours, strict=True):
        setattr(experts_cls, name, method)


def patch_triton_experts() -> None:
    """Put our METHODS on vLLM's TritonExperts, once."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    if not getattr(TritonExperts.activation, "_loraplex", False):
        install(TritonExperts, MoEActivation.SILU, MoEActivation.SWIGLUOAI)
