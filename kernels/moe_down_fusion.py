"""vLLM 0.26's `TritonExperts` with the down LoRA added inside the base down GEMM.

For a LoRA batch `TritonExperts.apply` (vllm/model_executor/layers/fused_moe/experts/
triton_moe.py) runs the base down GEMM (`invoke_fused_moe_triton_kernel` into
`intermediate_cache3`), then `apply_w2_lora` (the MoE-LoRA op, adding into that buffer), then
`moe_sum`. With these three wrappers the GEMM is held back (`moe_lora_op.HeldDownGemm`) until
the op's call, which runs its shrink only; the GEMM then runs as `moe_down_lora`'s kernel with
the LoRA in its epilogue, and the buffer is written once instead of written, read and written.

Only prefill-sized batches (MIN_PAIRS) of TritonExperts itself (not subclasses, whose `apply`
may differ) take this way, with unquantized weights without bias, vLLM's sorted blocks, no
expert map and vLLM's dual-stream option off. Everything else goes the stock way, and so does
the GEMM wherever the op's call is not ours to take (`moe_lora_op.down_gemm_held`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from .moe_down_lora import CONFIG_KEYS, expert_gemm_with_lora
from .moe_lora_op import DownLora, HeldDownGemm, down_gemm_held

# Pairs from which the GEMM is ours. Decode batches (vLLM's CUDA graphs, up to 512 tokens x
# top_k 8 = 4,096 pairs) keep vLLM's kernel, whose decode time the plugin's targets are met with.
MIN_PAIRS = 8192
_QUANT_FLAGS = ("use_fp8_w8a8", "use_int8_w8a8", "use_int8_w8a16", "use_int4_w4a16")


@dataclass
class _ApplyCall:
    """One TritonExperts.apply that may hold its down GEMM: its w2, and the GEMM once held."""

    w2: torch.Tensor
    held: HeldDownGemm | None = None


_current_apply: ContextVar[_ApplyCall | None] = ContextVar("loraplex_apply", default=None)


def fused_methods(
    experts_cls: type, apply: Callable[..., Any], apply_w2_lora: Callable[..., Any],
    invoke: Callable[..., None],
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., None]]:  # fmt: skip
    """(apply, apply_w2_lora, invoke_fused_moe_triton_kernel) for `experts_cls`, wrapping its
    originals and the module's GEMM launcher `invoke`."""

    def holding_apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        lora_context = getattr(self, "_lora_context", None)
        ours = (
            type(self) is experts_cls and not args and "w2" in kwargs
            and kwargs.get("expert_map") is None
            and lora_context is not None and lora_context.aux_stream is None
        )  # fmt: skip
        if not ours:
            return apply(self, *args, **kwargs)
        token = _current_apply.set(_ApplyCall(kwargs["w2"]))
        try:
            return apply(self, *args, **kwargs)
        finally:
            _current_apply.reset(token)

    def holding_invoke(*args: Any, **kwargs: Any) -> None:
        call = _current_apply.get()
        if call is None or call.held is not None or len(args) != 12 or args[1] is not call.w2:
            invoke(*args, **kwargs)
            return
        a, w, c, a_scale, w_scale, weights, sorted_ids, expert_ids, ntpp, mul, top_k, cfg = args
        plain = a_scale is None and w_scale is None and kwargs.get("B_bias") is None
        plain = plain and not any(kwargs.get(flag) for flag in _QUANT_FLAGS)
        fits = (
            plain and sorted_ids is not None and top_k == 1 and a.shape[0] >= MIN_PAIRS
            and a.dtype in (torch.bfloat16, torch.float16) and CONFIG_KEYS.issuperset(cfg)
            and a.shape[0] >= cfg["BLOCK_SIZE_M"]
        )  # fmt: skip
        if not fits:
            invoke(*args, **kwargs)
            return

        def launch(lora: DownLora | None) -> None:
            if lora is None:
                invoke(*args, **kwargs)
            else:
                expert_gemm_with_lora(a, w, c, weights, sorted_ids, expert_ids, ntpp, cfg, mul,
                                      lora)  # fmt: skip

        call.held = HeldDownGemm(c, launch)

    def fusing_apply_w2_lora(self: Any, lora_context: Any, **kwargs: Any) -> Any:
        call = _current_apply.get()
        if call is None or call.held is None or call.held.done:
            return apply_w2_lora(self, lora_context, **kwargs)
        with down_gemm_held(call.held):
            return apply_w2_lora(self, lora_context, **kwargs)

    fusing_apply_w2_lora._loraplex = True  # type: ignore[attr-defined]  # marks the patch as done
    return holding_apply, fusing_apply_w2_lora, holding_invoke


def patch_down_gemm() -> None:
    """Put the three wrappers on vLLM's TritonExperts and its module's GEMM launcher, once."""
    from vllm.model_executor.layers.fused_moe.experts import triton_moe

    experts = triton_moe.TritonExperts
    if getattr(experts.apply_w2_lora, "_loraplex", False):
        return
    apply, apply_w2_lora, invoke = fused_methods(
        experts, experts.apply, experts.apply_w2_lora, triton_moe.invoke_fused_moe_triton_kernel
    )
    experts.apply = apply  # type: ignore[method-assign]
    experts.apply_w2_lora = apply_w2_lora  # type: ignore[method-assign]
    triton_moe.invoke_fused_moe_triton_kernel = invoke
