"""The LoRA warm-up's ladder of prefill sizes and logits row counts."""

from __future__ import annotations

import itertools

import pytest

from loraplex.kernels.vllm.warm_up import WARM_UP_FIRST_TOKENS, warm_up_rows, warm_up_sizes


@pytest.mark.parametrize("max_tokens", [8192, 2048, 5000, 100])
def test_warm_up_sizes_reach_every_range_with_both_divisibilities(max_tokens: int) -> None:
    sizes = warm_up_sizes(max_tokens)
    assert sizes == sorted(set(sizes), reverse=True)
    assert sizes[0] == max_tokens and sizes[-1] == WARM_UP_FIRST_TOKENS
    # No size range is skipped: neighbours are at most sqrt(2) apart.
    assert all(a / b <= 2**0.5 + 1e-9 for a, b in itertools.pairwise(sizes))
    assert any(n % 16 == 0 for n in sizes) and any(n % 16 for n in sizes)


def test_warm_up_below_the_first_size_is_one_step_of_the_whole_budget() -> None:
    assert warm_up_sizes(WARM_UP_FIRST_TOKENS // 2) == [WARM_UP_FIRST_TOKENS // 2]


def test_warm_up_rows_cover_one_row_and_both_sides_of_128_within_the_batch() -> None:
    assert warm_up_rows(256) == [1, 2, 16, 128, 129, 144]
    assert warm_up_rows(64) == [1, 2, 16]
    assert warm_up_rows(1) == [1]
