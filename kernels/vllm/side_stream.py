"""The MoE LoRA beside vLLM's base GEMMs, on a second CUDA stream (prefill sizes).

For a LoRA batch vLLM 0.26's `TritonExperts.apply` runs on one stream: the base gate/up GEMM,
the gate/up LoRA, SiLU-and-mul, the base down GEMM into `intermediate_cache3`, the down LoRA
added into that buffer (`apply_w2_lora`), then `moe_sum` of the buffer into the layer's output.
Each LoRA waits for its GEMM, though it needs only the GEMM's input. In the H200 profile of a
16 x 1600-token prefill the down expand alone took 29 ms of the 448 ms.

The down LoRA: SiLU-and-mul marks its output ready (`mark_ready`, an event on the main stream);
`apply_w2_lora`, called once the base down GEMM is queued, runs vLLM's own down LoRA on a side
stream that waits for that event only, into a delta buffer (add_inputs=False); `moe_sum` waits
for the side stream and sums the experts' outputs and the deltas in one pass (`moe_lora_sum`).
The base GEMM is queued before the LoRA's host work, so the GPU does not wait for that work.

The gate/up LoRA: `apply` marks its inputs ready at its entry (`mark_inputs_ready`), before it
queues the base gate/up GEMM; the gate/up LoRA call (vLLM's routing of the LoRA pairs and our
op's shrink, its expand deferred into SiLU-and-mul) then runs on the side stream from that event
(`gate_up_beside`), and SiLU-and-mul waits for it. A call that would write the GEMM's output
there (our op undeferred, or vLLM's) first makes the side stream wait for the GEMM. On the H200
this took the 16 x 1600-token prefill from 0.4381 to 0.4326 and 0.4327 s (bench_e2e.py, same
machine, median of 9).

Only at prefill sizes (`REGIMES.side_stream`): at decode sizes, CUDA graphs included, both
LoRAs run on the main stream in order, the gate/up expand fused into SiLU-and-mul under PDL
(docs/kernels.md, "Decode: in order"). Never with an expert map or on a step without adapters
(`fused_experts` marks nothing ready then), vLLM's own dual-stream option or fully sharded LoRA;
those keep vLLM's order. Without CUDA (the CPU tests) the same steps run in order on the current
stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from loraplex.kernels.dispatch import REGIMES
from loraplex.kernels.ops.moe_lora_sum.op import moe_sum_with_delta

# On the experts object: SiLU-and-mul's output, ready (until apply_w2_lora); the launched
# down LoRA (until moe_sum).
READY = "_loraplex_down_input_ready"
LAUNCHED = "_loraplex_down_side"

_STREAMS: dict[int, torch.cuda.Stream] = {}


@dataclass(frozen=True)
class Ready:
    """The down LoRA's input (SiLU-and-mul's output) and the event after which it is written
    (None without CUDA)."""

    x: torch.Tensor
    event: torch.cuda.Event | None


@dataclass(frozen=True)
class SideDown:
    """A down LoRA launched on the side stream; holds every tensor it reads until moe_sum."""

    lora_context: Any
    call: dict[str, Any]  # vLLM's apply_w2_lora keyword arguments, y the delta
    stream: torch.cuda.Stream | None  # None without CUDA: it ran in order

    @property
    def delta(self) -> torch.Tensor:
        return self.call["y"]

    def join(self) -> None:
        """Make the current stream wait for the side stream's work."""
        _wait_for(self.stream, self.delta.device)


def _wait_for(stream: torch.cuda.Stream | None, device: torch.device) -> None:
    if stream is not None:
        torch.cuda.current_stream(device).wait_stream(stream)


def _ready_event(t: torch.Tensor, pairs: int) -> tuple[bool, torch.cuda.Event | None]:
    """(whether work on `pairs` (token, expert) pairs may go beside (`REGIMES.side_stream`:
    prefill sizes); an event on the main stream after the work queued so far, None without
    CUDA)."""
    if not REGIMES.side_stream(pairs):
        return False, None
    if not t.is_cuda:
        return True, None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return True, event


def _side_allowed(lora_context: Any) -> bool:
    """vLLM's own dual-stream option and fully sharded LoRA keep vLLM's order."""
    return not lora_context.fully_sharded and lora_context.aux_stream is None


def mark_ready(x: torch.Tensor) -> Ready | None:
    """SiLU-and-mul has just been queued writing x, (pairs, N): the marker apply_w2_lora looks
    for, or None where the work may not go beside (`_ready_event`)."""
    beside, event = _ready_event(x, x.shape[0])
    return Ready(x, event) if beside else None


@dataclass(frozen=True)
class InputsReady:
    """`apply`'s inputs (hidden states, routing) are queued: the event after which they are
    written, recorded before the base gate/up GEMM is queued (None without CUDA)."""

    event: torch.cuda.Event | None


