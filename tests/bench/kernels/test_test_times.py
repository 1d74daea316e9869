"""test_times reads pytest-reportlog's lines: outcomes per test, slowest first, failures named."""

from __future__ import annotations

import json

from bench.kernels.test_times import summarize


def _report(test: str, when: str, outcome: str, duration: float) -> str:
    return json.dumps(
        {"$report_type": "TestReport", "nodeid": test, "when": when, "outcome": outcome,
         "duration": duration}
    )  # fmt: skip


def test_counts_outcomes_sums_phases_names_failures_and_skips_a_cut_line() -> None:
    lines = [
        json.dumps({"$report_type": "SessionStart", "pytest_version": "9.2.0"}),
        _report("t.py::slow", "setup", "passed", 1.0),
        _report("t.py::slow", "call", "passed", 30.0),
        _report("t.py::slow", "teardown", "passed", 0.5),
        _report("t.py::bad", "setup", "passed", 0.1),
        _report("t.py::bad", "call", "failed", 2.0),
        _report("t.py::bad", "teardown", "passed", 0.1),
        _report("t.py::broken_teardown", "call", "passed", 0.2),
        _report("t.py::broken_teardown", "teardown", "failed", 0.1),
        _report("t.py::skipped", "setup", "skipped", 0.0),
        "",
        '{"$report_type": "TestReport", "nodeid": "t.py::cut", "wh',
    ]
    out = summarize(lines, top=2)
    assert out[0] == "2 failed, 1 passed, 1 skipped"
    assert out[1] == "    31.5 s  t.py::slow"
    assert out[2] == "     2.2 s  t.py::bad"
    assert out[3:] == ["FAILED t.py::bad", "FAILED t.py::broken_teardown"]


def test_a_log_with_no_test_says_so() -> None:
    assert summarize([], top=5) == ["no test ended"]
