"""Which form each (tokens, pairs) point takes under the dispatch table (kernels/dispatch.py): the
two MoE shapes the kernels were tuned on, on either side of every threshold."""

from __future__ import annotations

import dataclasses

import pytest

from loraplex.kernels.dispatch import REGIMES, Regimes


@dataclasses.dataclass(frozen=True)
class Point:
    """A batch as the plugin sees it: tokens, experts per token, experts, LoRA slots, the count of
    active adapters where vLLM captures a graph per count (else None), and vLLM's own choice of
    routing form and sorted block for it (its rule: naive while pairs x 8 <= experts x slots)."""

    tokens: int
    top_k: int
    experts: int
    max_loras: int
    active: int | None
    vllm_naive: bool
    vllm_block: int

    @property
    def pairs(self) -> int:
        return self.tokens * self.top_k


SHAPES = {  # experts, top_k, LoRA slots
    "qwen3": (128, 8, 8),  # 1,024 slot-experts; vLLM naive up to 16 tokens
    "gpt-oss": (32, 4, 8),  # 256 slot-experts; vLLM naive up to 8 tokens
    "wide": (512, 8, 32),  # 16,384 slot-experts; vLLM naive up to 256 tokens
}
# shape, tokens, vLLM's block, active adapters (None: count unknown) -> the forms taken
# fmt: off
TABLE = [
    ("qwen3",   1,     16,  None,  "gemv",  "vllm", "naive",  16,  "decode"),
    ("qwen3",   16,    16,  None,  "gemv",  "vllm", "naive",  16,  "decode"),
    ("qwen3",   64,    32,  None,  "gemv",  "vllm", "naive",  16,  "decode"),  # last GEMV
    ("qwen3",   65,    32,  None,  "tiled", "vllm", "naive",  16,  "decode"),
    ("qwen3",   128,   64,  None,  "tiled", "vllm", "naive",  16,  "decode"),  # naive cap
    ("qwen3",   129,   64,  None,  "tiled", "vllm", "sorted", 16,  "decode"),
    ("qwen3",   255,   64,  None,  "tiled", "vllm", "sorted", 16,  "decode"),
    ("qwen3",   256,   64,  None,  "tiled", "ours", "sorted", 16,  "decode"),  # our align
    ("qwen3",   1023,  128, None,  "tiled", "ours", "sorted", 16,  "decode"),
    ("qwen3",   1024,  128, None,  "tiled", "ours", "sorted", 16,  "first prefill"),
    ("qwen3",   1025,  128, None,  "tiled", "ours", "sorted", 32,  "prefill"),
    ("qwen3",   1025,  16,  None,  "tiled", "ours", "sorted", 16,  "prefill"),  # vLLM's smaller
    ("qwen3",   2048,  128, None,  "tiled", "ours", "sorted", 32,  "prefill"),
    ("qwen3",   2049,  128, None,  "tiled", "ours", "sorted", 64,  "prefill"),
    ("qwen3",   4096,  128, None,  "tiled", "ours", "sorted", 64,  "prefill"),
    ("qwen3",   4097,  128, None,  "tiled", "ours", "sorted", 128, "prefill"),  # vLLM's block
    ("qwen3",   25600, 128, None,  "tiled", "ours", "sorted", 128, "prefill"),  # 16 x 1,600
    ("gpt-oss", 9,     16,  None,  "gemv",  "vllm", "naive",  16,  "decode"),  # vLLM sorts
    ("gpt-oss", 64,    32,  None,  "gemv",  "vllm", "naive",  16,  "decode"),
    ("gpt-oss", 65,    32,  None,  "tiled", "vllm", "sorted", 16,  "decode"),
    ("gpt-oss", 512,   64,  None,  "tiled", "ours", "sorted", 16,  "decode"),
    ("gpt-oss", 2048,  128, None,  "tiled", "ours", "sorted", 64,  "first prefill"),
    # Where the count of active adapters is known: at most 4 pairs per (adapter, expert).
    ("qwen3",   64,    32,  1,     "gemv",  "vllm", "naive",  16,  "decode"),
    ("qwen3",   65,    32,  1,     "tiled", "vllm", "sorted", 16,  "decode"),
    ("gpt-oss", 32,    32,  1,     "gemv",  "vllm", "naive",  16,  "decode"),
    ("gpt-oss", 33,    32,  1,     "gemv",  "vllm", "sorted", 16,  "decode"),
    ("gpt-oss", 33,    32,  8,     "gemv",  "vllm", "naive",  16,  "decode"),
    # vLLM's own naive rule stands past our cap of 1,024 pairs.
    ("wide",    256,   64,  None,  "tiled", "ours", "naive",  16,  "decode"),
]
# fmt: on
REGIME = {
    "decode": (True, False, False),  # (PDL, side stream, tuner's prefill candidates)
    "first prefill": (True, True, True),
    "prefill": (False, True, True),
}


def point(shape: str, tokens: int, vllm_block: int, active: int | None) -> Point:
    experts, top_k, slots = SHAPES[shape]
    return Point(tokens, top_k, experts, slots, active, tokens * top_k * 8 <= experts * slots,
                 vllm_block)  # fmt: skip


def forms(batch: Point, regimes: Regimes = REGIMES) -> tuple[object, ...]:
    """(dense, align, routing, block, PDL, side stream, prefill candidates) of `batch`."""
    pairs, experts, slots = batch.pairs, batch.experts, batch.max_loras
    naive = regimes.naive(pairs, experts, slots, batch.vllm_naive, batch.active)
    return (
        "gemv" if regimes.dense_gemv(batch.tokens) else "tiled",
        "ours" if regimes.our_align(pairs) else "vllm",
        "naive" if naive else "sorted",
        regimes.block_m(pairs, experts, slots, batch.vllm_block),
        regimes.pdl(pairs),
        regimes.side_stream(pairs),
        regimes.prefill(pairs),
    )


@pytest.mark.parametrize(
    "row", TABLE, ids=[f"{r[0]}-{r[1]}tok-block{r[2]}-active{r[3]}" for r in TABLE]
)
def test_each_point_takes_its_form(row: tuple) -> None:
    shape, tokens, vllm_block, active, dense, align, routing, block, regime = row
    expected = (dense, align, routing, block, *REGIME[regime])
    assert forms(point(shape, tokens, vllm_block, active)) == expected


def test_the_three_prefill_boundaries_move_together() -> None:
    """PDL, the side stream and the tuner's prefill candidates all turn at one field."""
    moved = dataclasses.replace(REGIMES, prefill_min_pairs=4096)
    regime = {n: forms(point("qwen3", n, 64, None), moved)[4:] for n in (511, 512, 513)}
    assert regime == {511: REGIME["decode"], 512: REGIME["first prefill"], 513: REGIME["prefill"]}