def mark_inputs_ready(hidden_states: torch.Tensor, topk_ids: torch.Tensor) -> InputsReady | None:
    """At `apply`'s entry: the marker the gate/up LoRA call looks for, or None where the work
    may not go beside (`_ready_event`)."""
    beside, event = _ready_event(hidden_states, topk_ids.numel())
    return InputsReady(event) if beside else None


@dataclass(frozen=True)
class SideGateUp:
    """A gate/up LoRA shrink (and vLLM's routing of the LoRA pairs) launched on the side stream;
    `join` before anything on the main stream reads its results."""

    stream: torch.cuda.Stream | None  # None without CUDA: it ran in order
    device: torch.device

    def join(self) -> None:
        _wait_for(self.stream, self.device)


@contextlib.contextmanager
def gate_up_beside(
    inputs: InputsReady | None, lora_context: Any, x: torch.Tensor
) -> Iterator[tuple[SideGateUp | None, Callable[[], None] | None]]:
    """Around vLLM's gate/up LoRA call (its routing and our op, expand deferred): on the side
    stream, after `apply`'s inputs are ready and beside the base gate/up GEMM, where `inputs`
    marks a call that qualifies (`_ready_event`). Yields (the launched side work or None, the hook
    a write of the GEMM's output must call first: the side stream then waits for the GEMM)."""
    if inputs is None or not _side_allowed(lora_context):
        yield None, None
        return
    if inputs.event is None:
        yield SideGateUp(None, x.device), None
        return
    main = torch.cuda.current_stream(x.device)
    stream = _side_stream(x.device)
    stream.wait_event(inputs.event)
    with torch.cuda.stream(stream):
        yield SideGateUp(stream, x.device), lambda: stream.wait_stream(main)


def keep_for_main(tensors: Iterable[torch.Tensor | None], side: SideGateUp) -> None:
    """Tensors the side stream allocated that the main stream reads later: the allocator must
    not hand their memory to the side stream again before those reads."""
    if side.stream is None:
        return
    for t in tensors:
        if t is not None:
            t.record_stream(torch.cuda.current_stream(t.device))


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        # High priority: its blocks go ahead of the GEMM's waiting ones as SMs free up, so the
        # short LoRA work finishes inside the GEMM's time rather than after it.
        _STREAMS[index] = torch.cuda.Stream(device=index, priority=-1)
    return _STREAMS[index]


def _goes_beside(ready: Ready | None, lora_context: Any, call: dict[str, Any]) -> bool:
    return (
        ready is not None
        and ready.x is call["x"]
        and call.get("add_inputs", True)
        and call.get("token_lora_mapping") is not None
        and _side_allowed(lora_context)
    )


def side_methods(
    apply_w2_lora: Callable[..., Any], moe_sum: Callable[..., Any]
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(apply_w2_lora, moe_sum) for the experts class, wrapping its originals: both go vLLM's
    way unless SiLU-and-mul marked its output ready (`mark_ready`) and the call qualifies."""

    def side_launching_apply_w2_lora(self: Any, lora_context: Any, **call: Any) -> None:
        ready: Ready | None = self.__dict__.pop(READY, None)
        drop_side(self)
        if not _goes_beside(ready, lora_context, call):
            apply_w2_lora(self, lora_context, **call)
            return
        assert ready is not None
        stream = None
        if ready.event is not None:
            stream = _side_stream(ready.x.device)
            stream.wait_event(ready.event)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            # Allocated on the side stream: a block the main stream freed after the event may
            # still be in use by main-stream work queued since, which the side stream does not
            # wait for. Once moe_sum has read it, the block may go back to the side stream
            # without a record_stream (which, during a capture, would hold every layer's delta
            # until the capture ends): all side-stream work starts with a wait on an event
            # recorded later on the main stream, so it follows that read.
            side_call = {**call, "y": torch.empty_like(call["y"]), "add_inputs": False}
            apply_w2_lora(self, lora_context, **side_call)
        self.__dict__[LAUNCHED] = SideDown(lora_context, side_call, stream)

    def delta_adding_moe_sum(self: Any, input: torch.Tensor, output: torch.Tensor) -> None:
        side: SideDown | None = self.__dict__.pop(LAUNCHED, None)
        if side is None or side.delta.shape != input.shape:
            if side is not None:
                side.join()
            moe_sum(self, input, output)
            return
        side.join()
        context = side.lora_context
        moe_sum_with_delta(input, side.delta, side.call["token_lora_mapping"],
                           context.adapter_enabled, context.max_loras, output)  # fmt: skip

    return side_launching_apply_w2_lora, delta_adding_moe_sum


def drop_side(experts: Any) -> None:
    """Forget a launched down LoRA no moe_sum will add (after waiting for it, so that its
    buffers are free to reuse)."""
    side: SideDown | None = experts.__dict__.pop(LAUNCHED, None)
    if side is not None:
        side.join()
