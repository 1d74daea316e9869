"""The dense (attention) LoRA ops, decode (per-token) and prefill (tiled by adapter), against
their plain-torch spec, on the CPU interpreter in fp32 and fp16: q/k/v-like slices of different
widths, odd sizes, tokens without adapter."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from loraplex.kernels.ops.lora_dense.op import (
    UnsupportedDenseCall,
    launch_shape,
    lora_dense,
    sync_cells,
)
from loraplex.kernels.ops.lora_dense.reference import lora_dense_reference, lora_sort_meta
from loraplex.kernels.ops.lora_dense.tiled import lora_dense_tiled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make(tokens: int, k: int, rank: int, widths: list[int], slots: int, dtype: torch.dtype,
         seed: int) -> tuple:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen)
    a = [torch.randn(slots, 1, rank, k, generator=gen) / k**0.5 for _ in widths]
    b = [torch.randn(slots, 1, n, rank, generator=gen) / rank**0.5 for n in widths]
    tlm = torch.randint(-1, slots, (tokens,), generator=gen, dtype=torch.int32)
    y = torch.randn(tokens, sum(widths) + 3, generator=gen)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(DEVICE, dtype if t.is_floating_point() else t.dtype)

    return put(y), put(x), [put(t) for t in a], [put(t) for t in b], put(tlm)


def updates_as_reference(
    y: torch.Tensor, x: torch.Tensor, a: list[torch.Tensor], b: list[torch.Tensor],
    tlm: torch.Tensor, dtype: torch.dtype, add_inputs: bool, run_op: Callable[[], None],
) -> bool:  # fmt: skip
    """Run the op on y (scale 0.5) and hold it to the spec: tokens without adapter bit for bit
    unchanged, the others within the dtype's tolerance. True if any token was updated."""
    if not add_inputs:
        y.fill_(777.0)  # poison: updated cells must be overwritten, the rest left alone
    ref = y.double().cpu()
    cpu = ([t.cpu() for t in a], [t.cpu() for t in b])
    lora_dense_reference(ref, x.cpu(), *cpu, tlm.cpu(), 0.5, add_inputs)
    run_op()
    out = y.double().cpu()
    touched = tlm.cpu() >= 0
    assert torch.equal(out[~touched], ref[~touched])
    if not touched.any():
        return False
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((out - ref)[touched].norm() / ref[touched].norm()) < tol
    return True


