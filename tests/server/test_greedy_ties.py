"""The rule the GPU guard test holds greedy outputs to (tests/support/greedy_ties.py): the same
tokens, or the same up to a swap of two tokens within TIE_MARGIN in both runs."""

from __future__ import annotations

import math

from tests.support.greedy_ties import TIE_MARGIN, Greedy, Tally, compare


def greedy(*steps: tuple[int, int, float]) -> Greedy:
    """Positions of (chosen token, runner-up, lead), as vLLM's top-2 log-probabilities."""
    return Greedy.of([t for t, _, _ in steps], [{t: -1.0, r: -1.0 - lead} for t, r, lead in steps])


def test_the_lead_and_runner_up_come_from_the_logprobs() -> None:
    got = Greedy.of([5, 6], [{5: -0.5, 7: -0.75, 9: -3.0}, {6: -1.0, 8: -1.0}])
    assert got.runner_up == (7, 8)
    assert got.margins == (0.25, 0.0)


def test_without_logprobs_the_lead_is_unknown() -> None:
    got = Greedy.of([5], None)
    assert got.runner_up == (None,)
    assert math.isnan(got.margins[0])


def test_same_tokens_hold_and_count_every_position() -> None:
    a = greedy((1, 2, 0.5), (3, 4, 0.015625), (5, 6, 2.0))
    c = compare(a, a)
    assert c.holds and c.first_difference is None and c.positions == 3
    assert c.min_margin == 0.015625


def test_a_swap_within_the_tie_margin_holds_and_stops_the_comparison() -> None:
    reference = greedy((1, 2, 0.5), (3, 4, 0.0078125), (5, 6, 2.0), (7, 8, 2.0))
    # After the flip the continuation may go anywhere: positions 2 and 3 differ freely.
    got = greedy((1, 2, 0.5), (4, 3, 0.0), (9, 10, 3.0), (11, 12, 3.0))
    c = compare(reference, got)
    assert c.first_difference == 1 and c.positions == 2
    assert c.swapped and c.tie_flip and c.holds
    assert Tally.of([c]).flips == 1


def test_a_swap_past_the_tie_margin_is_a_difference() -> None:
    reference = greedy((1, 2, 2 * TIE_MARGIN), (3, 4, 1.0))
    got = greedy((2, 1, 0.0), (3, 4, 1.0))
    c = compare(reference, got)
    assert c.swapped and not c.tie_flip and not c.holds
    assert Tally.of([c]).differences == 1


def test_a_swap_needs_both_runs_near_the_tie() -> None:
    reference = greedy((1, 2, 0.0))
    got = greedy((2, 1, 2 * TIE_MARGIN))  # got's lead is far from a tie: more than rounding
    assert not compare(reference, got).holds


def test_a_token_that_was_not_the_runner_up_is_a_difference() -> None:
    reference = greedy((1, 2, 0.0))
    got = greedy((9, 1, 0.0))
    c = compare(reference, got)
    assert not c.swapped and not c.holds


def test_a_difference_without_logprobs_is_a_difference() -> None:
    assert not compare(Greedy.of([1], None), Greedy.of([2], None)).holds


def test_outputs_of_different_lengths_differ() -> None:
    a = greedy((1, 2, 0.5), (3, 4, 0.5))
    c = compare(a, greedy((1, 2, 0.5)))
    assert c.first_difference == 1 and not c.holds


def test_a_tally_sums_positions_and_keeps_the_smallest_lead() -> None:
    a = greedy((1, 2, 0.5), (3, 4, 0.25))
    b = greedy((5, 6, 0.125))
    tally = Tally.of([compare(a, a), compare(b, b)])
    assert (tally.requests, tally.positions, tally.flips, tally.differences) == (2, 3, 0, 0)
    assert tally.min_margin == 0.125
    assert "3 positions compared" in tally.line()
