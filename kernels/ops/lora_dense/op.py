"""Dense LoRA for decode batches: vLLM 0.26's `add_lora_linear` semantics in one launch
(`lora_dense`, its kernel in `kernels`).

Spec (`reference.lora_dense_reference`), with T tokens, S <= 3 slices of widths N_s, rank R,
slot(t) = token_lora_mapping[t] (-1: no adapter):

    for t with 0 <= slot(t) < L, for s:
        delta = round_to_weight_dtype(scale * x[t] @ A[s][slot].T) @ B[s][slot].T     # (N_s,)
        cols = N_0 + ... + N_{s-1} + [0, N_s)
        y[t, cols] = (y[t, cols] if add_inputs else 0) + delta

x: (T, K); y: (T, >= sum N_s) with unit stride along columns; A[s]: (L, 1, R, K);
B[s]: (L, 1, N_s, R), as vLLM stacks them (contiguous in K and R). Tokens without adapter are
left untouched. Decode-sized batches only: the plugin serves larger ones with
`tiled.lora_dense_tiled`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from loraplex.kernels.ops.lora_dense import kernels as kt

MAX_SLICES = 3


class UnsupportedDenseCall(ValueError):
    """Weights in a layout this op does not take (the plugin hands such calls to vLLM)."""


@lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_layout(
    y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor]
) -> None:
    """Raise UnsupportedDenseCall for weights or activations in a layout the kernels do not take."""
    if not 1 <= len(a) <= MAX_SLICES or len(b) != len(a):
        raise UnsupportedDenseCall(
            f"1 to {MAX_SLICES} slices with as many B as A, got {len(a)}/{len(b)}"
        )
    k = x.shape[1]
    for s, (ta, tb) in enumerate(zip(a, b, strict=True)):
        if ta.dim() != 4 or ta.shape[1] != 1 or ta.shape[3] != k or ta.stride(3) != 1:
            raise UnsupportedDenseCall(
                f"A[{s}] {tuple(ta.shape)} must be (L, 1, R, K={k}), K contiguous"
            )
        if tb.dim() != 4 or tb.shape[3] != ta.shape[2] or tb.stride(3) != 1:
            raise UnsupportedDenseCall(
                f"B[{s}] {tuple(tb.shape)} must be (L, 1, N, R), R contiguous"
            )
        if ta.stride(0) != a[0].stride(0) or ta.stride(2) != a[0].stride(2):
            raise UnsupportedDenseCall("all A slices must share strides")
        if tb.stride(2) != b[0].stride(2):
            raise UnsupportedDenseCall("all B slices must share their row stride")
    if y.shape[0] != x.shape[0] or y.stride(1) != 1 or x.stride(1) != 1:
        raise UnsupportedDenseCall(
            f"y {tuple(y.shape)} and x {tuple(x.shape)}: same tokens, unit columns"
        )
    if sum(t.shape[2] for t in b) > y.shape[1]:
        raise ValueError(f"slice widths {[t.shape[2] for t in b]} exceed y width {y.shape[1]}")


def call_shape(
    y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]
) -> tuple[int, int, int, int, int] | None:
    """(tokens, K, slices, rank, BLOCK_R) of a call in a layout the kernels take (else
    `check_layout` raises); None where there are no tokens, so nothing to launch."""
    check_layout(y, x, lora_a, lora_b)
    num_tokens, k = x.shape
    if num_tokens == 0:
        return None
    rank = lora_a[0].shape[2]
    return num_tokens, k, len(lora_a), rank, max(16, triton.next_power_of_2(rank))


def padded_slices(
    lora_a: list[torch.Tensor], lora_b: list[torch.Tensor]
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """A, B and slice widths padded to MAX_SLICES entries, as the kernels take them (a padding
    slice repeats the last weights and has width 0, so no program works on it)."""
    pad = MAX_SLICES - len(lora_a)
    widths = [t.shape[2] for t in lora_b] + [0] * pad
    return [*lora_a, *lora_a[-1:] * pad], [*lora_b, *lora_b[-1:] * pad], widths


# Launch shape. Both rules come from bench/kernels/bench_dense_decode.py on the H200 (Qwen3-30B-A3B
# attention, 8 rank-32 slots, each call after its base GEMM, over cold weights; rows in
# bench/kernels/results/dense_decode_nvidia_h200.jsonl, all of a two-launch form of this op that
# used the same shape; this kernel is not re-timed there). What the LoRA added to the GEMM at 16
# tokens: o with 32 K ranges of 128 took 6.6 us, with 16 ranges of 256 4.6 us; qkv with
# 64-column expand tiles 7.7 us, 256 columns 6.0 us (64 tokens: 14.8 and 9.6 us). The e2e
# decode went from 67.14 to 68.1 tok/s per request (base 75.71).
SHRINK_PROGRAMS_PER_SM = 4  # decode batches are too small to fill the GPU otherwise
MIN_K_PER_RANGE = 256  # below it the expand's sum over the ranges costs more than they save
WIDE_SLICE = 4096  # a slice this wide (q) takes WIDE_BLOCK_N columns per expand program
WIDE_BLOCK_N, BLOCK_N = 256, 128


def launch_shape(tokens: int, k: int, slices: int, widest: int, sms: int) -> tuple[int, int]:
    """(split_k, block_n) for a call: K ranges doubling while the shrink has under
    SHRINK_PROGRAMS_PER_SM programs per SM and each range keeps MIN_K_PER_RANGE of K; expand
    tiles of WIDE_BLOCK_N columns where the widest slice has WIDE_SLICE or more, else BLOCK_N."""
    split_k = 1
    while 2 * split_k * MIN_K_PER_RANGE <= k and tokens * slices * split_k < (
        SHRINK_PROGRAMS_PER_SM * sms
    ):
        split_k *= 2
    return split_k, WIDE_BLOCK_N if widest >= WIDE_SLICE else BLOCK_N


@dataclass(frozen=True)
class _Launch:
    """What the decode kernel launches with: the call's shape, its launch shape and the padded
    slices."""

    tokens: int
    k: int
    slices: int
    rank: int
    block_r: int
    block_k: int
    split_k: int
    block_n: int
    a: list[torch.Tensor]
    b: list[torch.Tensor]
    widths: list[int]
    use_pdl: bool

    @property
    def pdl(self) -> dict[str, bool]:
        return {"launch_pdl": True} if self.use_pdl else {}


def _plan(
    y: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
    split_k: int | None, block_n: int | None,
) -> _Launch | None:  # fmt: skip
    shape = call_shape(y, x, lora_a, lora_b)
    if shape is None:
        return None
    num_tokens, k, slices, rank, block_r = shape
    on_cuda = x.device.type == "cuda"
    sms = _sm_count(x.device.index or 0) if on_cuda else 4
    auto_split, auto_n = launch_shape(num_tokens, k, slices, max(t.shape[2] for t in lora_b), sms)
    a, b, widths = padded_slices(lora_a, lora_b)
    return _Launch(
        num_tokens, k, slices, rank, block_r, 128 if k >= 128 else triton.next_power_of_2(k),
        split_k or auto_split, block_n or auto_n, a, b, widths,
        on_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9,
    )  # fmt: skip


def _workspace(plan: _Launch, x: torch.Tensor) -> torch.Tensor:
    shape = (plan.slices, plan.tokens, plan.split_k, plan.block_r)
    return torch.empty(shape, dtype=torch.float32, device=x.device)


_SYNC: dict[tuple[str, int | None, int, int], torch.Tensor] = {}


def sync_cells(device: torch.device, cells: int) -> torch.Tensor:
    """int32 zeros, 2 x `cells` of them, for `lora_dense`'s counters on `device`: one buffer per
    size and stream (the current one; a launch on another stream at the same time would share
    the counters of this one), kept for the process (a CUDA graph captured with one replays its
    address; each launch leaves it zeroed)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device.type, device.index, cells, stream)
    if key not in _SYNC:
        _SYNC[key] = torch.zeros(2 * cells, dtype=torch.int32, device=device)
    return _SYNC[key]