@pytest.mark.parametrize(
    ("tokens", "k", "rank", "widths", "slots", "split_k", "block_n"),
    [
        (1, 256, 16, [64, 16, 16], 8, 2, 32),  # q, k, v: k and v have fewer N tiles than q
        (7, 100, 8, [63], 1, 1, 32),  # odd K and N, one adapter
        (16, 192, 32, [48, 48], 16, 3, 16),  # three K ranges, three N tiles per slice
        (33, 64, 64, [40, 8, 8], 4, 1, 64),  # one N tile per slice
        (16, 512, 32, [96, 32, 32], 8, None, None),  # the launch shape of `launch_shape`
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("add_inputs", [True, False], ids=["add", "overwrite"])
def test_matches_reference_and_leaves_the_counters_at_zero(
    tokens: int, k: int, rank: int, widths: list[int], slots: int, split_k: int | None,
    block_n: int | None, dtype: torch.dtype, add_inputs: bool,
) -> None:  # fmt: skip
    """The decode op: the spec's numbers, and its counters back at zero after each call, so a
    second call on the same input and the same cells gives the same bits."""
    y, x, a, b, tlm = make(tokens, k, rank, widths, slots, dtype, seed=tokens)
    second = y.clone()
    if not add_inputs:
        second.fill_(777.0)  # what `updates_as_reference` writes into y before the call

    def run() -> None:
        lora_dense(y, x, a, b, tlm, 0.5, add_inputs, split_k=split_k, block_n=block_n)

    assert updates_as_reference(y, x, a, b, tlm, dtype, add_inputs, run)
    cells = sync_cells(x.device, len(widths) * tokens)
    assert not cells.any()
    lora_dense(second, x, a, b, tlm, 0.5, add_inputs, split_k=split_k, block_n=block_n)
    assert torch.equal(second, y)
    assert not cells.any()


def test_tokens_without_adapter_leave_y_and_the_counters_alone() -> None:
    y, x, a, b, tlm = make(5, 64, 8, [32, 16], 4, torch.float32, seed=3)
    tlm.fill_(-1)
    before = y.clone()
    lora_dense(y, x, a, b, tlm, 0.5, True, split_k=2, block_n=16)
    assert torch.equal(y, before)
    assert not sync_cells(x.device, 2 * 5).any()


@pytest.mark.parametrize(
    ("tokens", "k", "rank", "widths", "slots", "lora_pattern"),
    [
        (200, 256, 16, [80, 16, 16], 8, "random"),  # q, k, v widths; groups of odd sizes
        (129, 100, 8, [63], 1, "random"),  # odd K (masked tail) and N, one adapter
        (97, 192, 32, [48, 48], 4, "runs"),  # each request's tokens in one run, as in prefill
        (65, 64, 64, [40, 8, 8], 16, "one"),  # a single adapter, slots beyond it idle
        (80, 64, 16, [32], 4, "none"),  # no token has an adapter: y untouched
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("add_inputs", [True, False], ids=["add", "overwrite"])
def test_tiled_matches_reference(
    tokens: int, k: int, rank: int, widths: list[int], slots: int, lora_pattern: str,
    dtype: torch.dtype, add_inputs: bool,
) -> None:  # fmt: skip
    y, x, a, b, tlm = make(tokens, k, rank, widths, slots, dtype, seed=tokens)
    if lora_pattern == "runs":  # runs of 1 to 40 tokens, each of one slot or none
        gen = torch.Generator().manual_seed(7)
        lens = torch.randint(1, 41, (tokens,), generator=gen).cumsum(0)
        run = torch.searchsorted(lens, torch.arange(tokens), right=True)
        tlm = (run % (slots + 1) - 1).to(torch.int32).to(tlm.device)  # -1, 0, 1, ... in turn
    elif lora_pattern == "one":
        tlm.fill_(slots // 2)
    elif lora_pattern == "none":
        tlm.fill_(-1)

    def run() -> None:
        lora_dense_tiled(y, x, a, b, 0.5, *lora_sort_meta(tlm, slots), add_inputs, block_n=32)

    updated = updates_as_reference(y, x, a, b, tlm, dtype, add_inputs, run)
    assert updated == (lora_pattern != "none")


def test_sort_meta_groups_tokens_as_vllm_does() -> None:
    """LoRAKernelMeta's layout: stable sort by slot, -1 first, per-group counts and starts."""
    tlm = torch.tensor([2, -1, 0, 2, 0, -1, 2], dtype=torch.int32)
    order, counts, starts, ids = lora_sort_meta(tlm, max_loras=4)
    assert order.tolist() == [1, 5, 2, 4, 0, 3, 6]
    assert ids.tolist() == [-1, 0, 2, -1, -1]
    assert counts.tolist() == [2, 2, 3, 0, 0]
    assert starts.tolist() == [0, 2, 4, 7, 0, 0]  # zeros past the last group, as in vLLM


def test_layouts_it_does_not_take_are_refused() -> None:
    y, x, a, b, tlm = make(2, 64, 8, [16, 16, 16, 16], 2, torch.float32, seed=1)
    with pytest.raises(UnsupportedDenseCall, match="1 to 3 slices"):
        lora_dense(y, x, a, b, tlm)
    with pytest.raises(UnsupportedDenseCall, match=r"must be \(L, 1, R, K=64\)"):
        lora_dense(y, x, [a[0][:, 0]], [b[0]], tlm)


@pytest.mark.parametrize(
    ("tokens", "k", "slices", "widest", "want"),
    [
        (16, 4096, 1, 2048, (16, 128)),  # o at decode: ranges of 256, not 32 of 128
        (16, 2048, 3, 4096, (8, 256)),  # qkv: q's 4096 columns take 256-wide tiles
        (64, 2048, 3, 4096, (4, 256)),  # enough shrink programs: 64 x 3 x 4 >= 4 x 132
        (1, 4096, 1, 2048, (16, 128)),  # one token: ranges stop at 256 of K
        (4, 300, 1, 64, (1, 128)),  # K under two ranges of 256: no split
    ],
)
def test_launch_shape_keeps_k_ranges_of_256_and_widens_tiles_for_wide_slices(
    tokens: int, k: int, slices: int, widest: int, want: tuple[int, int]
) -> None:
    assert launch_shape(tokens, k, slices, widest, sms=132) == want
