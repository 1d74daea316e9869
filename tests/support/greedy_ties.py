"""Greedy outputs compared with a reference run's, telling a tie flip apart from a difference.

Two runs of the same requests on the same kernels can still round differently (another kernel
variant picked for an address's alignment, a sum in another order), and greedy decoding then
picks the other of two near-tied tokens; after such a flip the two continuations have different
prefixes, so they may diverge anywhere. A leak or a wrong kernel differs where the reference
had a clear lead, or gives a token that was not the runner-up.

So a request is compared up to its first differing position only, and a difference there
passes when it is a tie flip: the two runs swapped the same two tokens (each run's token is the
other's runner-up), and each run's lead there is at most TIE_MARGIN.

TIE_MARGIN: the lead is a difference of log-probabilities, that is of two logits, which the
model's lm_head writes in bf16 (vLLM's sampler casts them to fp32 after): 8 significant bits, so
logits of magnitude 1 to 2 lie 2**-7 apart (`torch.finfo(torch.bfloat16).eps` = 0.0078125),
2 to 4 2**-6 apart. A sum rounded in another order moves a logit to a neighbouring bf16 value,
a spacing or two. The e2e check's flips on the H200 (the same small MoE model, plugin against
stock) were at leads of 0.0 and 0.0078, one spacing (e9732ec). TIE_MARGIN = 2**-5 is four
spacings at magnitude 1 to 2 (two at 2 to 4): a swap needs a change of at least both leads
summed, so two spacings on each of the two logits at most. Any lead above it is a real
difference, and so is a flip where margins are unknown.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

TIE_MARGIN = 2**-5


@dataclass(frozen=True)
class Greedy:
    """One request's greedy output: its tokens and, at each position, the best other token and
    the chosen token's lead over it (log-probability difference; 0 for an exact tie, NaN where
    unknown: the request asked for fewer than two log-probabilities)."""

    tokens: tuple[int, ...]
    runner_up: tuple[int | None, ...]
    margins: tuple[float, ...]

    @classmethod
    def of(cls, tokens: Sequence[int], steps: Sequence[Mapping[int, float]] | None) -> Greedy:
        """From the tokens and, per position, the log-probabilities returned (token -> value,
        the chosen token's among them); `steps` None: no log-probabilities."""
        runner_up: list[int | None] = []
        margins: list[float] = []
        for i, token in enumerate(tokens):
            step = steps[i] if steps is not None and i < len(steps) else {}
            others = [(value, other) for other, value in step.items() if other != token]
            if token not in step or not others:
                runner_up.append(None)
                margins.append(math.nan)
                continue
            value, other = max(others)
            runner_up.append(other)
            margins.append(step[token] - value)
        return cls(tuple(tokens), tuple(runner_up), tuple(margins))


@dataclass(frozen=True)
class Comparison:
    """A request's output against the reference's, up to the first difference."""

    positions: int  # positions compared: all of them, or up to and including the first difference
    first_difference: int | None
    reference_margin: float  # the reference's lead there (NaN without a difference)
    margin: float  # this run's lead there
    swapped: bool  # each run's token there is the other's runner-up
    min_margin: float  # the reference's smallest lead over the positions compared

    @property
    def tie_flip(self) -> bool:
        """The first difference is a swap of two tokens both runs had within TIE_MARGIN."""
        return (
            self.first_difference is not None
            and self.swapped
            and self.reference_margin <= TIE_MARGIN
            and self.margin <= TIE_MARGIN
        )

    @property
    def holds(self) -> bool:
        """Same tokens, or the same up to a tie flip."""
        return self.first_difference is None or self.tie_flip

    def describe(self) -> str:
        if self.first_difference is None:
            return "same"
        kind = "tie flip" if self.tie_flip else ("swap" if self.swapped else "not a swap")
        return (f"differs at {self.first_difference}: margins {self.reference_margin:.4f} "
                f"(reference) / {self.margin:.4f}, {kind}")  # fmt: skip


def compare(reference: Greedy, got: Greedy) -> Comparison:
    """`got` against `reference` (see the module docstring). Outputs of different lengths differ
    at the shorter one's end, where neither has a runner-up to swap."""
    length = min(len(reference.tokens), len(got.tokens))
    at = next((i for i in range(length) if reference.tokens[i] != got.tokens[i]), None)
    if at is None and len(reference.tokens) != len(got.tokens):
        at = length
    compared = len(reference.tokens) if at is None else at + 1
    leads = [m for m in reference.margins[:compared] if not math.isnan(m)]
    min_margin = min(leads, default=math.inf)
    if at is None or at == length:
        return Comparison(compared, at, math.nan, math.nan, False, min_margin)
    swapped = (
        got.tokens[at] == reference.runner_up[at] and reference.tokens[at] == got.runner_up[at]
    )
    return Comparison(compared, at, reference.margins[at], got.margins[at], swapped, min_margin)


@dataclass(frozen=True)
class Tally:
    """Comparisons of a run's requests, summed: what a summary line reports."""

    requests: int
    positions: int
    flips: int  # first differences that are tie flips
    differences: int  # first differences that are not
    min_margin: float

    @classmethod
    def of(cls, comparisons: Iterable[Comparison]) -> Tally:
        items = list(comparisons)
        return cls(
            requests=len(items),
            positions=sum(c.positions for c in items),
            flips=sum(c.tie_flip for c in items),
            differences=sum(not c.holds for c in items),
            min_margin=min((c.min_margin for c in items), default=math.inf),
        )

    def line(self) -> str:
        return (f"{self.requests} requests, {self.positions} positions compared, "
                f"{self.flips} tie flips, {self.differences} differences, "
                f"min reference margin {self.min_margin:.4f}")  # fmt: skip
