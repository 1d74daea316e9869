"""The down (w2) LoRA beside vLLM's base down GEMM, on a second CUDA stream, at prefill sizes.

For a LoRA batch vLLM 0.26's `TritonExperts.apply` runs on one stream: the base gate/up GEMM,
the gate/up LoRA, SiLU-and-mul, the base down GEMM into `intermediate_cache3`, the down LoRA
added into that buffer (`apply_w2_lora`), then `moe_sum` of the buffer into the layer's output.
The down LoRA waits for the GEMM, though it needs only SiLU-and-mul's output, and its
read-modify-write of the buffer (pairs x hidden, both ways) is memory traffic after a GEMM bound
by arithmetic. In the H200 profile of a 16 x 1600-token prefill at a2a717e the down expand alone
took 29 ms of the 448 ms.

Here, once SiLU-and-mul has written the down LoRA's input, vLLM's own `apply_w2_lora` runs on a
side stream into a delta buffer (add_inputs=False) while the main stream runs the base GEMM.
`apply_w2_lora` then has nothing left to do, and `moe_sum` waits for the side stream and sums
the experts' outputs and the deltas in one pass (`moe_lora_sum`).

Only from SIDE_MIN_PAIRS (token, expert) pairs on, outside CUDA-graph capture, and not with an
expert map, vLLM's own dual-stream option or fully sharded LoRA; otherwise vLLM's order. Without
CUDA (the CPU tests) the same steps run in order on the current stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .moe_lora_sum import moe_sum_with_delta

# Prefill sizes: vLLM's CUDA-graph (decode) batches stay far below this many pairs (the e2e
# workload's prefill chunks have 73,728 and 131,072).
SIDE_MIN_PAIRS = 8192
# On the experts object, from the gate/up LoRA call to SiLU-and-mul, then to moe_sum.
PLAN = "_loraplex_down_plan"
LAUNCHED = "_loraplex_down_side"

_STREAMS: dict[int, torch.cuda.Stream] = {}


@dataclass(frozen=True)
class DownPlan:
    """The down LoRA call this `apply` will make, known at its gate/up LoRA call: vLLM's
    `apply_w2_lora` keyword arguments but y and x."""

    lora_context: Any
    call: dict[str, Any]


@dataclass(frozen=True)
class SideDown:
    """A down LoRA launched on the side stream; holds every tensor it reads until moe_sum."""

    plan: DownPlan
    x: torch.Tensor  # its input, SiLU-and-mul's output
    delta: torch.Tensor  # (tokens, top_k, hidden): its output, rows of LoRA tokens only
    stream: torch.cuda.Stream | None  # None without CUDA: it ran in order

    def join(self) -> None:
        """Make the current stream wait for the side stream's work."""
        if self.stream is not None:
            torch.cuda.current_stream(self.delta.device).wait_stream(self.stream)


def plan_down(lora_context: Any, w13_call: dict[str, Any], routing: Any) -> DownPlan | None:
    """The plan from the gate/up call's arguments and its routing (vLLM's `apply_w13_lora`
    returns sorted ids, expert ids, padded counts, token slots), or None where the down LoRA
    should run vLLM's way."""
    if lora_context.fully_sharded or lora_context.aux_stream is not None:
        return None
    if not isinstance(routing, tuple) or len(routing) != 4 or routing[3] is None:
        return None
    if w13_call["topk_weights"].numel() < SIDE_MIN_PAIRS:
        return None
    names = ("sorted_token_ids_lora", "expert_ids_lora", "num_tokens_post_padded_lora",
             "token_lora_mapping")  # fmt: skip
    call = {key: w13_call[key] for key in ("topk_weights", "num_tokens", "w1", "w2", "top_k_num")}
    return DownPlan(lora_context, {**call, **dict(zip(names, routing, strict=True))})


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        # High priority: its blocks go ahead of the GEMM's waiting ones as SMs free up, so the
        # short LoRA work finishes inside the GEMM's time rather than after it.
        _STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _STREAMS[index]


def start_down(apply_w2_lora: Callable[..., Any], experts: Any, plan: DownPlan,
               x: torch.Tensor) -> SideDown | None:  # fmt: skip
    """Launch vLLM's down LoRA on the side stream into a new delta buffer; None (nothing
    launched) while a CUDA graph is being captured."""
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    tokens, top_k = plan.call["topk_weights"].shape
    hidden = plan.call["w2"].shape[1]
    delta = torch.empty((tokens, top_k, hidden), dtype=x.dtype, device=x.device)
    stream = _side_stream(x.device)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        apply_w2_lora(experts, plan.lora_context, y=delta, x=x, add_inputs=False, **plan.call)
    return SideDown(plan, x, delta, stream)


def side_methods(
    apply_w2_lora: Callable[..., Any], moe_sum: Callable[..., Any]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(apply_w2_lora, moe_sum) for the experts class, wrapping its originals: both go vLLM's
    way unless a down LoRA for this `apply` was launched on the side stream."""

    def side_aware_apply_w2_lora(
        self: Any, lora_context: Any, *, y: torch.Tensor, x: torch.Tensor, **kwargs: Any
    ) -> Any:
        side: SideDown | None = self.__dict__.get(LAUNCHED)
        if side is not None and side.x is x and side.delta.shape == y.shape:
            return None  # the side stream computes this call; moe_sum adds its delta
        drop_side(self)
        return apply_w2_lora(self, lora_context, y=y, x=x, **kwargs)

    def delta_adding_moe_sum(self: Any, input: torch.Tensor, output: torch.Tensor) -> None:
        side: SideDown | None = self.__dict__.pop(LAUNCHED, None)
        if side is None or side.delta.shape != input.shape:
            if side is not None:
                side.join()
            moe_sum(self, input, output)
            return
        side.join()
        context = side.plan.lora_context
        moe_sum_with_delta(input, side.delta, side.plan.call["token_lora_mapping"],
                           context.adapter_enabled, context.max_loras, output)  # fmt: skip

    return side_aware_apply_w2_lora, delta_adding_moe_sum


def drop_side(experts: Any) -> None:
    """Forget a launched down LoRA no moe_sum will add (after waiting for it, so that its
    buffers are free to reuse)."""
    side: SideDown | None = experts.__dict__.pop(LAUNCHED, None)
    if side is not None:
        side.join()
