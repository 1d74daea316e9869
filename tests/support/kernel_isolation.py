"""One adapter slot of poisoned weights beside good slots and tokens without adapter, for the CPU
and GPU kernel tests: NaN (a diverged fine-tune), or 1e30 (finite; fp16 rounds it to inf, and
in bf16 its products overflow to inf).

Each check runs a call three ways on the same draw (`moe_lora_cases.make_inputs`): with clean
weights (the reference); with slot POISONED's weights poisoned, where every token on another
slot or on none must come out bit for bit as in the reference (a kernel that multiplied such a
row by a mask, or by a zero weight, would turn 0 x NaN into NaN there); then, the poisoned slot
still loaded but its tokens moved off it, as a later batch without that adapter, where every
token must come out bit for bit as the clean call with that mapping. The poisoned call and the
later one run in `stale_memory`, so a workspace cell read but not written shows as NaN.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from loraplex.kernels.ops.lora_dense.op import lora_dense
from loraplex.kernels.ops.lora_dense.reference import lora_sort_meta
from loraplex.kernels.ops.lora_dense.tiled import lora_dense_tiled
from loraplex.kernels.ops.moe_lora.configs import MoeLoraConfig
from loraplex.kernels.ops.moe_lora.op import defer_gate_up_expand, fused_moe_lora
from tests.support.moe_lora_cases import Case, fused_activation, gate_up_call, make_inputs

POISONED = 0  # the slot whose weights are poisoned
LATER = {POISONED: -1}  # its tokens in the later call: moved to no adapter
POISONS = {"nan": float("nan"), "huge": 1e30}


@contextmanager
def stale_memory() -> Iterator[None]:
    """torch.empty hands out floating-point tensors full of NaN, as memory a poisoned call left
    behind would hold them: a kernel that reads a workspace cell it did not write shows it."""
    empty = torch.empty

    def nan_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = nan_empty  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.empty = empty  # type: ignore[assignment]


def poison(weights: list[torch.Tensor], value: float) -> None:
    for t in weights:
        t[POISONED] = value


def _three_ways(
    draw: Callable[[dict[int, int] | None], dict[str, Any]],
    run: Callable[[dict[str, Any]], torch.Tensor],
    weights: Callable[[dict[str, Any]], list[torch.Tensor]],
    token_rows: Callable[[torch.Tensor], torch.Tensor],
    value: float,
) -> None:
    """The check of the module docstring. draw(remap) -> a call's inputs; run(inputs) -> its
    output (rows per token or per pair); weights(inputs) -> the tensors a slot indexes;
    token_rows(slot per token) -> the slot of each output row."""
    reference = draw(None)
    slots = reference["token_lora_mapping"].cpu()
    assert (slots == POISONED).any(), "the poisoned slot has tokens"
    assert ((slots != POISONED) & (slots >= 0)).any() and (slots < 0).any(), "others and none"
    want = run(reference)
    poisoned = draw(None)
    poison(weights(poisoned), value)
    with stale_memory():
        got = run(poisoned)
    others = token_rows(slots) != POISONED
    assert torch.equal(got.cpu()[others], want.cpu()[others]), "another token's rows changed"
    want_later = run(draw(LATER))
    later = draw(LATER)
    poison(weights(later), value)
    with stale_memory():
        got_later = run(later)
    assert torch.equal(got_later.cpu(), want_later.cpu()), "a later call differs from clean"


def _pairs(case: Case) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda slots: slots.repeat_interleave(case.top_k)


def _weights(inputs: dict[str, Any]) -> list[torch.Tensor]:
    return [*inputs["lora_a_stacked"], *inputs["lora_b_stacked"]]


def check_moe_op(
    case: Case, config: MoeLoraConfig | None, dtype: torch.dtype, device: str, value: float
) -> None:
    """`fused_moe_lora` (any form and config); its output, rows per pair."""

    def run(inputs: dict[str, Any]) -> torch.Tensor:
        if not case.add_inputs:
            inputs["output"].fill_(777.0)
        fused_moe_lora(**inputs, shrink_block_size_m=case.block_m, config=config,
                       mul_routed_weight=case.mul_routed_weight, add_inputs=case.add_inputs,
                       offset=case.offset)  # fmt: skip
        return inputs["output"].reshape(case.tokens * case.top_k, -1)

    _three_ways(lambda remap: make_inputs(case, dtype, device, 3, remap), run, _weights,
                _pairs(case), value)  # fmt: skip


def check_expand_activation(
    case: Case, config: MoeLoraConfig, dtype: torch.dtype, device: str, value: float
) -> None:
    """The gate/up call's shrink, its expand fused into the plugin's activation (SiLU-and-mul
    for two slices, swigluoai for one interleaved); the activation's output, rows per pair."""

    def run(inputs: dict[str, Any]) -> torch.Tensor:
        with defer_gate_up_expand() as deferred:
            fused_moe_lora(**inputs, shrink_block_size_m=case.block_m, config=config)
        width = inputs["output"].shape[-1] // 2
        out = torch.empty(case.tokens * case.top_k, width, dtype=dtype, device=device)
        fused_activation(deferred[0], out)
        return out

    _three_ways(lambda remap: gate_up_call(case, dtype, device, 3, remap), run, _weights,
                _pairs(case), value)  # fmt: skip