def lora_dense(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: list[torch.Tensor],
    lora_b: list[torch.Tensor],
    token_lora_mapping: torch.Tensor,
    scale: float = 1.0,
    add_inputs: bool = True,
    split_k: int | None = None,
    block_n: int | None = None,
) -> None:
    """y (+)= LoRA delta per the module docstring, in one launch (`kernels`); split_k and
    block_n None: `launch_shape`'s. Each expand program waits only for its own token and
    slice's shrinks, on counters of the current stream's own (`sync_cells`)."""
    plan = _plan(y, x, lora_a, lora_b, split_k, block_n)
    if plan is None:
        return
    ws = _workspace(plan, x)
    sync = sync_cells(x.device, plan.slices * plan.tokens)
    n_tiles = triton.cdiv(max(plan.widths), plan.block_n)
    grid = (plan.tokens * plan.slices * (plan.split_k + n_tiles),)
    kt.lora_dense_kernel[grid](
        x, *plan.a, *plan.b, y, ws, sync, token_lora_mapping, scale, plan.k, *plan.widths,
        plan.tokens, n_tiles, lora_a[0].shape[0], x.stride(0), lora_a[0].stride(0),
        lora_a[0].stride(2), y.stride(0), *(t.stride(0) for t in plan.b), lora_b[0].stride(2),
        SLICES=plan.slices, BLOCK_R=plan.block_r, RANK=plan.rank, BLOCK_K=plan.block_k,
        BLOCK_N=plan.block_n, SPLIT_K=plan.split_k, ADD_INPUTS=add_inputs,
        USE_PDL=plan.use_pdl, **plan.pdl,
    )  # fmt: skip
