"""bench.soak's schedule and its reading of the bystanders' tokens (pure logic, no server)."""

from __future__ import annotations

import itertools

import pytest

from bench.soak import SETTLE_S, gaps_ending_in, itl, schedule
from bench.soak_chaos import Window


def test_the_schedule_fits_its_phases_apart_inside_the_run() -> None:
    for minutes, phase_s, every_s in ((10, 20, 60), (1, 10, 25), (2, 10, 60), (3, 20, 42)):
        events = schedule(minutes, phase_s, every_s)
        assert [kind for _, kind in events].count("poison") == 1
        assert any(kind == "oversized" for _, kind in events)
        # Each phase has its steady reference before it, clear of the one before that.
        starts = [at for at, _ in events]
        assert starts[0] >= phase_s + SETTLE_S
        for earlier, later in itertools.pairwise(starts):
            assert later - phase_s - SETTLE_S >= earlier + phase_s + SETTLE_S, events
        assert starts[-1] + phase_s <= minutes * 60, events


@pytest.mark.parametrize(("minutes", "phase_s", "every_s"), [(10, 20, 30), (1, 20, 60)])
def test_a_schedule_that_cannot_hold_its_phases_is_refused(
    minutes: float, phase_s: float, every_s: float
) -> None:
    with pytest.raises(ValueError, match=r"--every-s|need two"):
        schedule(minutes, phase_s, every_s)


def _request(*times: float) -> dict[str, object]:
    return {
        "stream": 0,
        "status": 200,
        "error": None,
        "text": "",
        "tokens": [[t, 1] for t in times],
    }


def test_a_stall_counts_in_the_window_where_it_ends() -> None:
    stalled = _request(9.0, 9.1, 12.0, 12.1)  # a 2.9 s gap ending at 12.0
    assert gaps_ending_in([stalled], 10.0, 13.0) == [12.0 - 9.1, 12.1 - 12.0]
    assert gaps_ending_in([stalled], 0.0, 9.5) == [9.1 - 9.0]


def test_itl_compares_each_phase_with_the_steady_time_before_it() -> None:
    steady = [i * 0.1 for i in range(1, 200)]  # 0.1 s gaps over 20 s
    stall = [20.0, 20.5, 20.6]  # one 0.5 s gap inside the oversized phase at 20-21 s
    requests = [_request(*steady), _request(*stall)]
    window = Window("oversized", start=20.0, end=21.0)
    out = itl(requests, [window], phase_s=10.0, span=(0.0, 21.0))
    assert out["oversized"]["max_ms"] == 500.0
    assert out["oversized"]["before_p99_ms"] == 100.0
    assert out["steady"]["max_ms"] == 100.0  # the stall is not steady time
    assert out["worst"] == {"ms": 500.0, "at_s": 20.5, "in": "oversized"}
    assert out["poison"]["gaps"] == 0 and out["poison"]["p99_increase_ms"] is None