def _dense_draw(
    tokens: int, k: int, rank: int, widths: list[int], slots: int, dtype: torch.dtype, device: str
) -> Callable[[dict[int, int] | None], dict[str, Any]]:
    def draw(remap: dict[int, int] | None) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, k, generator=gen)
        a = [torch.randn(slots, 1, rank, k, generator=gen) / k**0.5 for _ in widths]
        b = [torch.randn(slots, 1, n, rank, generator=gen) / rank**0.5 for n in widths]
        tlm = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
        for slot, to in (remap or {}).items():
            tlm = torch.where(tlm == slot, to, tlm).to(torch.int32)
        y = torch.randn(tokens, sum(widths) + 3, generator=gen)

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, dtype if t.is_floating_point() else t.dtype)

        return {"y": put(y), "x": put(x), "lora_a": [put(t) for t in a],
                "lora_b": [put(t) for t in b], "token_lora_mapping": put(tlm)}  # fmt: skip

    return draw


def no_adapter_last(tlm: torch.Tensor, max_loras: int) -> tuple[torch.Tensor, ...]:
    """`lora_sort_meta` in the plugin's order (`batch_metadata.fill_kernel_meta`): tokens without
    adapter, and their -1, after the adapters'."""
    key = torch.where(tlm < 0, max_loras, tlm)
    order, counts, starts, ids = lora_sort_meta(key, max_loras + 1)
    ids = torch.where(ids == max_loras, -1, ids)
    return order, counts[:-1], starts[:-1], ids[:-1]


def check_dense(
    tokens: int, k: int, rank: int, widths: list[int], slots: int, dtype: torch.dtype,
    device: str, value: float, tiled_order: str | None, add_inputs: bool,
) -> None:  # fmt: skip
    """The dense LoRA op: the decode GEMVs (`tiled_order` None), or the prefill tiles over vLLM's
    order of the batch ("vllm": -1 first) or the plugin's ("plugin": -1 last); y, rows per
    token."""

    def run(inputs: dict[str, Any]) -> torch.Tensor:
        y, tlm = inputs["y"], inputs["token_lora_mapping"]
        if not add_inputs:
            y.fill_(777.0)
        weights = (inputs["x"], inputs["lora_a"], inputs["lora_b"])
        if tiled_order is None:
            lora_dense(y, *weights, tlm, 0.5, add_inputs, block_n=32)
        else:
            sort = lora_sort_meta if tiled_order == "vllm" else no_adapter_last
            lora_dense_tiled(y, *weights, 0.5, *sort(tlm, slots), add_inputs, block_n=32)
        return y

    _three_ways(_dense_draw(tokens, k, rank, widths, slots, dtype, device), run,
                lambda inputs: [*inputs["lora_a"], *inputs["lora_b"]], lambda s: s,
                value)  # fmt: skip
